"""Freezing and unfreezing params, a model moved after wrapping, grads cleared outside the wrapper, and loads
that must fail before touching anything: MixedPrecisionOptimizer against the plain FP32 torch optimizer."""

from __future__ import annotations

import gc

import pytest
import torch

from halfprec import DynamicLossScaler, MixedPrecisionOptimizer, StaticLossScaler

from ..reference import assert_same_state, fp32_copy, make_model

LOW = [torch.float16, torch.bfloat16]


def _loss(model, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(5, 9, generator=gen)
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


@pytest.mark.parametrize("dtype", LOW)
def test_param_frozen_mid_training_stops_moving_like_torch(dtype):
    """Frozen after 3 updates: torch's zero_grad clears its grad, so it never moves again; nor may the wrapper."""
    model = make_model(dtype)
    ref = fp32_copy(model)
    mp = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scaler=StaticLossScaler(8.0)
    )
    oracle = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(8):
        if step == 3:
            for m in (model, ref):
                m[0].weight.requires_grad_(False)
        mp.zero_grad()
        oracle.zero_grad()
        # the 16-bit model's loss drives both: grads of the fp32 oracle are the same 16-bit grads, upcast
        mp.backward(_loss(model, step))
        for q, p in zip(ref.parameters(), model.parameters(), strict=True):
            q.grad = None if p.grad is None else p.grad.float() / mp.loss_scale
        frozen_before = model[0].weight.detach().clone()
        mp.step()
        oracle.step()
        if step >= 3:
            assert torch.equal(model[0].weight.detach(), frozen_before), step
            assert model[0].weight.grad is None
    for m, q in zip(mp.master_params(), ref.parameters(), strict=True):
        assert torch.equal(m.detach(), q.detach())
    assert_same_state(mp.state, oracle.state, mp.master_params(), list(ref.parameters()))


@pytest.mark.parametrize("dtype", LOW)
def test_param_unfrozen_after_wrapping_is_an_error_that_changes_nothing(dtype):
    """Frozen when wrapped: no master exists, so its 16-bit, still scaled grad must not be applied, nor dropped."""
    model = make_model(dtype)
    model[0].bias.requires_grad_(False)
    mp = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(1024.0)
    )
    model[0].bias.requires_grad_(True)
    before = [p.detach().clone() for p in model.parameters()]
    mp.backward(_loss(model, 0))
    with pytest.raises(
        RuntimeError, match=r"shape \(41,\).*frozen \(requires_grad=False\) when the optimizer was wrapped"
    ):
        mp.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
    assert mp.skipped_steps == 0 and not mp.optimizer.state


def test_param_frozen_when_wrapped_with_a_stale_grad_is_left_alone():
    """Still frozen: its stale grad is not an error, is not applied, and zero_grad clears it as torch's does."""
    model = make_model(torch.bfloat16)
    model[0].bias.requires_grad_(False)
    model[0].bias.grad = torch.ones_like(model[0].bias)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mp.zero_grad()
    assert model[0].bias.grad is None
    bias = model[0].bias.detach().clone()
    mp.backward(_loss(model, 0))
    mp.step()
    assert torch.equal(model[0].bias.detach(), bias)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", LOW)
def test_grads_cleared_by_the_model_never_look_already_applied(dtype):
    """``model.zero_grad()`` (HF Trainer's way) frees the grads; a new grad may land at the freed one's address,
    which an ``id()``-based check took for the grads of the last step."""
    w = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    mp = MixedPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), loss_scaler=StaticLossScaler(1.0))
    ref = torch.nn.Parameter(torch.ones(4))
    oracle = torch.optim.SGD([ref], lr=0.1)
    for it in range(50):
        w.grad = None
        gc.collect()
        w.grad = torch.full((4,), float(it % 3 + 1), dtype=dtype)
        ref.grad = w.grad.float()
        mp.step()
        oracle.step()
    assert torch.equal(mp.master_params()[0].detach(), ref.detach())


def test_step_again_without_backward_is_still_an_error():
    model = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(_loss(model, 0))
    mp.step()
    with pytest.raises(RuntimeError, match="step\\(\\) called again without a new backward"):
        mp.step()


def test_loading_another_kind_of_scaler_fails_before_anything_changes():
    model = make_model(torch.float16)
    mp = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scaler=DynamicLossScaler(init_scale=8.0)
    )
    mp.backward(_loss(model, 0))
    mp.step()
    saved = mp.state_dict()

    other = make_model(torch.float16, seed=3)
    target = MixedPrecisionOptimizer(
        torch.optim.AdamW(other.parameters(), lr=1e-2), loss_scaler=StaticLossScaler(8.0)
    )
    weights = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(
        ValueError, match="'DynamicLossScaler' loss-scaler state into a StaticLossScaler: build"
    ):
        target.check_state_dict(saved)
    with pytest.raises(ValueError, match="'DynamicLossScaler' loss-scaler state into a StaticLossScaler"):
        target.load_state_dict(saved)
    assert all(torch.equal(p.detach(), w) for p, w in zip(other.parameters(), weights, strict=True))
    assert not target.optimizer.state and target.loss_scale == 8.0


def test_model_moved_after_wrapping_is_an_error():
    """Masters made on one device and a model moved to another: an error, not steps copied across devices."""
    model = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    # A CPU-only machine cannot move the params the way model.to("cuda") does (same Parameter objects, data on
    # the new device; meta makes new objects): record the masters as made elsewhere, the same mismatch seen
    # from the other side.
    mp._store.chunks[0].device = torch.device("meta")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(
        RuntimeError, match=r"is on cpu but its FP32 master is on meta: the model moved after"
    ):
        mp.step()
