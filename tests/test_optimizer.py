"""MixedPrecisionOptimizer against the plain FP32 torch optimizer: construction, parity, state, skips, clipping."""

from __future__ import annotations

import copy
import io
import logging
import math
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import halfprec
from halfprec import DynamicLossScaler, MixedPrecisionOptimizer, StaticLossScaler

from .reference import SCALED_BY_HAND, assert_same_state, fp32_copy, grads_like, make_model, set_scaled_grads
from .tolerances import tol

LOW = [torch.float16, torch.bfloat16]

# (optimizer class, kwargs): every torch optimizer halfprec's generic path must reproduce bit for bit.
OPTIMIZERS = [
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1, lr_decay=0.01)),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    (torch.optim.Adamax, dict(lr=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.01)),
    (torch.optim.RAdam, dict(lr=1e-2)),
    (torch.optim.Adadelta, dict(lr=1.0)),
    (torch.optim.Rprop, dict(lr=1e-2)),
    (torch.optim.ASGD, dict(lr=1e-2, t0=5)),
]
FUSED = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad]


def _groups(model, **kwargs):
    params = list(model.parameters())
    return [{"params": params[:2], "lr": kwargs.get("lr", 1e-2) * 0.5}, {"params": params[2:]}]


def _pair(cls, kwargs, dtype, *, impl=None, **mp_kwargs):
    """A 16-bit model under MixedPrecisionOptimizer and its FP32 oracle built from the same values."""
    model = make_model(dtype)
    ref = fp32_copy(model)
    flags = {} if impl is None else {impl: True}
    mp = MixedPrecisionOptimizer(cls(_groups(model, **kwargs), **kwargs, **flags), **mp_kwargs)
    oracle = cls(_groups(ref, **kwargs), **kwargs, **flags)
    return model, ref, mp, oracle


def _run(model, ref, mp, oracle, steps, *, start=0, grads_fn=None):
    for step in range(start, start + steps):
        grads = (grads_fn or grads_like)(list(model.parameters()), step=step)
        set_scaled_grads(model.parameters(), grads, mp.loss_scale)
        for q, g in zip(ref.parameters(), grads, strict=True):
            q.grad = g.float() if g is not None else None
        mp.step()
        oracle.step()


def _assert_parity(model, ref, mp, oracle):
    masters = mp.master_params()
    for m, q in zip(masters, ref.parameters(), strict=True):
        assert torch.equal(m, q), "master differs from the FP32 run"
    for p, m in zip(model.parameters(), masters, strict=True):
        assert torch.equal(p, m.to(p.dtype)), "model param is not the rounded master"
    assert_same_state(mp.state, oracle.state, masters, list(ref.parameters()))


# --- 1. construction is inert ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_construction_is_inert(dtype, cls, weight_decay):
    kwargs = dict(lr=1e-2, weight_decay=weight_decay, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
    model = make_model(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    inner = cls(_groups(model, **kwargs), **kwargs)
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    mp = MixedPrecisionOptimizer(inner)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b) and p.dtype == dtype
    assert len(mp.state) == 0 and len(inner.state) == 0
    assert [{k: v for k, v in g.items() if k != "params"} for g in mp.param_groups] == groups_before
    # The only new tensors: one flat fp32 buffer per (device, dtype), views of it as masters.
    chunks = mp._store.chunks
    assert len(chunks) == 1 and chunks[0].grad is None
    for m, p in zip(mp.master_params(), model.parameters(), strict=True):
        assert m.dtype == torch.float32 and torch.equal(m, p.float())
        assert m.untyped_storage().data_ptr() == chunks[0].data.untyped_storage().data_ptr()


@pytest.mark.gpu
def test_construction_allocates_only_masters_cuda():
    model = make_model(torch.bfloat16).cuda()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    MixedPrecisionOptimizer(inner, impl="torch")
    torch.cuda.synchronize()
    numel = sum(-(-p.numel() // 16) * 16 for p in model.parameters())
    assert torch.cuda.memory_allocated() - before <= numel * 4 + 4096  # masters + the scaler's 0-d tensors


@pytest.mark.parametrize("dtype", LOW)
def test_param_dtype_casts_in_place_and_keeps_fp32_masters(dtype):
    model = make_model(torch.float32)
    originals = [p.detach().clone() for p in model.parameters()]
    ids = [id(p) for p in model.parameters()]
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), param_dtype=dtype)
    assert [id(p) for p in model.parameters()] == ids
    for p, m, o in zip(model.parameters(), mp.master_params(), originals, strict=True):
        assert p.dtype == dtype and torch.equal(p, o.to(dtype))
        assert torch.equal(m, o)  # the fp32 originals, not their rounding


# --- 2. parity ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("impl", [None, "foreach"])
@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_parity_30_steps(cls, kwargs, impl, dtype):
    pair = _pair(cls, kwargs, dtype, impl=impl)
    _run(*pair, 30)
    _assert_parity(*pair)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("cls", FUSED)
def test_parity_fused_flag(cls, dtype):
    kwargs = dict(lr=1e-2, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
    pair = _pair(cls, kwargs, dtype, impl="fused")
    _run(*pair, 10)
    _assert_parity(*pair)


def test_parity_with_param_dtype_is_the_fp32_run():
    model = make_model(torch.float32)
    ref = copy.deepcopy(model)
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), param_dtype=torch.bfloat16)
    oracle = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _run(
        model, ref, mp, oracle, 10, grads_fn=lambda ps, step: grads_like(ps, step=step, dtype=torch.bfloat16)
    )
    _assert_parity(model, ref, mp, oracle)


# --- 3. eager state: tests/optim/test_state.py -------------------------------------------------------------


# --- 4. overflow ----------------------------------------------------------------------------------------------
def _snapshot(mp, model):
    return (
        [m.detach().clone() for m in mp.master_params()],
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy({k: dict(v) for k, v in mp.state.items()}),
    )


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_overflow_skips_and_changes_nothing_else(dtype, bad, caplog):
    model, ref, mp, oracle = _pair(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), dtype)
    if dtype == torch.bfloat16:
        mp = MixedPrecisionOptimizer(
            torch.optim.AdamW(_groups(make_model(dtype), lr=1e-2), lr=1e-2, weight_decay=0.1),
            loss_scaler=DynamicLossScaler(init_scale=2.0**10, hysteresis=1),
        )
        model = None
    model = model or _model_of(mp)
    _run(model, ref, mp, oracle, 3)
    snap, scale = _snapshot(mp, model), mp.loss_scale
    grads = grads_like(list(model.parameters()), step=99)
    set_scaled_grads(model.parameters(), grads, scale)
    next(model.parameters()).grad.view(-1)[3] = bad
    with caplog.at_level(logging.WARNING, logger="halfprec"):
        mp.step()
    assert mp.step_was_skipped and mp.skipped_steps == 1
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 1
    after = _snapshot(mp, model)
    for a, b in zip(snap[0] + snap[1], after[0] + after[1], strict=True):
        assert torch.equal(a, b)
    assert_same_state(snap[2], after[2], list(snap[2]), list(after[2]))
    # hysteresis 2 (default) for fp16: first overflow keeps the scale; bf16 run used hysteresis=1
    assert mp.loss_scale == (scale if dtype == torch.float16 else scale / 2)


def _model_of(mp):
    """A module whose parameters are the wrapper's model params (for the bf16 variant above)."""
    holder = torch.nn.Module()
    for i, p in enumerate(mp._model_params):
        holder.register_parameter(f"p{i}", p)
    return holder


def test_bf16_nonfinite_not_checked_when_disabled():
    model = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), skip_nonfinite=False)
    set_scaled_grads(model.parameters(), grads_like(list(model.parameters()), step=0), 1.0)
    next(model.parameters()).grad.view(-1)[0] = float("nan")
    mp.step()
    assert not mp.step_was_skipped and mp.grad_norm is None
    assert torch.isnan(mp.master_params()[0]).any()


@pytest.mark.parametrize("built_on", ["wrapper", "inner"])
@pytest.mark.parametrize("first_skipped", [True, False])
def test_scheduler_held_on_skip_without_warning(built_on, first_skipped):
    model = make_model(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched_inner = (
        torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5) if built_on == "inner" else None
    )
    mp = MixedPrecisionOptimizer(inner, loss_scaler=DynamicLossScaler(init_scale=2.0**8, hysteresis=1))
    sched = sched_inner or torch.optim.lr_scheduler.StepLR(mp, step_size=1, gamma=0.5)
    pattern = [True, False, True, False, False] if first_skipped else [False, True, False, False]
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", SCALED_BY_HAND)
        for step, bad in enumerate(pattern):
            set_scaled_grads(
                model.parameters(), grads_like(list(model.parameters()), step=step), mp.loss_scale
            )
            if bad:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            mp.step()
            assert mp.step_was_skipped == bad
            if not mp.step_was_skipped:
                sched.step()
            lrs.append(mp.param_groups[0]["lr"])
            mp.zero_grad()
    clean = [not b for b in pattern]
    expected = [0.1 * 0.5 ** sum(clean[: i + 1]) for i in range(len(pattern))]
    assert lrs == pytest.approx(expected, rel=0, abs=0)
    step_counts = {int(s["step"]) if "step" in s else None for s in mp.state.values()}
    assert step_counts <= {None}  # SGD keeps no step; the momentum-free buffers stay absent


def test_all_zero_gradients_step_normally():
    model, ref, mp, oracle = _pair(torch.optim.Adam, dict(lr=1e-2), torch.float16)
    _run(model, ref, mp, oracle, 3, grads_fn=lambda ps, step: [torch.zeros_like(p) for p in ps])
    assert mp.skipped_steps == 0 and mp.grad_norm == 0.0
    _assert_parity(model, ref, mp, oracle)


# --- 5. clipping ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW)
def test_clipping_bit_identical_to_clip_grad_norm(dtype):
    model, ref, mp, oracle = _pair(torch.optim.AdamW, dict(lr=1e-2), dtype, max_grad_norm=0.05)
    for step in range(8):
        grads = grads_like(list(model.parameters()), step=step)
        set_scaled_grads(model.parameters(), grads, mp.loss_scale)
        for q, g in zip(ref.parameters(), grads, strict=True):
            q.grad = g.float()
        expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
        mp.step()
        oracle.step()
        assert mp.grad_norm == expected.item()  # unscaled, before clipping
    _assert_parity(model, ref, mp, oracle)


def test_unscale_then_user_clip_then_step():
    model, ref, mp, oracle = _pair(torch.optim.SGD, dict(lr=0.1), torch.float16)
    grads = grads_like(list(model.parameters()), step=0)
    set_scaled_grads(model.parameters(), grads, mp.loss_scale)
    mp.unscale_()
    mp.unscale_()  # idempotent
    for m, g in zip(mp.master_params(), grads, strict=True):
        assert torch.equal(m.grad, g.float())
    torch.nn.utils.clip_grad_norm_(mp.master_params(), 0.01)
    for q, g in zip(ref.parameters(), grads, strict=True):
        q.grad = g.float()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.01)
    mp.step()
    oracle.step()
    _assert_parity(model, ref, mp, oracle)


# --- 6. missing grads, frozen and empty params ------------------------------------------------------------------
def test_params_without_grads_keep_their_counters_and_frozen_untouched():
    model = make_model(torch.bfloat16, sizes=(9, 41, 7, 3))
    frozen = list(model.parameters())[-2:]
    for p in frozen:
        p.requires_grad_(False)
    empty = torch.nn.Parameter(torch.zeros(0, 5, dtype=torch.bfloat16))
    ref = fp32_copy(model)
    ref_empty = torch.nn.Parameter(torch.zeros(0, 5))
    trainable = [p for p in model.parameters() if p.requires_grad] + [empty]
    rtrain = [p for p in ref.parameters() if p.requires_grad] + [ref_empty]
    mp = MixedPrecisionOptimizer(torch.optim.Adam(list(model.parameters()) + [empty], lr=1e-2))
    oracle = torch.optim.Adam(list(ref.parameters()) + [ref_empty], lr=1e-2)
    frozen_before = [p.detach().clone() for p in frozen]
    assert len(mp.master_params()) == len(trainable)
    for step in range(6):
        grads = grads_like(trainable, step=step)
        for i, (p, q, g) in enumerate(zip(trainable, rtrain, grads, strict=True)):
            has = (step + i) % 3 != 0  # each param misses some steps
            p.grad = g if has else None
            q.grad = g.float() if has else None
        mp.step()
        oracle.step()
    for m, q in zip(mp.master_params(), rtrain, strict=True):
        assert torch.equal(m, q)
    assert_same_state(mp.state, oracle.state, mp.master_params(), rtrain)
    for p, b in zip(frozen, frozen_before, strict=True):
        assert torch.equal(p, b) and p.grad is None


# --- 7. state dict --------------------------------------------------------------------------------------------
def _roundtrip(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("first", [0, 20])
def test_state_dict_roundtrip_resumes_bit_exact(dtype, first):
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    full = _pair(torch.optim.AdamW, kwargs, dtype)
    _run(*full, first + 10)
    part = _pair(torch.optim.AdamW, kwargs, dtype)
    _run(*part, first)
    saved = _roundtrip(part[2].state_dict())
    resumed_model = make_model(dtype, seed=5)  # different weights: the state dict must restore them
    resumed = MixedPrecisionOptimizer(torch.optim.AdamW(_groups(resumed_model, **kwargs), **kwargs))
    resumed.load_state_dict(saved)
    assert resumed.loss_scale == part[2].loss_scale
    _run(resumed_model, part[1], resumed, part[3], 10, start=first)
    _assert_parity(resumed_model, full[1], resumed, full[3])


def test_load_state_dict_names_first_mismatch():
    mp = MixedPrecisionOptimizer(torch.optim.Adam(make_model(torch.float16).parameters()))
    other = MixedPrecisionOptimizer(
        torch.optim.Adam(make_model(torch.float16, sizes=(9, 40, 7)).parameters())
    )
    with pytest.raises(
        ValueError,
        match=r"param 0: saved shape \[41, 9\] dtype torch.float16 \(trained, fp32 master\), this model shape \[40, 9\]",
    ):
        other.load_state_dict(mp.state_dict())
    bf = MixedPrecisionOptimizer(torch.optim.Adam(make_model(torch.bfloat16).parameters()))
    with pytest.raises(
        ValueError, match=r"param 0: .*dtype torch.float16 .*, this model .*dtype torch.bfloat16"
    ):
        bf.load_state_dict(mp.state_dict())
    with pytest.raises(ValueError, match="not a ExactMixedPrecisionOptimizer state dict: format 'other/1'"):
        mp.load_state_dict({"format": "other/1", "state": {}, "param_groups": []})


def test_refresh_masters_after_weights_only_load():
    model = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    other = make_model(torch.bfloat16, seed=3)
    model.load_state_dict(other.state_dict())
    mp.refresh_masters()
    for m, p in zip(mp.master_params(), other.parameters(), strict=True):
        assert torch.equal(m, p.float())


# --- the torch.optim contract ---------------------------------------------------------------------------------
def test_optimizer_contract_and_hooks():
    model = make_model(torch.float16)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    mp = MixedPrecisionOptimizer(inner, loss_scaler=DynamicLossScaler(init_scale=4.0, hysteresis=1))
    assert isinstance(mp, torch.optim.Optimizer)
    assert mp.param_groups is inner.param_groups and mp.state is inner.state and mp.defaults is inner.defaults
    calls = []
    mp.register_step_pre_hook(lambda *a: calls.append("outer-pre"))
    mp.register_step_post_hook(lambda *a: calls.append("outer-post"))
    inner.register_step_post_hook(lambda *a: calls.append("inner-post"))
    seen = []
    handle = register_optimizer_step_post_hook(lambda o, *a: seen.append(type(o).__name__))
    for bad in (True, False):
        set_scaled_grads(model.parameters(), grads_like(list(model.parameters()), step=0), mp.loss_scale)
        if bad:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        mp.step()
    handle.remove()
    assert calls == ["outer-pre", "outer-post", "outer-pre", "inner-post", "outer-post"]
    assert seen == [
        "ExactMixedPrecisionOptimizer",
        "Adam",
        "ExactMixedPrecisionOptimizer",
    ]  # global hooks see both


def test_closure_is_called_with_grad_enabled_and_returned():
    model = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 9, dtype=torch.bfloat16)

    def closure():
        mp.zero_grad()
        loss = model(x).float().pow(2).mean()
        mp.backward(loss)
        return loss

    with torch.no_grad():
        loss = mp.step(closure)
    assert loss.requires_grad and not mp.step_was_skipped


def test_backward_scales_the_loss():
    model = make_model(torch.float16)
    mp = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(16.0)
    )
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(0)).half()
    (model(x).float().sum() * 16).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model(x).float().sum().backward()
    model.zero_grad()
    model(x).float().sum().backward()
    unscaled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    mp.backward(model(x).float().sum())
    for p, e, u in zip(model.parameters(), expected, unscaled, strict=True):
        assert torch.equal(p.grad, e)
        torch.testing.assert_close(
            p.grad.float(), u.float() * 16, **tol("fp16_scaled_backward", torch.float16)
        )


def test_default_scalers():
    fp16 = MixedPrecisionOptimizer(torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1))
    assert isinstance(fp16.loss_scaler, DynamicLossScaler) and fp16.loss_scale == 2.0**16
    bf16 = MixedPrecisionOptimizer(torch.optim.SGD(make_model(torch.bfloat16).parameters(), lr=0.1))
    assert isinstance(bf16.loss_scaler, StaticLossScaler) and bf16.loss_scale == 1.0
    loss = torch.ones((), requires_grad=True)
    assert bf16.scale_loss(loss) is loss


def test_order_errors():
    model = make_model(torch.float16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 9, dtype=torch.float16)
    mp.backward(model(x).float().sum())
    mp.unscale_()
    with pytest.raises(RuntimeError, match="a backward ran after unscale_\\(\\)"):
        mp.backward(model(x).float().sum())
    model(x).float().sum().backward()  # grads change behind the unscaled masters
    with pytest.raises(RuntimeError, match="gradients changed after unscale_"):
        mp.step()
    mp.zero_grad()
    mp.backward(model(x).float().sum())
    mp.step()
    with pytest.raises(RuntimeError, match="step\\(\\) called again without a new backward"):
        mp.step()
    mp.zero_grad()
    mp.step()  # no grads at all: nothing to apply, not an error


def _mixed_model():
    """bf16 linear layers with an fp32 norm between them: dtypes interleave in the param-group order."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 41), torch.nn.LayerNorm(41), torch.nn.Linear(41, 7))
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)
    return model


def test_mixed_dtypes_norm_and_clip_bit_identical_in_group_order():
    for seed in range(8):
        model = _mixed_model()
        ref = fp32_copy(model)
        mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.5)
        oracle = torch.optim.SGD(ref.parameters(), lr=0.1)
        grads = grads_like(list(model.parameters()), step=seed, scale=30.0)
        set_scaled_grads(model.parameters(), grads, 1.0)
        for q, g in zip(ref.parameters(), grads, strict=True):
            q.grad = g.float()
        expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        mp.step()
        oracle.step()
        assert mp.grad_norm == expected.item()
        for m, q in zip(mp.master_params(), ref.parameters(), strict=True):
            assert torch.equal(m, q)


def test_user_clip_after_unscale_with_fp32_params():
    model = _mixed_model()
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(model(torch.randn(3, 9, dtype=torch.bfloat16)).float().sum())
    mp.unscale_()
    torch.nn.utils.clip_grad_norm_(mp.master_params(), 1e-3)  # also changes the fp32 params' own grads
    mp.step()
    assert not mp.step_was_skipped


def test_add_fp16_group_to_unscaled_optimizer_is_an_error():
    bf = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(bf.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="adds fp16 params .* loss_scaler=halfprec.DynamicLossScaler"):
        mp.add_param_group({"params": list(make_model(torch.float16).parameters())})


# --- 8. error table -------------------------------------------------------------------------------------------
def _int_param_opt():
    return torch.optim.SGD(
        [torch.nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)], lr=0.1
    )


def _dup_opt():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups.append({**opt.param_groups[0], "params": [p]})
    return opt


def _sgd():
    return torch.optim.SGD(make_model(torch.float16).parameters(), lr=0.1)


ERRORS = [
    (lambda: MixedPrecisionOptimizer(object()), ValueError, "expected a torch.optim.Optimizer, got object"),
    (
        lambda: MixedPrecisionOptimizer(MixedPrecisionOptimizer(_sgd())),
        ValueError,
        "already a MixedPrecision",
    ),
    (lambda: MixedPrecisionOptimizer(_int_param_opt()), ValueError, "dtype torch.int64.*floating-point"),
    (lambda: MixedPrecisionOptimizer(_dup_opt()), ValueError, "appears twice"),
    (lambda: MixedPrecisionOptimizer(_sgd(), max_grad_norm=0.0), ValueError, "max_grad_norm must be.*0.0"),
    (lambda: MixedPrecisionOptimizer(_sgd(), max_grad_norm=-1), ValueError, "max_grad_norm must be.*-1"),
    (lambda: MixedPrecisionOptimizer(_sgd(), param_dtype=torch.int8), ValueError, "param_dtype must be"),
    (
        lambda: MixedPrecisionOptimizer(_sgd(), max_grad_norm="1.0"),
        ValueError,
        "max_grad_norm must be.*'1.0'",
    ),
    (
        lambda: MixedPrecisionOptimizer(_sgd(), max_grad_norm=[1.0]),
        ValueError,
        r"max_grad_norm must be.*\[1.0\]",
    ),
    (
        lambda: MixedPrecisionOptimizer(_sgd(), skip_nonfinite="no"),
        ValueError,
        "skip_nonfinite must be.*'no'",
    ),
    (
        lambda: MixedPrecisionOptimizer(_sgd(), loss_scaler=torch.amp.GradScaler("cpu")),
        ValueError,
        "GradScaler",
    ),
    (
        lambda: MixedPrecisionOptimizer(torch.optim.LBFGS(make_model(torch.float16).parameters())),
        ValueError,
        "LBFGS re-evaluates the closure",
    ),
    (
        lambda: MixedPrecisionOptimizer(
            torch.optim.SGD(make_model(torch.float16).parameters(), differentiable=True)
        ),
        ValueError,
        "differentiable=True",
    ),
    (lambda: StaticLossScaler(3.0), ValueError, "power of two.*3.0.*use 4.0 or 2.0"),
    (lambda: StaticLossScaler(0.0), ValueError, "positive, finite power of two, got 0.0"),
    (lambda: StaticLossScaler(-2.0), ValueError, "got -2.0"),
    (lambda: DynamicLossScaler(init_scale=1000.0), ValueError, "init_scale must be a power of two"),
    (lambda: DynamicLossScaler(growth_factor=1.0), ValueError, "growth_factor must be > 1"),
    (lambda: DynamicLossScaler(backoff_factor=2.0), ValueError, "backoff_factor must be < 1"),
    (
        lambda: DynamicLossScaler(growth_interval=0),
        ValueError,
        "growth_interval must be an integer >= 1, got 0",
    ),
    (lambda: DynamicLossScaler(hysteresis=1.5), ValueError, "hysteresis must be an integer"),
    (
        lambda: DynamicLossScaler(init_scale=0.5, min_scale=1.0),
        ValueError,
        "init_scale .* must be >= min_scale",
    ),
]


@pytest.mark.parametrize("build,error,pattern", ERRORS)
def test_errors(build, error, pattern):
    with pytest.raises(error, match=pattern):
        build()


# --- 9. import hygiene and public surface ----------------------------------------------------------------------
SCHEDULERS = [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
    lambda o: torch.optim.lr_scheduler.StepLR(o, 2),
    lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=4),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=20),
    lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.1, step_size_up=2),
    lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=6),
    lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [torch.optim.lr_scheduler.ConstantLR(o), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
        milestones=[2],
    ),
]


@pytest.mark.parametrize("make", SCHEDULERS)
@pytest.mark.parametrize("built_on", ["wrapper", "inner"])
def test_every_scheduler_works_without_warning(make, built_on):
    model = make_model(torch.float16)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_inner = torch.optim.SGD(fp32_copy(model).parameters(), lr=0.1, momentum=0.9)
    ref_sched = make(ref_inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", SCALED_BY_HAND)
        sched = make(inner) if built_on == "inner" else None
        mp = MixedPrecisionOptimizer(inner, loss_scaler=DynamicLossScaler(init_scale=2.0**8, hysteresis=1))
        sched = sched or make(mp)
        for step in range(6):
            set_scaled_grads(
                model.parameters(), grads_like(list(model.parameters()), step=step), mp.loss_scale
            )
            if step in (0, 3):
                next(model.parameters()).grad.view(-1)[0] = float("nan")
            mp.step()
            if not mp.step_was_skipped:
                sched.step()
                ref_inner.step()
                ref_sched.step()
            mp.zero_grad()
    assert [g["lr"] for g in mp.param_groups] == [g["lr"] for g in ref_inner.param_groups]


def test_add_param_group_gets_masters():
    model = make_model(torch.bfloat16)
    params = list(model.parameters())
    mp = MixedPrecisionOptimizer(torch.optim.Adam(params[:2], lr=1e-2))
    mp.add_param_group({"params": params[2:], "lr": 1e-3})
    assert len(mp.master_params()) == len(params)
    assert all(m.dtype == torch.float32 for m in mp.param_groups[1]["params"])
    with pytest.raises(ValueError, match="appears twice"):
        mp.add_param_group({"params": params[:1]})
    set_scaled_grads(params, grads_like(params, step=0), 1.0)
    mp.step()
    assert torch.equal(params[3], mp.master_params()[3].to(torch.bfloat16))


CUDA_CASES = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    (torch.optim.Adam, dict(lr=1e-2, capturable=True)),
    (torch.optim.Adam, dict(lr=1e-2, foreach=False)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("cls,kwargs", CUDA_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_parity_cuda(cls, kwargs, dtype):
    model = make_model(dtype).cuda()
    ref = fp32_copy(model)
    mp = MixedPrecisionOptimizer(cls(model.parameters(), **kwargs), max_grad_norm=0.5, impl="torch")
    oracle = cls(ref.parameters(), **kwargs)
    for step in range(10):
        grads = [g.cuda() for g in grads_like(list(model.parameters()), step=step)]
        set_scaled_grads(model.parameters(), grads, mp.loss_scale)
        for q, g in zip(ref.parameters(), grads, strict=True):
            q.grad = g.float()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.5)
        mp.step()
        oracle.step()
    _assert_parity(model, ref, mp, oracle)


def test_one_host_read_per_step(monkeypatch):
    model = make_model(torch.float16)
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
    set_scaled_grads(model.parameters(), grads_like(list(model.parameters()), step=0), mp.loss_scale)
    reads, inner = [], {"on": False}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def read(self, *a, _r=real, _n=name):
            if not inner["on"]:
                reads.append(_n)
            return _r(self, *a)

        monkeypatch.setattr(torch.Tensor, name, read)
    inner_step = mp.optimizer.step

    def step_without_counting(*a, **k):  # torch's for-loop Adam reads its CPU step counter: not ours
        inner["on"] = True
        try:
            return inner_step(*a, **k)
        finally:
            inner["on"] = False

    monkeypatch.setattr(mp.optimizer, "step", step_without_counting)
    mp.step()
    monkeypatch.undo()
    assert reads == ["tolist"], reads
    assert mp.grad_norm is not None and not mp.step_was_skipped


def test_calls_through_a_dict_copying_wrapper_reach_the_optimizer():
    """Lightning's and Fabric's optimizer wrappers copy ``__dict__`` into a dynamic subclass instance."""
    model = make_model(torch.float16)
    mp = MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), loss_scaler=StaticLossScaler(4.0)
    )
    wrapper = object.__new__(type("Wrapped", (type(mp),), {}))
    wrapper.__dict__ = dict(mp.__dict__)
    before = [m.detach().clone() for m in mp.master_params()]
    set_scaled_grads(model.parameters(), grads_like(list(model.parameters()), step=0), 4.0)
    wrapper.unscale_()
    assert mp._s.unscaled
    mp.master_params()[0].grad.zero_()  # a user edit between unscale_() and step() is kept
    wrapper.step()
    assert torch.equal(mp.master_params()[0], before[0])  # zero grad: unchanged
    assert not torch.equal(mp.master_params()[1], before[1])
    assert mp.skipped_steps == wrapper.skipped_steps == 0 and not mp._s.unscaled


def test_overflow_at_min_scale_warns_once_and_keeps_skipping():
    model = torch.nn.Linear(4, 1, bias=False).half()
    scaler = halfprec.DynamicLossScaler(init_scale=4.0, min_scale=1.0, hysteresis=1)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), loss_scaler=scaler)
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            mp.backward(model(torch.ones(1, 4, dtype=torch.float16)).float().sum() * float("inf"))
            mp.step()
            mp.zero_grad()
            scales.append(mp.loss_scale)
    assert scales == [2.0, 1.0, 1.0, 1.0, 1.0] and mp.skipped_steps == 5
    at_min = [w for w in caught if "minimum loss scale" in str(w.message)]
    assert len(at_min) == 1 and issubclass(at_min[0].category, RuntimeWarning)
    assert "Lower min_scale" in str(at_min[0].message)


@pytest.mark.parametrize(
    ("other", "match"),
    [
        # one more layer: the first extra param is named, not just the group sizes
        (
            lambda: [torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2)],
            r"holds 4 params, this optimizer 6: param 4 \(shape \[2, 2\] dtype torch.float16\) is only in this model",
        ),
        # same sizes, another shape at param 2
        (
            lambda: [torch.nn.Linear(3, 4), torch.nn.Linear(4, 3)],
            r"at param 2: saved shape \[2, 4\] dtype torch.float16 .*this model shape \[3, 4\]",
        ),
    ],
)
def test_load_into_another_model_names_the_first_mismatching_param(other, match):
    def wrap(layers):
        model = torch.nn.Sequential(*layers).half()
        return halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))

    saved = wrap([torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)]).state_dict()
    mp = wrap(other())
    with pytest.raises(ValueError, match=match):
        mp.load_state_dict(saved)


def test_add_param_group_refuses_differentiable():
    model = torch.nn.Linear(3, 4).half()
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW([model.weight]))
    with pytest.raises(ValueError, match=r"add_param_group got differentiable=True"):
        mp.add_param_group({"params": [model.bias], "differentiable": True})


@pytest.mark.parametrize(("value", "skipped"), [(1.0e19, False), (2.0e19, True)])
def test_a_norm_whose_fp32_square_overflows_skips_as_documented(value, skipped):
    # docs/guarantees.md: the norm is clip_grad_norm_'s (an fp32 sum of squares), so a finite bf16 grad of 2e19
    # gives an inf norm and a skip; 1e19 (square 1e38 < 3.4e38) does not
    model = make_model(torch.bfloat16)
    mp = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), max_grad_norm=1.0, impl="torch")
    for i, p in enumerate(model.parameters()):
        p.grad = torch.zeros_like(p)
        if i == 0:
            p.grad.view(-1)[0] = value
    mp.step()
    grads = [p.grad.float() for p in model.parameters()]
    ref = torch.nn.utils.get_total_norm(grads)  # what clip_grad_norm_ computes on these grads in fp32
    assert (
        mp.step_was_skipped is skipped and math.isinf(mp.grad_norm) is skipped and math.isinf(ref) is skipped
    )
