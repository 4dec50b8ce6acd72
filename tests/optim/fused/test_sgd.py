"""FusedSGD and FusedAdagrad against the exact torch path (interpreter on CPU, fp16 and fp32)."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim import FusedAdagrad, FusedSGD

from ..helpers import (
    DEVICE,
    assert_params_are_rounded_masters,
    assert_same_state,
    pair,
    run_both,
    set_grads,
)

SIZES = [9, 41, 341, 4231, 1, 127]


@pytest.mark.parametrize(
    ("hp", "dtype", "clip"),
    [
        (dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), torch.float16, 1.0),
        (dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), torch.float16, None),
        (dict(lr=0.1), torch.float32, None),
    ],
)
def test_sgd_matches_torch_path(hp, dtype, clip):
    ref, fused, a, b = pair(torch.optim.SGD, FusedSGD, SIZES, dtype, hp, max_grad_norm=clip)
    # param 2 first gets a grad at step 2: its momentum buffer starts then (a copy of the grad)
    run_both(ref, fused, a, b, 4, none_at=lambda s: {2} if s < 2 else ())
    assert_same_state(ref, fused, dtype)
    assert_params_are_rounded_masters(fused)


@pytest.mark.parametrize(
    ("hp", "dtype"),
    [
        (dict(lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1), torch.float16),
        (dict(lr=0.05), torch.float32),
    ],
)
def test_adagrad_matches_torch_path(hp, dtype):
    ref, fused, a, b = pair(torch.optim.Adagrad, FusedAdagrad, SIZES, dtype, hp, max_grad_norm=1.0)
    run_both(ref, fused, a, b, 3, none_at=lambda s: {1} if s == 1 else ())
    assert_same_state(ref, fused, dtype)
    assert_params_are_rounded_masters(fused)


ERRORS = [
    (FusedSGD, dict(nesterov=True), ValueError, r"nesterov=True needs momentum > 0"),
    (FusedSGD, dict(lr=-0.1), ValueError, r"lr must be >= 0"),
    (FusedSGD, dict(maximize=True), ValueError, r"maximize=True is not supported"),
    (FusedAdagrad, dict(lr_decay=-1.0), ValueError, r"lr_decay must be >= 0"),
]


@pytest.mark.parametrize(("cls", "kwargs", "error", "match"), ERRORS)
def test_errors(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16, device=DEVICE))], **kwargs)


def test_param_unfrozen_after_construction_is_an_error():
    """Frozen when built: it has no slot in the flat buffers; a grad on it after unfreezing must not be dropped."""
    live = torch.nn.Parameter(torch.ones(5, dtype=torch.float16, device=DEVICE))
    frozen = torch.nn.Parameter(torch.ones(3, dtype=torch.float16, device=DEVICE), requires_grad=False)
    opt = FusedSGD([live, frozen], lr=0.1)
    frozen.requires_grad_(True)
    set_grads([live, frozen], [torch.ones_like(live), torch.ones_like(frozen)])
    with pytest.raises(
        RuntimeError, match=r"shape \(3,\).*frozen \(requires_grad=False\) when the optimizer"
    ):
        opt.step()
    assert torch.equal(live.detach(), torch.ones_like(live))
    frozen.requires_grad_(False)
    opt.zero_grad()
    assert frozen.grad is None and live.grad is None


def test_momentum_switched_on_after_steps_without_it_is_refused():
    p = [torch.nn.Parameter(torch.randn(41, device=DEVICE, dtype=torch.float16))]
    opt = FusedSGD(p, lr=0.1, momentum=0.0, dampening=0.1)
    p[0].grad = torch.randn_like(p[0])
    opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    p[0].grad = torch.randn_like(p[0])
    with pytest.raises(ValueError, match=r"momentum went from 0 to 0.9 after steps"):
        opt.step()
    opt.load_state_dict(opt.state_dict())  # a load is a new starting point: momentum 0.9 from here on
    opt.step()
