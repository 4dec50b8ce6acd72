"""``Engine.forward`` casts floating-point inputs to the training dtype, and nothing else."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

import halfprec


class _Echo(torch.nn.Module):
    """Returns what it was given, so the test sees the inputs as the model saw them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, *args, **kwargs):
        return args, kwargs


def _engine(model: torch.nn.Module, precision: str) -> halfprec.Engine:
    return halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_float_inputs_are_cast_to_the_model_dtype(precision, dtype):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    engine = _engine(model, precision)
    x = torch.randn(2, 8)
    out = engine(x)  # raised "mat1 and mat2 must have the same dtype" before the cast
    assert out.dtype == dtype
    assert torch.equal(out, engine.forward(x)) and torch.equal(out, model(x.to(dtype)))
    assert x.dtype == torch.float32  # the caller's tensor is not modified


def test_only_floating_tensors_are_cast_through_containers():
    engine = _engine(_Echo(), "bf16")
    Pair = namedtuple("Pair", "a b")
    ids, mask, f = torch.arange(3), torch.tensor([True, False]), torch.randn(2)
    args, kwargs = engine(ids, [f, ids], Pair(f, 7), mask=mask, extra=OrderedDict(x=f, n="text"))
    assert args[0] is ids and args[1][1] is ids and kwargs["mask"] is mask  # int and bool: unchanged
    assert args[1][0].dtype == torch.bfloat16 and isinstance(args[1], list)
    assert isinstance(args[2], Pair) and args[2].a.dtype == torch.bfloat16 and args[2].b == 7
    assert isinstance(kwargs["extra"], OrderedDict) and kwargs["extra"]["x"].dtype == torch.bfloat16
    assert kwargs["extra"]["n"] == "text"


def test_fp32_engine_and_module_leave_inputs_alone():
    f = torch.randn(2)
    args, _ = _engine(_Echo(), "fp32")(f)
    assert args[0] is f
    engine = _engine(_Echo(), "fp16")
    args, _ = engine.module(f)  # the escape hatch: the model itself, uncast inputs
    assert args[0] is f
