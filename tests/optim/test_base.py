"""The contract every halfprec optimizer keeps (``halfprec.optim.base``): one class family, whatever the strategy.

Three failures pinned here: a fused optimizer wrapped again (its grads would be scaled twice, every step skipped,
the weights never moved), ``MixedPrecisionOptimizer(...)`` returning an object that is not a
``MixedPrecisionOptimizer``, and a strategy allocating its state at construction. The members every strategy
shares are tested on every strategy in ``test_contract.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdamW, FusedSGD

from ..allocations import NewStorageBytes


def _model(dtype=torch.float16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).to(dtype)


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_every_strategy_is_a_mixed_precision_optimizer(impl):
    model = _model()
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), impl=impl)
    assert isinstance(mp, halfprec.MixedPrecisionOptimizer) and isinstance(mp, torch.optim.Optimizer)
    assert mp.impl == impl
    for cls in (FusedAdamW, FusedSGD, FusedAdagrad):
        assert isinstance(cls(_model().parameters(), lr=0.1), halfprec.MixedPrecisionOptimizer)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_state_dict_hooks_run_on_every_strategy(impl):
    # torch's four state-dict hook registries, in torch's order; a pre-load hook may replace the state dict
    model = _model()
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), impl=impl)
    calls = []
    mp.register_state_dict_pre_hook(lambda opt: calls.append("save-pre"))
    mp.register_state_dict_post_hook(lambda opt, sd: calls.append("save-post") or {**sd, "tag": 1})
    mp.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(("load-pre", sd["tag"])) or sd)
    mp.register_load_state_dict_post_hook(lambda opt: calls.append("load-post"))
    saved = mp.state_dict()
    assert saved["tag"] == 1
    mp.load_state_dict(saved)
    assert calls == ["save-pre", "save-post", ("load-pre", 1), "load-post"]


def _hooked(impl, cls=None):
    """(model, optimizer, closure, calls): the closure and every hook append to ``calls``."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = (
        halfprec.MixedPrecisionOptimizer(inner, impl=impl) if cls is None else cls(model.parameters(), lr=0.1)
    )
    calls = []
    x = torch.ones(2, 256, dtype=torch.float16)

    def closure():
        calls.append("closure")
        loss = model(x).float().mean()
        mp.backward(loss)
        return loss

    return model, mp, closure, calls


def _seen(mp, calls, name):
    def hook(opt, *_):
        if opt is mp:  # the exact strategy's inner torch optimizer runs the global hooks too
            calls.append(name)

    return hook


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("how", ["positional", "keyword", "injected"])
def test_step_runs_torchs_step_hooks_on_every_strategy(impl, how):
    # torch's protocol: global and own pre-hooks, which see the arguments as given (self first) and may replace
    # them, the step, own and global post-hooks (which see the replaced ones)
    model, mp, closure, calls = _hooked(impl)
    assert type(mp).step is halfprec.MixedPrecisionOptimizer.step  # torch put no wrapper of its own around it

    def pre(opt, args, kwargs):
        calls.append(("pre", args, kwargs))
        return (args, {**kwargs, "closure": closure}) if how == "injected" else None

    global_pre = register_optimizer_step_pre_hook(_seen(mp, calls, "global-pre"))
    global_post = register_optimizer_step_post_hook(_seen(mp, calls, "global-post"))
    try:
        mp.register_step_pre_hook(pre)
        mp.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", args, kwargs)))
        given = {"positional": ((closure,), {}), "keyword": ((), {"closure": closure}), "injected": ((), {})}[
            how
        ]
        loss = mp.step(*given[0], **given[1])
    finally:
        global_pre.remove()
        global_post.remove()
    seen_args, seen_kwargs = (mp, *given[0]), given[1]
    after = {**seen_kwargs, "closure": closure} if how == "injected" else seen_kwargs
    assert calls == [
        "global-pre", ("pre", seen_args, seen_kwargs), "closure", ("post", seen_args, after), "global-post",
    ]  # fmt: skip
    assert loss is not None and mp.skipped_steps == 0


def test_a_subclass_that_overrides_step_runs_the_hooks_once():
    class Traced(FusedSGD):
        def step(self, closure=None):
            calls.append("override")
            return super().step(closure)

    model, mp, closure, calls = _hooked("triton", Traced)
    mp.register_step_pre_hook(lambda *_: calls.append("pre"))
    mp.register_step_post_hook(lambda *_: calls.append("post"))
    mp.step(closure)
    assert calls == ["override", "pre", "closure", "post"]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_step_pre_hook_returning_something_else_is_refused(impl):
    _, mp, _, _ = _hooked(impl)
    mp.register_step_pre_hook(lambda opt, args, kwargs: 5)
    with pytest.raises(
        RuntimeError, match=r"returned 5: it must return None or a tuple \(new_args, new_kwargs\)"
    ):
        mp.step()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_profiler_range_opens_only_while_a_profiler_records(impl, monkeypatch):
    # an idle range is host time on every step; under a profiler, one range per step
    model, mp, closure, _ = _hooked(impl)
    name = f"Optimizer.step#{type(mp).__name__}.step"
    opened = []
    record_function = torch.autograd.profiler.record_function

    def counted(label, *args):
        opened.append(label)
        return record_function(label, *args)

    monkeypatch.setattr(torch.autograd.profiler, "record_function", counted)
    for _ in range(2):
        mp.step(closure)
        mp.zero_grad()
    assert name not in opened
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            mp.step(closure)
            mp.zero_grad()
    assert opened.count(name) == 2
    assert [e.name for e in prof.events()].count(name) == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_halfprec_optimizer_is_never_wrapped_again(dtype):
    """``MixedPrecisionOptimizer(FusedAdamW(...))`` was accepted: fp16 grads were scaled twice and every step
    skipped, the weights never moved. Every strategy is refused now, by the wrapper and by the engine."""
    model = _model(dtype)
    for inner in (FusedAdamW(model.parameters(), lr=1e-2), halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(_model(dtype).parameters()), impl="torch"
    )):  # fmt: skip
        with pytest.raises(
            ValueError, match=rf"already a MixedPrecisionOptimizer \({type(inner).__name__}\)"
        ):
            halfprec.MixedPrecisionOptimizer(inner)
        with pytest.raises(ValueError, match=r"initialize\(\) wraps it itself"):
            halfprec.initialize(model, inner, precision="bf16" if dtype == torch.bfloat16 else "fp16")


def test_fused_optimizer_used_alone_trains():
    """The control of the case above: the same fused optimizer, not wrapped, moves the weights."""
    model = _model()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    w0 = model[0].weight.detach().clone()
    for _ in range(3):
        opt.backward(model(torch.randn(8, 256).half()).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    assert (model[0].weight.float() - w0.float()).abs().max() > 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("torch_cls", [torch.optim.AdamW, torch.optim.Adagrad])
def test_construction_allocates_only_the_masters(impl, torch_cls):
    """Construction is inert on every strategy: wrapping allocates the fp32 masters (4 B/param) and, on the fused
    path, the flat 16-bit param buffer the params become views of (2 B/param); optimizer state and grad
    buffers come into being at the first real update (allocating master, grad and AdamW state buffers at
    construction would be 16 B/param: 16.0 MiB against 4.0 MiB for 1M params)."""
    model = _model()
    n = _numel(model)
    inner = torch_cls(model.parameters(), lr=1e-3)  # Adagrad creates its 16-bit `sum` here, before wrapping
    with NewStorageBytes() as counter:
        mp = halfprec.MixedPrecisionOptimizer(inner, impl=impl)
    per_param = {"torch": 4, "triton": 4 + 2}[impl]  # masters; the fused flat 16-bit param buffer
    if torch_cls is torch.optim.Adagrad:
        # its eager `sum`, re-created in fp32 on the masters (the state-moving policy, optim/state.py); the exact path also makes a
        # transient 16-bit copy of it to tell the constructor's value from one the user set (this counts
        # allocations, not the peak)
        per_param += {"torch": 4 + 2, "triton": 4}[impl]
    overhead = 4096 * len(list(model.parameters()))  # per-param bookkeeping: tables, counters, alignment
    assert per_param * n <= counter.total <= per_param * n + overhead, counter.total / n
    state = mp.state_dict()["optimizer"]["state"]
    if (
        torch_cls is torch.optim.Adagrad
    ):  # eager state: re-created exactly in fp32, as torch's constructor would
        assert all(s["sum"].dtype == torch.float32 and float(s["step"]) == 0 for s in state.values())
    else:
        assert state == {}
    mp.backward(model(torch.randn(4, 256).half()).float().pow(2).mean())
    mp.step()
    state = mp.state_dict()["optimizer"]["state"]
    assert len(state) == 4 and all(float(s["step"]) == 1 for s in state.values())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_state_dict_round_trip_before_the_first_update_allocates_no_state(impl):
    """Accelerate's ``prepare()`` (``device_placement``) calls ``load_state_dict(state_dict())`` on the optimizer
    before any step: the fused path allocated its AdamW moments there (8 B/param, measured as 30 instead of 14
    B/param at the HF Trainer's first step), i.e. at construction on the HF and Accelerate paths."""
    model, twin_model = _model(), _model()
    n = _numel(model)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), impl=impl)
    twin = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(twin_model.parameters(), lr=1e-3), impl=impl)
    with NewStorageBytes() as counter:
        mp.load_state_dict(mp.state_dict())
    overhead = 4096 * len(list(model.parameters()))
    assert counter.total <= 4 * n + overhead, counter.total / n  # the state dict's copies of the masters
    assert mp.state_dict()["optimizer"]["state"] == {}
    x = torch.randn(4, 256).half()
    for m, opt in ((model, mp), (twin_model, twin)):
        for _ in range(2):
            opt.backward(m(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True))
    assert all(float(s["step"]) == 2 for s in mp.state_dict()["optimizer"]["state"].values())


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_construction_peak_on_the_gpu(impl):
    """The same on the device: 1,048,576 fp16 params, AdamW; the construction peak
    above what the model already held is the masters (4 MiB), plus the fused flat 16-bit params (2 MiB): the
    fused path's peak was 16.0 MiB (master, grad and moment buffers made at construction)."""
    n = 1 << 20
    param = torch.nn.Parameter(torch.full((n,), 0.5, dtype=torch.float16, device="cuda"))
    inner = torch.optim.AdamW([param], lr=0.01, weight_decay=0.1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mp = halfprec.MixedPrecisionOptimizer(inner, impl=impl)
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    budget = {"torch": 4.0, "triton": 6.0}[impl]
    assert budget <= peak_mib <= budget + 0.5, peak_mib
    assert float(param[0]) == 0.5 and mp.state_dict()["optimizer"]["state"] == {}  # inert: no synthetic step


def test_distributed_checkpoint_takes_the_fused_strategy(tmp_path):
    """It takes ``isinstance(opt, MixedPrecisionOptimizer)``, the fused strategy included (through its
    ``state_dict``): the masters it saves are the fp32 masters, never the 16-bit params (round trips:
    tests/distributed/test_checkpoint_load.py)."""
    from halfprec.distributed import checkpoint, consolidate

    model = _model()
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), impl="triton")
    checkpoint.save(mp, tmp_path / "c", named_parameters=model)
    masters = consolidate(tmp_path / "c")
    assert all(m.dtype == torch.float32 for m in masters.values())


def _snapshot(opt, model) -> list:
    """Everything a load may write: params, masters, state buffers and counters, group hyper-parameters."""
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    tensors = [p.detach().clone() for p in model.parameters()] + [
        m.detach().clone() for m in opt.master_params()
    ]
    state = [v.clone() for s in sd["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    return [groups, sd["scaler"], sd["skipped_steps"], tensors + state]


def _assert_same(a: list, b: list) -> None:
    assert a[:3] == b[:3]
    assert len(a[3]) == len(b[3]) and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))


def _stepped(opt, model):
    from ..reference import grads_like, set_scaled_grads

    params = list(model.parameters())
    set_scaled_grads(params, grads_like(params, step=0), opt.loss_scale)
    opt.step()
    return opt


def test_a_fused_load_refuses_another_optimizers_state_and_bad_groups_and_changes_nothing():
    """FusedAdamW.load_state_dict of an SGD checkpoint wrote SGD's groups into the Adam groups, then failed on
    the state; a bad group in either format was written before its check. All are refused before any write."""
    from ..reference import make_model

    model = make_model(torch.float16)
    fused = _stepped(FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1), model)
    assert fused.state_dict()["algorithm"] == "AdamW"
    other = make_model(torch.float16)
    sgd = _stepped(
        halfprec.MixedPrecisionOptimizer(
            torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9), impl="torch"
        ),
        other,
    )
    bad = fused.state_dict()
    bad["optimizer"]["param_groups"][0]["lr"] = -1.0
    torch_bad = {"state": {}, "param_groups": bad["optimizer"]["param_groups"]}
    before = _snapshot(fused, model)
    for saved, match in [(sgd.state_dict(), "saved by SGD"), (bad, "lr"), (torch_bad, "lr")]:
        with pytest.raises(ValueError, match=match):
            fused.load_state_dict(saved)
        _assert_same(before, _snapshot(fused, model))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("cast", [torch.float16, torch.float32])
def test_a_param_dtype_changed_after_wrapping_is_refused_at_step(impl, cast):
    """``model.half()`` after wrapping a bf16 model trained fp16 without loss scaling, silently."""
    model = _model(torch.bfloat16)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), impl=impl)
    model.to(cast)
    mp.backward(model(torch.randn(4, 256, dtype=cast)).float().pow(2).mean())
    with pytest.raises(
        RuntimeError, match=rf"shape \(512, 256\) is {cast} now but was torch.bfloat16.*before wrapping"
    ):
        mp.step()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_an_fp64_param_with_a_16_bit_param_dtype_is_refused(impl):
    """Only fp32 params were cast: an fp64 one kept an fp64 master, training out of the fp32 contract."""
    model = _model(torch.float64)
    with pytest.raises(
        ValueError, match=r"(float64 and param_dtype=torch.bfloat16.*model.float\(\))|(fp16, bf16 and fp32)"
    ):
        halfprec.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters()), param_dtype=torch.bfloat16, impl=impl
        )
