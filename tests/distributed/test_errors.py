"""Bad input to ShardedMixedPrecisionOptimizer: clear errors that name the value and the fix."""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer


def _model():
    return torch.nn.Linear(3, 2).bfloat16()


CASES = [
    (
        lambda m: torch.optim.LBFGS(m.parameters()),
        {},
        ValueError,
        "LBFGS is not a known elementwise optimizer",
    ),
    (
        lambda m: halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(m.parameters())),
        {},
        ValueError,
        "give ShardedMixedPrecisionOptimizer the plain torch optimizer",
    ),
    (lambda m: torch.optim.AdamW(m.parameters()), {"stage": 3}, ValueError, "stage must be 1 or 2"),
    (
        lambda m: torch.optim.AdamW(m.parameters()),
        {"stage": 0},
        ValueError,
        "MixedPrecisionOptimizer \\+ DDP",
    ),
    (
        lambda m: torch.optim.AdamW(m.parameters()),
        {"reduce_dtype": "fp16"},
        ValueError,
        "reduce_dtype must be",
    ),
    (
        lambda m: torch.optim.AdamW(m.parameters()),
        {"grad_accum_dtype": "fp32", "reduce_dtype": "param"},
        ValueError,
        "grad_accum_dtype='fp32' with reduce_dtype='param'.*pass reduce_dtype='fp32'",
    ),
    (
        lambda m: torch.optim.AdamW(m.parameters()),
        {"grad_accum_dtype": torch.bfloat16},
        ValueError,
        r"grad_accum_dtype must be one of \('param', 'fp32'\), got torch.bfloat16; use 'param'",
    ),
    (
        # fp32 accumulation passes the option checks: refused only for the missing process group
        lambda m: torch.optim.AdamW(m.parameters()),
        {"grad_accum_dtype": "fp32", "stage": 2},
        RuntimeError,
        "needs an initialized process group",
    ),
    (lambda m: torch.optim.AdamW(m.parameters()), {"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    (lambda m: torch.optim.AdamW(m.parameters()), {"param_dtype": torch.float64}, ValueError, "param_dtype"),
    (lambda m: torch.optim.AdamW(m.parameters()), {}, RuntimeError, "needs an initialized process group"),
    (
        # refused before the process group is looked for: the value and the fix, not "not iterable"
        lambda m: torch.optim.AdamW(m.parameters()),
        {"named_parameters": None},
        ValueError,
        "^named_parameters must be the model or its named_parameters\\(\\), got None; pass named_parameters=model",
    ),
    (
        lambda m: torch.optim.AdamW(m.parameters()),
        {"named_parameters": 3},
        ValueError,
        "got 3; pass named_parameters=model",
    ),
]


@pytest.mark.parametrize(("make", "kwargs", "error", "message"), CASES)
def test_errors(make, kwargs, error, message):
    model = _model()
    with pytest.raises(error, match=message):
        ShardedMixedPrecisionOptimizer(make(model), **{"named_parameters": model, **kwargs})


def test_lamb_like_optimizers_are_refused_by_name():
    class Lamb(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-3})

    model = _model()
    with pytest.raises(ValueError, match="Lamb is not a known elementwise optimizer.*LAMB, LBFGS"):
        ShardedMixedPrecisionOptimizer(Lamb(model.parameters()), named_parameters=model)
