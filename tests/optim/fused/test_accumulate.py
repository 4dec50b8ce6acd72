"""FP32 gradient accumulation on the fused optimizers (``grad_accum_dtype="fp32"``, optim/fused/grads.py).

Oracles: the fp32 sum, in micro-batch order, of a twin model's plain 16-bit micro-batch grads is what the kernels
must read (bit for bit, still scaled); the exact path with fp32 accumulation fed the same micro-batch grads is
what N fused steps must equal (within the fused-vs-exact tolerances); one micro-batch is today's 16-bit fused
path bit for bit. fp16 runs in the interpreter; bf16 only on CUDA (the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import copy

import pytest
import torch

import halfprec
from halfprec import Config, initialize
from halfprec.optim import FusedAdamW, FusedLamb

from ...reference import SCALED_BY_HAND, bits_equal, make_model
from ...tolerances import approx
from ..helpers import DEVICE, assert_same_state
from ..test_accumulate import loss_of, step_alike, twin_sums

FP32 = "fp32"  # grad_accum_dtype: fp32 sums
SCALE = 2.0**10
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
TORCH = {  # the torch optimizer of each fused one, and its hyper-parameters here
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "Adam": (torch.optim.Adam, dict(lr=1e-2)),
    "SGD": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
    "Adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
}


def build(name: str, dtype: torch.dtype, accum: torch.dtype | None, *, impl="triton", scaler=None, **options):
    model = make_model(dtype).to(DEVICE)
    if scaler is None and dtype == torch.float16:
        scaler = halfprec.StaticLossScaler(SCALE)
    if name == "Lamb":  # no torch twin
        return model, FusedLamb(model.parameters(), loss_scaler=scaler, grad_accum_dtype=accum, **options)
    cls, hp = TORCH[name]
    mp = halfprec.MixedPrecisionOptimizer(
        cls(model.parameters(), **hp), loss_scaler=scaler, impl=impl, grad_accum_dtype=accum, **options
    )
    return model, mp


def loss(model, step: int, j: int, dtype: torch.dtype) -> torch.Tensor:
    return loss_of(model, step, j, dtype, DEVICE)


def sums_seen(mp) -> list[torch.Tensor]:
    """The fp32 grads the kernels will read (the flat buffer's views, the masters' ``.grad``), still scaled."""
    return [m.grad.clone() for m in mp.master_params()]


CASES = [("AdamW", 1), ("AdamW", 4), ("AdamW", 16), ("Adam", 4), ("SGD", 4), ("Adagrad", 4), ("Lamb", 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "k"), CASES)
def test_the_kernels_read_the_fp32_sum_of_the_micro_batch_grads(name, k, dtype):
    model, mp = build(name, dtype, FP32, max_grad_norm=1.0)
    for step in range(2):
        sums = twin_sums(model, step, k, dtype, mp.loss_scale)
        for j in range(k):
            mp.backward(loss(model, step, j, dtype))
            assert all(p.grad is None for p in model.parameters())  # the 16-bit grads are released
        for got, want in zip(sums_seen(mp), sums, strict=True):
            assert bits_equal(got, want)
        mp.step()
        assert not mp.step_was_skipped
        assert all(m.grad is None for m in mp.master_params())  # the step ended the accumulation
        mp.zero_grad()


def coeffs(model, step: int, j: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + j)
    return [torch.randn(p.shape, generator=gen).to(DEVICE) for p in model.parameters()]


def linear_loss(model, step: int, j: int) -> torch.Tensor:
    """A loss whose grads do not depend on the weights: both paths get the same micro-batch grads while their
    weights differ by rounding (each param's 16-bit grad is ``c * scale`` rounded, through a real backward)."""
    return sum((p.float() * c).sum() for p, c in zip(model.parameters(), coeffs(model, step, j), strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(TORCH))
def test_steps_match_the_exact_path_skip_included(name, dtype):
    fp16 = dtype == torch.float16
    runs = [
        build(name, dtype, FP32, impl=impl, max_grad_norm=5.0,
              scaler=halfprec.DynamicLossScaler(init_scale=2.0**8, growth_interval=2) if fp16 else None)
        for impl in ("torch", "triton")
    ]  # fmt: skip
    (ref_model, ref), (model, fused) = runs
    assert fused.impl == "triton" and fused.grad_accum_dtype == "fp32"
    for step in range(5):
        for j in range(4):
            for m, mp in runs:
                bad = step == 2 and j == 1  # an overflow in one micro-batch skips the whole step
                mp.backward(linear_loss(m, step, j) * (float("inf") if bad else 1.0))
        if step != 2:  # (an overflowed sum is inf or nan, depending on the micro-batches after it)
            for a, b in zip(sums_seen(fused), sums_seen(ref), strict=True):
                assert bits_equal(a, b)
        ref.step()
        fused.step()
        assert fused.step_was_skipped == ref.step_was_skipped == (step == 2), step
        assert_same_state(ref, fused, dtype)  # masters, moments, per-param step counters, scaler
        if not fused.step_was_skipped:
            assert fused.grad_norm == approx(ref.grad_norm, "grad_norm")
        fused.zero_grad()
        ref.zero_grad()
    assert fused.skipped_steps == 1


@pytest.mark.parametrize("name", [*TORCH, "Lamb"])
def test_one_micro_batch_is_the_16_bit_path_bit_for_bit(name):
    # an fp32 grad that is a 16-bit one upcast is read as the same fp32 value: same updates; the same norm in the
    # interpreter (compiled, the norm's in-block summation order may follow the load width)
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    runs = [build(name, dtype, accum) for accum in ("param", FP32)]
    for step in range(3):
        step_alike(runs, step, dtype, loss)
        norm = runs[0][1].grad_norm
        assert runs[1][1].grad_norm == (norm if DEVICE == "cpu" else approx(norm, "grad_norm"))
        for a, b in zip(runs[0][1].master_params(), runs[1][1].master_params(), strict=True):
            assert bits_equal(a, b)


def test_grads_set_by_hand_are_added_at_the_step():
    # run 0: two backwards; run 1: one backward, and the second micro-batch's grads assigned by hand (autograd.grad
    # fires no post-accumulate-grad hook)
    runs = [build("AdamW", torch.float16, FP32) for _ in range(2)]
    (m0, mp0), (m1, mp1) = runs
    for step in range(3):
        for j in range(2):
            mp0.backward(loss(m0, step, j, torch.float16))
        mp1.backward(loss(m1, step, 0, torch.float16))
        params = list(m1.parameters())
        grads = torch.autograd.grad(mp1.scale_loss(loss(m1, step, 1, torch.float16)), params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        for _, mp in runs:
            mp.step()
            mp.zero_grad()
        for a, b in zip(m0.parameters(), m1.parameters(), strict=True):
            assert bits_equal(a.detach(), b.detach())


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_mid_accumulation_drops_it(set_to_none):
    model, mp = build("AdamW", torch.float16, FP32)
    for j in range(2):
        mp.backward(loss(model, 0, j, torch.float16))
    mp.zero_grad(set_to_none=set_to_none)
    assert all(p.grad is None for p in model.parameters())
    sums = twin_sums(model, 1, 3, torch.float16, SCALE)
    for j in range(3):
        mp.backward(loss(model, 1, j, torch.float16))
    assert all(bits_equal(a, b) for a, b in zip(sums_seen(mp), sums, strict=True))


@pytest.mark.parametrize("clear", ["model.zero_grad", "nothing"])
def test_a_step_ends_the_accumulation_whoever_clears_the_grads(clear):
    model, mp = build("AdamW", torch.float16, FP32)
    for step in range(3):
        sums = twin_sums(model, step, 2, torch.float16, SCALE)
        for j in range(2):
            mp.backward(loss(model, step, j, torch.float16))
        assert all(bits_equal(a, b) for a, b in zip(sums_seen(mp), sums, strict=True)), step
        mp.step()
        if clear == "model.zero_grad":
            model.zero_grad(set_to_none=True)


def test_fp32_params_keep_their_grad_and_checks_still_run():
    model = make_model(torch.float16, sizes=(9, 41, 7, 3)).to(DEVICE)
    model[1].float()  # an fp32 layer: its params are their own masters and accumulate in .grad
    frozen = model[2].bias
    frozen.requires_grad_(False)
    mp = FusedAdamW(model.parameters(), loss_scaler=halfprec.StaticLossScaler(SCALE), grad_accum_dtype=FP32)
    x = torch.randn(4, 9).to(DEVICE, torch.float16)

    def backward():
        mp.backward(model[2](model[1](model[0](x).float()).half()).float().square().mean())

    for _ in range(2):
        backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert [p.grad is not None for p in trained] == [False, False, True, True, False]
    mp.step()
    mp.zero_grad()
    frozen.requires_grad_(True)
    backward()
    with pytest.raises(RuntimeError, match="was frozen"):
        mp.step()
    frozen.requires_grad_(False)
    mp.zero_grad()
    model[0].bias.data = model[0].bias.data.float()  # a cast after building: refused, not trained silently
    with pytest.raises(RuntimeError, match="is torch.float32 now"):
        mp.step()


def test_unscaled_backward_is_seen_by_the_scale_guard():
    model, mp = build("AdamW", torch.float16, FP32)
    loss(model, 0, 0, torch.float16).backward()
    with pytest.warns(RuntimeWarning, match=SCALED_BY_HAND):
        mp.step()


@pytest.mark.parametrize(
    ("accum", "regex"),
    [
        (
            torch.bfloat16,
            r"grad_accum_dtype must be one of \('param', 'fp32'\), got torch.bfloat16; use 'param'",
        ),
        (
            torch.float32,
            r"grad_accum_dtype must be one of \('param', 'fp32'\), got torch.float32; use 'fp32'",
        ),
        ("float32", r"got 'float32'; use 'fp32'"),
    ],
)
def test_bad_options(accum, regex):
    with pytest.raises(ValueError, match=regex):
        FusedAdamW(make_model(torch.float16).to(DEVICE).parameters(), grad_accum_dtype=accum)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")
def test_engine_threads_it_to_the_fused_path():
    model = make_model(torch.float32)
    engine = initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), Config(precision="fp16", impl="triton",
        gradient_accumulation_steps=4, grad_accum_dtype="fp32"),
    )  # fmt: skip
    assert isinstance(engine.optimizer, FusedAdamW) and engine.optimizer.grad_accum_dtype == "fp32"
    for micro in range(8):
        engine.backward(loss_of(engine, micro // 4, micro % 4, torch.float32))
        assert all(p.grad is None for p in model.parameters())
        engine.step()
    assert engine.global_step == 2 and engine.skipped_steps == 0


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_on_cuda_picks_the_fused_path_with_fp32_accumulation(precision):
    model = make_model(torch.float32).cuda()
    engine = initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision=precision, gradient_accumulation_steps=4,
        grad_accum_dtype="fp32",
    )  # fmt: skip
    assert isinstance(engine.optimizer, FusedAdamW) and engine.optimizer.grad_accum_dtype == "fp32"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    for step in range(2):
        sums = twin_sums(copy.deepcopy(model), step, 4, dtype, engine.optimizer.loss_scale / 4)
        for j in range(4):
            engine.backward(loss_of(model, step, j, dtype, "cuda"))
        assert all(bits_equal(a, b) for a, b in zip(sums_seen(engine.optimizer), sums, strict=True))
        engine.step()
    assert engine.global_step == 2 and engine.skipped_steps == 0
