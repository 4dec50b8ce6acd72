"""GPU checks of the fused path (skipped without CUDA): bf16, large sizes, no host sync, CUDA-graph capture."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdamW, FusedSGD
from halfprec.optim.fused.results import SkipReporter

from ..tolerances import tol
from .helpers import (
    AtenOps,
    assert_params_are_rounded_masters,
    assert_same_state,
    pair,
    random_grads,
    run_both,
    set_grads,
    small_mlp,
    warm_up_on_side_stream,
)

pytestmark = pytest.mark.gpu

SIZES = [9, 41, 341, 4231, 1, 127, 4097, 2**16 + 3, (1024, 1031)]


def _none_at(s):
    return {2} if s == 1 else ()  # param 2 gets no grad at step 1


@pytest.mark.parametrize(
    ("torch_cls", "fused_cls", "hp"),
    [
        (torch.optim.AdamW, FusedAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
        (torch.optim.SGD, FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
        (torch.optim.Adagrad, FusedAdagrad, dict(lr=0.05, lr_decay=0.01)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_matches_torch_path(torch_cls, fused_cls, hp, dtype):
    ref, fused, a, b = pair(torch_cls, fused_cls, SIZES, dtype, hp, device="cuda", max_grad_norm=1.0)
    run_both(ref, fused, a, b, 4, none_at=_none_at)
    assert_same_state(ref, fused, dtype)
    assert_params_are_rounded_masters(fused)


def test_dynamic_scaler_skip_on_cuda():
    scaler = lambda: halfprec.DynamicLossScaler(init_scale=2.0**8, hysteresis=1)  # noqa: E731
    ref, fused, a, b = pair(
        torch.optim.AdamW,
        FusedAdamW,
        SIZES[:5],
        torch.float16,
        dict(lr=1e-3),
        device="cuda",
        max_grad_norm=1.0,
        scaler=scaler,
    )
    run_both(ref, fused, a, b, 2, scale=2.0**8, none_at=_none_at)
    grads = random_grads(a, 7)
    grads[0][0] = float("nan")
    set_grads(a, grads)
    set_grads(b, grads)
    ref.step()
    fused.step()
    assert fused.step_was_skipped and fused.skipped_steps == 1 and fused.loss_scale == 2.0**7
    assert_same_state(ref, fused, torch.float16)


def test_step_does_not_sync_with_the_host():
    _, fused, _, b = pair(
        torch.optim.AdamW, FusedAdamW, SIZES, torch.float16, dict(lr=1e-3), device="cuda", max_grad_norm=1.0
    )
    sched = torch.optim.lr_scheduler.LambdaLR(fused, lambda s: 1.0 / (1 + s))
    for s in range(3):
        set_grads(b, random_grads(b, s))
        if s == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            fused.step()
            sched.step()  # a new Python-float lr every step: uploaded without a sync
        finally:
            torch.cuda.set_sync_debug_mode(0)
        fused.zero_grad()
    assert not fused.step_was_skipped


def test_engine_step_without_a_scheduler_does_not_sync_with_the_host(monkeypatch):
    # the engine reads a step's results only for a scheduler (or when the record is read); a read of the staged
    # record is an event wait, which the sync debug mode does not see, so it is counted too
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = halfprec.initialize(model, opt, precision="fp16", max_grad_norm=1.0)
    x = torch.randn(16, 64, device="cuda")
    waits = []
    latest = SkipReporter.latest
    monkeypatch.setattr(SkipReporter, "latest", lambda self, slot: waits.append(slot) or latest(self, slot))
    for s in range(3):
        engine.backward(engine(x.half()).float().square().mean())
        if s == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            record = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert waits == []
    assert record.step == 3 and not record.skipped and record.grad_norm > 0


class _UpdateAfter(halfprec.DynamicLossScaler):
    """A dynamic scaler whose own update runs after the update pass (not fusable): the record comes after it."""

    def update(self, found_inf):
        super().update(found_inf)


@pytest.mark.parametrize("scaler", [None, _UpdateAfter], ids=["built-in", "own-update"])
def test_reading_the_skip_flag_does_not_wait_for_work_queued_after_the_step(scaler):
    # the step stages its record before the update pass (with the built-in scalers) or after the scaler's own
    # update: reading step_was_skipped right after step(), as an LR scheduler or the HF Trainer does, waits for
    # that record only, not for the work queued behind it (here a GPU sleep; in training, the update pass and
    # the next forward)
    _, fused, _, b = pair(
        torch.optim.AdamW, FusedAdamW, SIZES, torch.float16, dict(lr=1e-3), device="cuda", max_grad_norm=1.0,
        scaler=scaler and (lambda: scaler(init_scale=2.0**8, hysteresis=1)),
    )  # fmt: skip
    for s, bad in enumerate((False, False, True, False)):
        grads = random_grads(b, s)
        if bad:
            grads[1][3] = float("inf")
        set_grads(b, grads)
        fused.step()
        torch.cuda._sleep(2 * 10**8)  # ~0.1 s of GPU time queued behind the step
        skipped, norm, scale = fused.step_was_skipped, fused.grad_norm, fused.step_loss_scale
        running = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert running, "the read waited for the whole stream"
        assert skipped is bad and skipped == bool(fused.found_inf.item())
        kept = fused.step_results()  # a device copy, read after the synchronize
        assert (norm, scale) == (kept.grad_norm, kept.step_loss_scale)
        fused.zero_grad()
    assert fused.skipped_steps == 1


def test_after_a_capture_the_skip_flag_is_read_from_the_device():
    # a replay stages no record: once a step was captured, step_was_skipped reads the device scalars
    model = small_mlp(torch.float16)
    opt = FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    x = torch.randn(16, 64, device="cuda").half()

    def backward(scale):
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean() * scale)

    def warm_up():
        backward(1.0)
        opt.step()

    warm_up_on_side_stream(warm_up)
    assert not opt.step_was_skipped
    backward(1.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for scale, skipped in ((float("inf"), True), (1.0, False), (float("nan"), True)):
        backward(scale)
        graph.replay()
        assert opt.step_was_skipped is skipped


def test_a_backward_called_on_another_stream_than_its_forward_gets_exact_grads():
    # torch allows backward() under another stream than the forward's; the fresh grads are made on the forward's
    # stream and are copied into the flat buffer there (the end-of-backward callback runs on the caller's
    # stream), so the memory they free can be reused on the forward's stream at once
    models = [small_mlp(torch.float16) for _ in range(2)]
    mp = FusedAdamW(models[0].parameters(), lr=1e-3)
    x = torch.randn(4096, 64, device="cuda", dtype=torch.float16)
    models[1](x).float().pow(2).mean().backward()
    loss = models[0](x).float().pow(2).mean()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2 * 10**8)  # the side stream is busy: what it queues runs late
        loss.backward()
    junk = [torch.full_like(p, 7.0) for p in models[0].parameters()]  # in the memory the fresh grads had
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    del junk, mp  # alive until here: the memory they reuse, and the optimizer its hooks hold weakly


def test_captured_step_replays_with_a_changing_lr():
    models = [small_mlp(torch.float16) for _ in range(2)]  # the same seed: the same weights
    lr = torch.tensor(1e-2, device="cuda")
    graphed = FusedAdamW(models[0].parameters(), lr=lr, weight_decay=0.1, max_grad_norm=1.0)
    eager = FusedAdamW(
        models[1].parameters(), lr=torch.tensor(1e-2, device="cuda"), weight_decay=0.1, max_grad_norm=1.0
    )
    x = torch.randn(16, 64, device="cuda").half()

    def backward(model, opt, i):
        opt.zero_grad()
        opt.backward(model(x * (1 + i)).float().pow(2).mean())

    def warm_up():
        for opt, model in ((graphed, models[0]), (eager, models[1])):
            backward(model, opt, 0)
            opt.step()

    warm_up_on_side_stream(warm_up)
    backward(models[0], graphed, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    lrs = [1e-2, 5e-3, 2e-3, 1e-3]
    for i, value in enumerate(lrs, start=1):
        if i > 1:
            backward(models[0], graphed, i)
        graphed.param_groups[0]["lr"].fill_(value)
        graph.replay()
        backward(models[1], eager, i)
        eager.param_groups[0]["lr"].fill_(value)
        eager.step()
    torch.cuda.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)
    for m, n in zip(graphed.master_params(), eager.master_params(), strict=True):
        assert torch.equal(m, n)
    sd = graphed.state_dict()["optimizer"]["state"]
    assert float(sd[0]["step"]) == 1 + len(lrs)


@pytest.mark.parametrize("skipped", [True, False])
def test_eager_step_runs_no_torch_op_but_the_report_copy(skipped):
    # the dynamic scaler's update runs inside the finalize kernel: an eager step is Triton launches and the one
    # non-blocking copy of the skip report (a skipped step is host-bound, so each launch counts)
    _, fused, _, b = pair(
        torch.optim.AdamW, FusedAdamW, SIZES, torch.float16, dict(lr=1e-3), device="cuda", max_grad_norm=1.0
    )
    assert isinstance(fused.loss_scaler, halfprec.DynamicLossScaler)
    for s in range(4):
        grads = random_grads(b, s)
        if skipped:
            grads[0][0] = float("inf")
        if s < 3:
            set_grads(b, grads)
            fused.step()
            continue
        for p, g in zip(b, grads, strict=True):
            p.grad.copy_(g)  # .grad is the flat buffer's view now, as after a backward
        fused.mark_grads()  # what the post-accumulate-grad hooks do
        fused.flush_reports()
        with AtenOps() as ops:
            fused.step()
    assert ops.names == Counter(copy_=1), ops.names
    assert fused.step_was_skipped is skipped


def _engine(seed: int, impl: str = "auto"):
    from tests.engine_util import TiedLM

    torch.manual_seed(seed)
    model = TiedLM().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return halfprec.initialize(
        model, opt, lr_scheduler=sched, precision="fp16", max_grad_norm=1.0, gradient_accumulation_steps=2,
        initial_scale=2.0**14, growth_interval=3, impl=impl,
    )  # fmt: skip


def test_engine_on_cuda_takes_the_fused_path_and_resumes_bit_exactly(tmp_path):
    from tests.engine_util import train

    engine, ref = _engine(0), _engine(0, impl="torch")
    assert isinstance(engine.optimizer, FusedAdamW)  # impl="auto" on CUDA
    torch.testing.assert_close(
        train(engine, 4, inject_inf_at=(1,)),
        train(ref, 4, inject_inf_at=(1,)),
        **tol("fused_engine_loss", torch.float16),
    )
    assert engine.skipped_steps == ref.skipped_steps == 1 and engine.last_record.skipped is False
    assert engine.lr_scheduler.last_epoch == 3
    assert [g["lr"] for g in engine.optimizer.param_groups] == [g["lr"] for g in ref.optimizer.param_groups]
    engine.save_checkpoint(tmp_path)
    train(engine, 2)
    resumed = _engine(123)
    resumed.load_checkpoint(tmp_path)
    train(resumed, 2)
    a, b = engine.optimizer.state_dict(), resumed.optimizer.state_dict()
    for k, v in a["masters"].items():
        assert torch.equal(v, b["masters"][k]), k
    for k, st in a["optimizer"]["state"].items():
        for key, v in st.items():
            assert torch.equal(v, b["optimizer"]["state"][k][key]), (k, key)
    for (name, v), w in zip(
        engine.module.state_dict().items(), resumed.module.state_dict().values(), strict=True
    ):
        assert torch.equal(v, w), name


def test_bench_measures_every_implementation():
    from halfprec.cli.bench_step import run_bench

    impls = ("fused", "fused32", "split", "torch", "plain")
    result = run_bench(
        workload="small", optimizers=("adamw", "sgd"), dtypes=("bfloat16",), impls=impls, iters=2
    )
    got = {(r["impl"], r["optimizer"]) for r in result["rows"]}
    assert got == {(i, o) for i in impls for o in ("adamw", "sgd")}, got
    assert all(r["ms"] > 0 for r in result["rows"])
    # the fused rows also time the step as a loop calls it (after zero_grad() and a backward), skipped too
    called = [r for r in result["rows"] if r["impl"] in ("fused", "split")]
    assert called and all(
        r["user_ms"] > 0 and r["user_skipped_ms"] > 0 and r["user_host_ms"] > 0 for r in called
    )
