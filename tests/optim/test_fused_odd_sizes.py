"""Every fused algorithm on sizes that end in a partial kernel block (1, 127, 4097, 2**16+3), fp16 and fp32 (the
interpreter on CPU), against the exact torch path: a skipped (overflow) step, a param without a grad on one step,
then more updates; masters and state within tolerance, counters, skips and scale exactly."""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdam, FusedAdamW, FusedSGD

from .helpers import assert_params_are_rounded_masters, assert_same_state, pair, random_grads, set_grads

SIZES = [1, 127, 4097, 2**16 + 3]
ALGORITHMS = [
    (torch.optim.AdamW, FusedAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
    (torch.optim.Adam, FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    (torch.optim.SGD, FusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (torch.optim.Adagrad, FusedAdagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("torch_cls", "fused_cls", "hp"), ALGORITHMS, ids=lambda v: getattr(v, "__name__", "")
)
def test_odd_sizes_with_a_skip_and_a_missing_grad(torch_cls, fused_cls, hp, dtype):
    scaler = lambda: halfprec.DynamicLossScaler(init_scale=2.0**8, hysteresis=1)  # noqa: E731
    ref, fused, a, b = pair(torch_cls, fused_cls, SIZES, dtype, hp, scaler=scaler, max_grad_norm=1.0)
    skipped = []
    for step in range(5):
        scale = ref.loss_scale
        grads = random_grads(a, step, scale=scale, none={1} if step == 2 else ())
        if step == 1:
            grads[3][-1] = float("inf")  # the last element of the 2**16+3 param
        set_grads(a, grads)
        set_grads(b, grads)
        ref.step()
        fused.step()
        skipped.append((ref.step_was_skipped, fused.step_was_skipped))
        ref.zero_grad()
        fused.zero_grad()
    assert skipped == [(False, False), (True, True), (False, False), (False, False), (False, False)]
    assert fused.loss_scale == ref.loss_scale == 2.0**7
    assert_same_state(ref, fused, dtype)  # counters exact: param 1 has one step less
    if torch_cls is not torch.optim.SGD:
        steps = [float(st["step"]) for st in fused.state_dict()["optimizer"]["state"].values()]
        assert steps == [4.0, 3.0, 4.0, 4.0]  # 5 steps, one skipped; param 1 had no grad once
    assert_params_are_rounded_masters(fused)
