"""The dynamic loss scaler inside the fused step (its update runs in the finalize program): after every step of a
random overflow pattern the scaler's state equals a ``DynamicLossScaler`` updated by its own torch ops, and the
whole optimizer state equals the exact torch path's. Scalers the kernel does not take keep their own ``update``.
"""

from __future__ import annotations

import logging

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdamW, FusedLamb, FusedSGD

from ...tolerances import approx
from ..helpers import DEVICE, assert_same_state, make_params, pair, random_grads, set_grads

SIZES = [9, 41, 127]
KW = dict(init_scale=2.0**6, growth_interval=3, hysteresis=2, min_scale=2.0**3)


def _fields(scaler):
    s = scaler._state
    return [s["scale"].item(), s["growth_tracker"].item(), s["hysteresis_left"].item()]


def _overflow_run(ref, fused, a, b, pattern, *, oracle):
    """Steps with an inf in the grads where ``pattern`` is true; checks the scaler after each one. Returns the
    scales seen."""
    scales = []
    for s, bad in enumerate(pattern):
        grads = random_grads(a, 100 + s, scale=float(ref.loss_scale), none={1} if s % 5 == 4 else ())
        if bad:
            grads[2][s % 127] = float("inf") if s % 2 else float("nan")
        set_grads(a, grads)
        set_grads(b, grads)
        ref.step()
        fused.step()
        oracle.update(torch.tensor(float(bad), device=DEVICE))
        assert fused.step_was_skipped == bool(bad) == ref.step_was_skipped, s
        assert _fields(fused.loss_scaler) == _fields(oracle), (s, _fields(fused.loss_scaler), _fields(oracle))
        assert fused.loss_scaler.state_dict() == ref.loss_scaler.state_dict(), s
        assert fused.skipped_steps == ref.skipped_steps, s
        ref.zero_grad()
        fused.zero_grad()
        scales.append(_fields(oracle)[0])
    return scales


def _pattern(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) < 0.35).tolist()


@pytest.mark.parametrize(
    ("torch_cls", "fused_cls", "hp"),
    [
        (torch.optim.AdamW, FusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
        (torch.optim.SGD, FusedSGD, dict(lr=1e-2, momentum=0.9)),
    ],
)
def test_scaler_state_after_every_step_of_a_random_overflow_pattern(torch_cls, fused_cls, hp):
    scaler = lambda: halfprec.DynamicLossScaler(**KW)  # noqa: E731
    ref, fused, a, b = pair(torch_cls, fused_cls, SIZES, torch.float16, hp, max_grad_norm=1.0, scaler=scaler)
    oracle = halfprec.DynamicLossScaler(**KW).to(DEVICE)
    pattern = _pattern(30, seed=3)
    scales = _overflow_run(ref, fused, a, b, pattern, oracle=oracle)
    assert_same_state(ref, fused, torch.float16)
    ups = sum(y > x for x, y in zip(scales[:-1], scales[1:], strict=True))
    downs = sum(y < x for x, y in zip(scales[:-1], scales[1:], strict=True))
    assert ups and downs and KW["min_scale"] in scales, (
        scales
    )  # growth, backoff and the floor were all reached


def test_lamb_runs_the_same_schedule():
    scaler = halfprec.DynamicLossScaler(**KW)
    oracle = halfprec.DynamicLossScaler(**KW).to(DEVICE)
    fused = FusedLamb(
        [torch.nn.Parameter(torch.randn(n).to(DEVICE, torch.float16)) for n in SIZES], loss_scaler=scaler
    )
    params = fused._trainable
    for s, bad in enumerate(_pattern(12, seed=5)):
        grads = random_grads(params, s)
        if bad:
            grads[0][0] = float("inf")
        set_grads(params, grads)
        fused.step()
        oracle.update(torch.tensor(float(bad), device=DEVICE))
        assert _fields(scaler) == _fields(oracle), s
        fused.zero_grad()


def test_skip_report_names_the_scale_before_and_after(caplog):
    scaler = halfprec.DynamicLossScaler(init_scale=2.0**6, hysteresis=1, min_scale=1.0)
    fused = FusedAdamW([torch.nn.Parameter(torch.randn(41).to(DEVICE, torch.float16))], loss_scaler=scaler)
    p = fused._trainable[0]
    with caplog.at_level(logging.WARNING, logger="halfprec"):
        for _ in range(2):
            g = torch.randn(41).to(DEVICE, torch.float16)
            g[3] = float("inf")
            p.grad = g
            fused.step()
        fused.flush_reports()
    messages = [r.getMessage() for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(messages) == 2
    assert "loss scale 64 -> 32, 1 skipped" in messages[0] and "loss scale 32 -> 16, 2 skipped" in messages[1]


class _OverriddenScaler(halfprec.DynamicLossScaler):
    """A subclass with its own update: the fused step must call it, not the kernel."""

    calls = 0

    def update(self, found_inf):
        type(self).calls += 1
        super().update(found_inf)


class _PlainScaler(halfprec.LossScaler):
    """A scaler that is neither static nor dynamic: its update halves the scale on every step."""

    def update(self, found_inf):
        self.scale.mul_(0.5)


def test_scalers_the_kernel_does_not_take_keep_their_own_update():
    _OverriddenScaler.calls = 0
    ref, fused, a, b = pair(
        torch.optim.AdamW,
        FusedAdamW,
        SIZES,
        torch.float16,
        dict(lr=1e-2),
        scaler=lambda: _OverriddenScaler(**KW),
    )
    oracle = halfprec.DynamicLossScaler(**KW).to(DEVICE)
    _overflow_run(ref, fused, a, b, _pattern(8, seed=7), oracle=oracle)
    assert _OverriddenScaler.calls == 16  # 8 steps on each path

    plain = _PlainScaler(2.0**4)
    fused = FusedAdamW([torch.nn.Parameter(torch.randn(9).to(DEVICE, torch.float16))], loss_scaler=plain)
    fused._trainable[0].grad = torch.randn(9).to(DEVICE, torch.float16)
    fused.step()
    assert fused.loss_scale == 8.0 and fused._scalars[4].item() == 16.0 and fused._scalars[5].item() == 8.0


def test_fused_step_does_not_call_the_torch_update(monkeypatch):
    def forbidden(self, found_inf):
        raise AssertionError("the fused step ran DynamicLossScaler.update's torch ops")

    scaler = halfprec.DynamicLossScaler(init_scale=2.0**6, hysteresis=1, growth_interval=1)
    fused = FusedAdamW([torch.nn.Parameter(torch.randn(41).to(DEVICE, torch.float16))], loss_scaler=scaler)
    monkeypatch.setattr(halfprec.DynamicLossScaler, "update", forbidden)
    p = fused._trainable[0]
    for bad, want in ((False, 2.0**7), (True, 2.0**6), (False, 2.0**7)):
        g = torch.randn(41).to(DEVICE, torch.float16)
        if bad:
            g[0] = float("inf")
        p.grad = g
        fused.step()
        assert fused.loss_scale == want


# --- clipping chosen per step, and unscaled grads on demand (the integrations' interface) -------------------------
def test_max_grad_norm_set_per_step_clips_that_step_in_the_kernel():
    # An integration sets max_grad_norm for the coming step only (Lightning's gradient_clip_val, HF's
    # max_grad_norm): the step clips like the exact path given the same setting, and grad_norm is the unscaled
    # pre-clip norm of that step.
    scaler = lambda: halfprec.StaticLossScaler(2.0**10)  # noqa: E731
    ref, fused, a, b = pair(torch.optim.AdamW, FusedAdamW, SIZES, torch.float16, dict(lr=1e-2), scaler=scaler)
    for s, clip in enumerate([0.5, None, 2.0, None]):
        grads = random_grads(a, 300 + s, scale=2.0**10)
        set_grads(a, grads)
        set_grads(b, grads)
        ref.max_grad_norm = fused.max_grad_norm = clip
        ref.step()
        fused.step()
        assert fused.grad_norm == approx(ref.grad_norm, "grad_norm"), s
        assert clip is None or fused.grad_norm > clip  # so the clipped steps really clipped
        ref.zero_grad()
        fused.zero_grad()
    assert_same_state(ref, fused, torch.float16)


@pytest.mark.parametrize("accum", ["param", "fp32"])
def test_unscaled_grads_are_the_exact_paths_master_grads(accum):
    scaler = lambda: halfprec.StaticLossScaler(2.0**10)  # noqa: E731
    a, b = make_params(SIZES + [5], torch.float16)
    b[-1].data = b[-1].data.float()  # an fp32 param: its own master
    a[-1].data = a[-1].data.float()
    ref = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(a, lr=1e-2), loss_scaler=scaler(), impl="torch", grad_accum_dtype=accum
    )
    fused = FusedAdamW(b, lr=1e-2, loss_scaler=scaler(), grad_accum_dtype=accum)
    for micro in range(2):  # two micro-batches: with fp32 accumulation the kernels read their fp32 sum
        grads = random_grads(a, 400 + micro, scale=2.0**10, none={1})
        for params in (a, b):
            for p, g in zip(params, grads, strict=True):
                if g is not None:
                    (p * g).sum().backward()  # through autograd, so the accumulation hooks run
    got = fused.unscaled_grads()
    ref.unscale_()
    want = [m.grad for m in ref.master_params()]
    assert [g is None for g in got] == [g is None for g in want] == [False, True, False, False]
    for g, w in zip(got, want, strict=True):
        assert g is None or (g.dtype == torch.float32 and torch.equal(g, w))
    got[0].fill_(1e6)  # the step reads the 16-bit (or accumulated) grads, not these copies
    ref.step()
    fused.step()
    assert fused.grad_norm == approx(ref.grad_norm, "grad_norm")
    assert_same_state(ref, fused, torch.float16)


def test_unscale_in_place_is_refused_with_the_alternatives():
    fused = FusedAdamW([torch.nn.Parameter(torch.randn(9).to(DEVICE, torch.float16))])
    with pytest.raises(RuntimeError, match=r"max_grad_norm.*unscaled_grads\(\).*impl='torch'"):
        fused.unscale_()
