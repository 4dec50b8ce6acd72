"""FP32 gradient accumulation on the exact strategy (``grad_accum_dtype="fp32"``, optim/accumulate.py).

Oracle: a twin model with the same weights runs plain 16-bit backward per micro-batch; the fp32 sum, in micro-batch
order, of its cloned micro-batch grads is what the optimizer must see (bit for bit, unscaled exactly), and a plain
FP32 torch AdamW fed those sums must end at the same masters.
"""

from __future__ import annotations

import copy

import pytest
import torch

import halfprec
from halfprec import Config, initialize

from ..reference import SCALED_BY_HAND, bits_equal, make_model

FP32 = "fp32"  # grad_accum_dtype: fp32 sums
HP = dict(lr=1e-2, weight_decay=0.1)
SCALE = 2.0**10  # fp16's static loss scale here: a power of two, so unscaling is exact


def batch(step: int, j: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + j)
    return torch.randn(5, 9, generator=gen).to(dtype), torch.randn(5, 7, generator=gen)


def loss_of(model: torch.nn.Module, step: int, j: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    x, y = batch(step, j, dtype)
    return torch.nn.functional.mse_loss(model(x.to(device)).float(), y.to(device))


def build(dtype: torch.dtype, accum: torch.dtype | None, **options):
    model = make_model(dtype)
    scaler = halfprec.StaticLossScaler(SCALE) if dtype == torch.float16 else None
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), **HP), loss_scaler=scaler, impl="torch", grad_accum_dtype=accum,
        **options,
    )  # fmt: skip
    return model, mp


def twin_sums(
    model: torch.nn.Module, step: int, k: int, dtype: torch.dtype, scale: float
) -> list[torch.Tensor]:
    """The fp32 sums, in micro-batch order, of plain 16-bit backward grads of a twin of ``model`` (still scaled)."""
    twin = copy.deepcopy(model)
    sums: list[torch.Tensor] | None = None
    for j in range(k):
        twin.zero_grad(set_to_none=True)
        (loss_of(twin, step, j, dtype, next(twin.parameters()).device) * scale).backward()
        grads = [p.grad.clone() for p in twin.parameters()]
        sums = (
            [g.float() for g in grads]
            if sums is None
            else [s + g.float() for s, g in zip(sums, grads, strict=True)]
        )
    return sums


def seen_grads(mp) -> list[list[torch.Tensor]]:
    """Records the master grads the inner optimizer sees at each real step."""
    seen: list[list[torch.Tensor]] = []
    mp.optimizer.register_step_pre_hook(
        lambda opt, *_: seen.append([m.grad.clone() for m in mp.master_params()])
    )
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_master_grads_are_the_fp32_sum_and_updates_match_fp32_torch(dtype, k):
    model, mp = build(dtype, FP32)
    seen = seen_grads(mp)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, **HP)
    for step in range(3):
        scale = mp.loss_scale
        sums = twin_sums(model, step, k, dtype, scale)
        for j in range(k):
            mp.backward(loss_of(model, step, j, dtype))
            assert all(p.grad is None for p in model.parameters())  # the 16-bit grads are released
        mp.step()
        mp.zero_grad()
        assert not mp.step_was_skipped
        for got, want in zip(seen[-1], sums, strict=True):
            assert bits_equal(got, want / scale)
        for r, s in zip(ref, sums, strict=True):
            r.grad = s / scale
        ref_opt.step()
        for m, r, p in zip(mp.master_params(), ref, model.parameters(), strict=True):
            assert bits_equal(m.detach(), r.detach())
            assert bits_equal(p.detach(), r.detach().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_one_micro_batch_is_todays_path_bit_for_bit(dtype, clip):
    runs = [build(dtype, accum, max_grad_norm=clip) for accum in ("param", FP32)]
    seen = [seen_grads(mp) for _, mp in runs]
    for step in range(4):
        step_alike(runs, step, dtype)
        assert runs[0][1].grad_norm == runs[1][1].grad_norm
        for a, b in zip(seen[0][-1], seen[1][-1], strict=True):
            assert bits_equal(a, b)


def step_alike(runs, step: int, dtype: torch.dtype, loss=loss_of) -> None:
    """One single-micro-batch step of each ``(model, optimizer)`` of ``runs``; their params agree bitwise."""
    for model, mp in runs:
        mp.backward(loss(model, step, 0, dtype))
        mp.step()
        mp.zero_grad()
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert bits_equal(a.detach(), b.detach())


def test_grads_set_by_hand_are_accumulated_too():
    runs = [build(torch.bfloat16, accum) for accum in ("param", FP32)]
    for step in range(3):
        for model, mp in runs:
            for p, g in zip(model.parameters(), twin_sums(model, step, 1, torch.bfloat16, 1.0), strict=True):
                p.grad = g.to(torch.bfloat16)
            mp.step()
            mp.zero_grad()
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters(), strict=True):
        assert bits_equal(a.detach(), b.detach())


def test_overflow_in_one_micro_batch_skips_the_step():
    model, mp = build(torch.float16, FP32)
    before = [m.detach().clone() for m in mp.master_params()]
    for j in range(4):
        loss = loss_of(model, 0, j, torch.float16)
        mp.backward(loss * float("inf") if j == 2 else loss)
    mp.step()
    assert mp.step_was_skipped and mp.skipped_steps == 1
    assert all(bits_equal(m.detach(), b) for m, b in zip(mp.master_params(), before, strict=True))
    mp.zero_grad()
    mp.backward(loss_of(model, 1, 0, torch.float16))
    mp.step()
    assert not mp.step_was_skipped


def test_zero_grad_mid_accumulation_drops_it():
    model, mp = build(torch.bfloat16, FP32)
    seen = seen_grads(mp)
    for j in range(2):
        mp.backward(loss_of(model, 0, j, torch.bfloat16))
    mp.zero_grad()
    sums = twin_sums(model, 1, 3, torch.bfloat16, 1.0)
    for j in range(3):
        mp.backward(loss_of(model, 1, j, torch.bfloat16))
    mp.step()
    assert all(bits_equal(a, b) for a, b in zip(seen[-1], sums, strict=True))


@pytest.mark.parametrize("clear", ["model.zero_grad", "nothing"])
def test_a_step_ends_the_accumulation_whoever_clears_the_grads(clear):
    # model.zero_grad() cannot reach the fp32 master grads; a step's consumed grads must still not be added to
    # the next step's (they were unscaled, clipped and applied)
    model, mp = build(torch.float16, FP32)
    seen = seen_grads(mp)
    for step in range(3):
        sums = twin_sums(model, step, 2, torch.float16, SCALE)
        for j in range(2):
            mp.backward(loss_of(model, step, j, torch.float16))
        mp.step()
        if clear == "model.zero_grad":
            model.zero_grad(set_to_none=True)
        unscaled = [s / SCALE for s in sums]
        assert all(bits_equal(a, b) for a, b in zip(seen[-1], unscaled, strict=True)), step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_state_dict_round_trip_mid_training(dtype):
    def train(model, mp, steps):
        for step in steps:
            for j in range(4):
                mp.backward(loss_of(model, step, j, dtype))
            mp.step()
            mp.zero_grad()

    model, mp = build(dtype, FP32)
    train(model, mp, range(5))
    model_b, mp_b = build(dtype, FP32)
    train(model_b, mp_b, range(2))
    model_c = copy.deepcopy(model_b)
    mp_c = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model_c.parameters(), **HP), loss_scaler=copy.deepcopy(mp_b.loss_scaler), impl="torch",
        grad_accum_dtype=FP32,
    )  # fmt: skip
    mp_c.load_state_dict(mp_b.state_dict())
    train(model_c, mp_c, range(2, 5))
    for a, b in zip(model.parameters(), model_c.parameters(), strict=True):
        assert bits_equal(a.detach(), b.detach())
    for a, b in zip(mp.master_params(), mp_c.master_params(), strict=True):
        assert bits_equal(a.detach(), b.detach())


def test_order_guards():
    model, mp = build(torch.bfloat16, FP32)
    mp.backward(loss_of(model, 0, 0, torch.bfloat16))
    mp.step()
    with pytest.raises(RuntimeError, match="step\\(\\) called again without a new backward"):
        mp.step()
    mp.zero_grad()
    mp.backward(loss_of(model, 1, 0, torch.bfloat16))
    mp.unscale_()
    with pytest.raises(RuntimeError, match="backward ran after unscale_"):
        loss_of(model, 1, 1, torch.bfloat16).backward()
    with pytest.raises(RuntimeError, match="changed after unscale_"):  # the grad that backward left behind
        mp.step()
    mp.zero_grad()
    mp.backward(loss_of(model, 2, 0, torch.bfloat16))
    mp.unscale_()
    next(model.parameters()).grad = torch.ones_like(next(model.parameters()))  # a grad set after unscale_
    with pytest.raises(RuntimeError, match="changed after unscale_"):
        mp.step()


def test_unscaled_backward_is_seen_by_the_scale_guard():
    model, mp = build(torch.float16, FP32)
    loss_of(model, 0, 0, torch.float16).backward()
    with pytest.warns(RuntimeWarning, match=SCALED_BY_HAND):
        mp.step()


def test_frozen_params_and_added_groups():
    model = make_model(torch.bfloat16, sizes=(9, 41, 7, 3))
    frozen, late = model[0].bias, model[2]
    frozen.requires_grad_(False)
    params = [p for p in model.parameters() if p is not frozen and all(p is not q for q in late.parameters())]
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.SGD(params + [frozen], lr=0.1), impl="torch", grad_accum_dtype=FP32
    )
    mp.add_param_group({"params": list(late.parameters())})
    x = torch.randn(4, 9).to(torch.bfloat16)
    for _ in range(2):
        mp.backward(model(x).float().square().mean())
    assert all(p.grad is None for p in model.parameters())
    assert len([m for m in mp.master_params() if m.grad is not None]) == 5
    before = frozen.detach().clone()
    mp.step()
    assert bits_equal(frozen.detach(), before)
    mp.zero_grad()
    frozen.requires_grad_(True)
    mp.backward(model(x).float().square().mean())
    with pytest.raises(RuntimeError, match="was frozen"):
        mp.step()


@pytest.mark.parametrize(
    ("kwargs", "regex"),
    [
        (
            dict(impl="torch", grad_accum_dtype=torch.bfloat16),
            r"grad_accum_dtype must be one of \('param', 'fp32'\), got torch.bfloat16; use 'param'",
        ),
        (dict(impl="torch", grad_accum_dtype=None), r"got None; use 'param'"),
        (  # no process group exists in this process
            dict(impl="torch", grad_accum_dtype="fp32", process_group="world"),
            "process_group='world' but torch.distributed is not initialised: .*init_process_group",
        ),
    ],
)
def test_bad_options(kwargs, regex):
    model = make_model(torch.bfloat16)
    with pytest.raises(ValueError, match=regex):
        halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "regex"),
    [
        (
            dict(grad_accum_dtype="fp32", zero_stage=1, reduce_dtype="param"),
            "reduce_dtype='param' at zero_stage=1: .* reduces in fp32",
        ),
        (
            dict(grad_accum_dtype=torch.float32),
            r"grad_accum_dtype must be one of \('auto', 'param', 'fp32'\), got torch.float32; use 'fp32'",
        ),
    ],
)
def test_config_refuses(kwargs, regex):
    with pytest.raises(ValueError, match=regex):
        Config(**kwargs)


def test_engine_accumulates_in_fp32():
    runs = []
    for accum in ("param", "fp32"):
        model = make_model(torch.float32)
        engine = initialize(
            model, torch.optim.AdamW(model.parameters(), **HP), precision="bf16", impl="torch",
            gradient_accumulation_steps=4, grad_accum_dtype=accum,
        )  # fmt: skip
        for micro in range(8):
            engine.backward(loss_of(engine, micro // 4, micro % 4, torch.float32))
            engine.step()
        runs.append(engine)
    assert runs[0].optimizer.grad_accum_dtype == "param" and runs[1].optimizer.grad_accum_dtype == "fp32"
    assert runs[1].global_step == 2 and runs[1].skipped_steps == 0
    # 16-bit and fp32 accumulation differ (the point of the option), by rounding only
    for a, b in zip(runs[0].module.parameters(), runs[1].module.parameters(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.02)
