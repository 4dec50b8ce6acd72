"""FusedLamb against a plain FP32 LAMB run on .grad and against the mixed-precision path fed 16-bit grads."""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.optim import FusedLamb

from ...tolerances import tol
from ..helpers import (
    DEVICE,
    assert_params_are_rounded_masters,
    assert_same_state,
    pair,
    random_grads,
    set_grads,
)
from ..lamb_reference import ReferenceLamb

SIZES = [9, 41, 341, 4231, 1, 127]
HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_lamb_matches_both_gradient_apis(dtype):
    ref, fused, a, b = pair(
        ReferenceLamb,
        FusedLamb,
        SIZES,
        dtype,
        HP,
        max_grad_norm=1.0,
        scaler=lambda: halfprec.StaticLossScaler(1.0),
    )
    plain = [torch.nn.Parameter(p.detach().float().clone()) for p in a]
    plain_opt = ReferenceLamb(plain, **HP)
    for s in range(3):
        grads = random_grads(a, s, none={1} if s == 1 else ())
        set_grads(a, grads)
        set_grads(b, grads)
        for p, g in zip(plain, grads, strict=True):
            p.grad = None if g is None else g.float()
        torch.nn.utils.clip_grad_norm_([p for p in plain if p.grad is not None], 1.0)
        plain_opt.step()
        ref.step()
        fused.step()
        for opt in (ref, fused):
            opt.zero_grad()
        plain_opt.zero_grad()
    assert_same_state(ref, fused, dtype)  # the mixed-precision path (16-bit grads), state and counters
    assert_params_are_rounded_masters(fused)
    for m, p in zip(fused.master_params(), plain, strict=True):  # plain fp32 LAMB on .grad
        torch.testing.assert_close(m, p.detach(), **tol("fused_master", dtype))
    sd = fused.state_dict()["optimizer"]["state"]
    assert float(sd[1]["step"]) == 2.0 and float(sd[0]["step"]) == 3.0


def test_lamb_skip_leaves_everything():
    p = [torch.nn.Parameter(torch.randn(41, device=DEVICE).half())]
    opt = FusedLamb(p, loss_scaler=halfprec.StaticLossScaler(1.0))
    p[0].grad = torch.full_like(p[0], float("nan"))
    before = p[0].detach().clone()
    opt.step()
    assert opt.step_was_skipped and torch.equal(p[0].detach(), before)
    assert opt.state_dict()["optimizer"]["state"] == {}
