"""Is a training step host-bound? The host's enqueue time per step against the GPU's, and halfprec's grad-hook
cost per param on the host.

    python benchmarks/host_bound.py            # on a CUDA machine: bench_train's Llama under halfprec and autocast
    python benchmarks/host_bound.py --hooks    # anywhere: a fused optimizer's post-accumulate-grad hooks, per param
    python benchmarks/host_bound.py --profile  # on a CUDA machine: where the host's time goes, plain loop vs HF
    python benchmarks/host_bound.py --timeline # on a CUDA machine: GPU busy and idle time, host syncs, plain vs HF
    python benchmarks/host_bound.py --ops      # anywhere: the torch ops (launches on CUDA) of one training step

For each system and dtype: 5 warm-up steps, then 15 steps timed by CUDA events (the GPU timeline, idle gaps
included) and by the host's time to enqueue each step, then 8 steps each between two ``synchronize()``. When the
enqueue time matches the event time, the host sets the pace: the GPU waits for launches, and the host's speed (on
a shared machine, its neighbours') moves the step time. ``--hooks`` times the backward of a 148-param fp16 MLP
with tiny layers (kernel time negligible) with and without a fused optimizer's grad hooks, after
``zero_grad(set_to_none=True)`` and ``False``: on CUDA when there is one (the host's time to enqueue the backward,
launches included), else on the CPU (the Triton interpreter is imported but runs no kernel in a backward).
``--profile`` runs halfprec's plain loop and the HF Trainer (bench_train's ``halfprec`` and ``hf`` systems, bf16
and fp16) under ``cProfile`` for the timed steps and prints, per step, the host time inside the Trainer's steps and
between them (without the profiler) and the functions with the most host time (with it; cProfile slows
Python-heavy code, so read its figures as shares). ``--timeline`` runs the plain loop, ``hf`` and ``hf-quiet``
(bench_train's systems) once under ``torch.profiler`` (CUDA activity only) and prints, per step, the GPU's busy
time (the union of its kernels, copies and fills), its idle time, and the host's blocking calls (stream, event
and device synchronizations, blocking copies); then once under ``torch.cuda.set_sync_debug_mode("warn")`` and
lists every synchronizing call site with the code that made it. ``--ops`` counts the aten ops that are not views
(on CUDA, each is a launch) in one training step (forward, backward, ``engine.step()``; for the HF Trainer, from
its ``on_step_begin`` to its ``on_step_end``) of a Llama with bench_train's 16 layers (147 params) at tiny widths,
on the CPU with the fused path (the Triton interpreter; the fused step's own kernels are not aten ops, and are not
counted): a count of host work that does not depend on the host's speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def gpu_table() -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_train

    print(
        "| system | dtype | event ms/step | host enqueue ms/step | synchronized ms/step | event ms, each step |"
    )
    print("|---|---|---|---|---|---|")
    for name, runner in (
        ("halfprec", bench_train.halfprec_runner),
        ("autocast", bench_train.autocast_runner),
    ):
        for dtype in (torch.bfloat16, torch.float16):
            model = bench_train.llama(0)
            step, _ = runner(model, dtype)
            data = bench_train.batches(8, 1024)
            for i in range(5):
                step(data[i % len(data)])
            torch.cuda.synchronize()
            host, events = [], []
            for i in range(15):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start = time.perf_counter()
                a.record()
                step(data[i % len(data)])
                b.record()
                host.append((time.perf_counter() - start) * 1e3)
                events.append((a, b))
            torch.cuda.synchronize()
            gpu = [a.elapsed_time(b) for a, b in events]
            synced = []
            for i in range(8):
                torch.cuda.synchronize()
                start = time.perf_counter()
                step(data[i % len(data)])
                torch.cuda.synchronize()
                synced.append((time.perf_counter() - start) * 1e3)
            print(
                f"| {name} | {str(dtype)[6:]} | {statistics.median(gpu):.1f} | {statistics.median(host):.1f} | "
                f"{statistics.median(synced):.1f} | {', '.join(f'{g:.1f}' for g in gpu)} |",
                flush=True,
            )
            del model, step
            torch.cuda.empty_cache()


def hook_cost(rounds: int = 300) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before halfprec imports triton
    from halfprec.optim import FusedAdamW

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(74)]).to(device, torch.float16)

    def backward_ms(model, set_to_none: bool, opt=None) -> float:
        x, times = torch.randn(4, 8, device=device, dtype=torch.float16), []
        for _ in range(rounds):
            loss = model(x).float().square().mean()
            if device == "cuda":
                torch.cuda.synchronize()  # an empty queue: the host's enqueue time alone is timed
            start = time.perf_counter()
            loss.backward()
            times.append(time.perf_counter() - start)
            (opt or model).zero_grad(set_to_none=set_to_none)
        return statistics.median(times) * 1e3

    # set_to_none=True frees the flat grad buffer: each hook copies its fresh grad in; False keeps it: each hook
    # only marks its param (autograd accumulates into the view)
    for set_to_none in (True, False):
        plain, hooked = mlp(), mlp()
        opt = FusedAdamW(hooked.parameters(), lr=1e-3)
        n = len(list(plain.parameters()))
        a, b = backward_ms(plain, set_to_none), backward_ms(hooked, set_to_none, opt)
        print(f"{device}, {n} params, zero_grad(set_to_none={set_to_none}): backward {a:.2f} ms plain, "
              f"{b:.2f} ms with a fused optimizer's grad hooks: {(b - a) / n * 1e3:.1f} us per param",
              flush=True)  # fmt: skip


def op_count(steps: int = 4) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the fused path on the CPU
    import tempfile
    from collections import Counter

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    import halfprec
    from halfprec.integrations.hf import HalfprecTrainer

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    def llama():
        config = LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=16, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
        )  # fmt: skip
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    def show(name: str, model, ops: Ops) -> None:
        top = ", ".join(f"{op} {n}" for op, n in ops.names.most_common(8))
        params = sum(1 for _ in model.parameters())
        print(f"{name}, {params} params: {ops.names.total()} aten ops per step ({top})", flush=True)

    x = torch.randint(0, 1000, (2, 32))
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = halfprec.initialize(model, opt, precision="bf16", max_grad_norm=1.0, impl="triton")
    for _ in range(steps):  # the last step is counted: the first ones make the state and the buffers
        with Ops() as ops:
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    show("plain loop (engine)", model, ops)

    counted: list[Ops] = []

    class Count(TrainerCallback):  # from the step's begin to its end: the batch is already fetched
        def on_step_begin(self, *_args, **_kwargs):
            counted.append(Ops())
            counted[-1].__enter__()

        def on_step_end(self, *_args, **_kwargs):
            counted[-1].__exit__(None, None, None)

    model = llama()
    rows = [{"input_ids": r, "labels": r} for _ in range(steps) for r in x]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3, max_grad_norm=1.0,
            lr_scheduler_type="constant", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        )  # fmt: skip
        trainer = HalfprecTrainer(
            model=model, args=args, train_dataset=rows, param_dtype=torch.bfloat16, callbacks=[Count()],
            impl="triton",
        )  # fmt: skip
        trainer.train()
    show("HF Trainer (HalfprecTrainer)", model, counted[-1])


def _top(profile, steps: int, count: int = 25) -> str:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:count]  # by own time
    lines = ["| own ms/step | cumulative ms/step | calls/step | function |", "|---|---|---|---|"]
    for (path, line, name), (_cc, calls, own, cum, _callers) in rows:
        where = f"{os.path.basename(path)}:{line}" if line else path
        lines.append(
            f"| {own / steps * 1e3:.2f} | {cum / steps * 1e3:.2f} | {calls / steps:.0f} | {name} ({where}) |"
        )
    return "\n".join(lines)


def _plain_loop(dtype, profile, steps: int, warmup: int) -> float:
    """ms/step of halfprec's plain loop over ``steps`` steps, under ``profile`` when given."""
    import bench_train
    import torch

    model = bench_train.llama(0)
    step, _ = bench_train.halfprec_runner(model, dtype)
    data = bench_train.batches(8, 1024)
    for i in range(warmup):
        step(data[i % len(data)])
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    for i in range(steps):
        step(data[i % len(data)])
    torch.cuda.synchronize()
    if profile is not None:
        profile.disable()
    return (time.perf_counter() - start) / steps * 1e3


def _hf_phases(dtype, profile, steps: int, warmup: int, **hf) -> tuple[float, float, float]:
    """The HF Trainer's ms/step (synchronized at both ends) and the host's median ms inside a step (begin ->
    end) and between steps (end -> next begin), over ``steps`` steps, under ``profile`` when given (an object
    with ``enable()`` and ``disable()``); ``hf``: ``bench_train.hf_run``'s settings."""
    import types

    import bench_train
    import torch
    from transformers import TrainerCallback

    marks: list[tuple[str, float]] = []

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                torch.cuda.synchronize()
                if profile is not None:
                    profile.enable()
            marks.append(("begin", time.perf_counter()))

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(("end", time.perf_counter()))

        def on_train_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            marks.append(("begin", time.perf_counter()))  # the end of the last step's "between"
            if profile is not None:
                profile.disable()

    model = bench_train.llama(0)
    args = types.SimpleNamespace(warmup=warmup, steps=steps, batch=8)
    bench_train.hf_run(model, dtype, bench_train.batches(8, 1024), args, callbacks=[Phases()], **hf)
    timed = [t for _, t in marks[2 * warmup :]]  # begin, end, begin, end, ..., final
    inside = [b - a for a, b in zip(timed[0::2], timed[1::2], strict=False)]
    between = [b - a for a, b in zip(timed[1::2], timed[2::2], strict=False)]
    total = (timed[-1] - timed[0]) / steps * 1e3
    return total, statistics.median(inside) * 1e3, statistics.median(between) * 1e3


class _Timeline:
    """``torch.profiler`` with CUDA activity, as an ``enable()``/``disable()`` pair; ``summary()`` after it."""

    SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")

    def __init__(self, steps: int):
        import torch

        self.steps = steps
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def enable(self) -> None:
        self.prof.start()

    def disable(self) -> None:
        self.prof.stop()

    def summary(self) -> str:
        import json
        import tempfile
        from collections import Counter

        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            self.prof.export_chrome_trace(f.name)
            events = [e for e in json.loads(Path(f.name).read_text())["traceEvents"] if e.get("ph") == "X"]
        device = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        )
        busy, end = 0.0, float("-inf")
        for a, b in device:  # the union of the device's intervals
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        span = device[-1][1] - device[0][0]
        count, waited = Counter(), Counter()
        for e in events:
            if e.get("cat") == "cuda_runtime" and e["name"] in self.SYNCS:
                count[e["name"]] += 1
                waited[e["name"]] += e["dur"]
        syncs = ", ".join(
            f"{n} x{count[n] / self.steps:.1f} ({waited[n] / self.steps / 1e3:.2f} ms)" for n in sorted(count)
        )
        per = self.steps * 1e3
        return (
            f"GPU span {span / per:.1f} ms/step, busy {busy / per:.1f}, idle {(span - busy) / per:.1f}; "
            f"{len(device) / self.steps:.0f} device ops/step; host blocking calls per step: {syncs or 'none'}"
        )


class _SyncSites:
    """``set_sync_debug_mode("warn")`` as an ``enable()``/``disable()`` pair, counting each synchronizing call
    by the code that made it (the innermost five frames outside torch)."""

    def __init__(self, steps: int):
        from collections import Counter

        self.steps, self.sites, self._saved = steps, Counter(), None

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        import traceback

        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if f"site-packages{os.sep}torch{os.sep}" not in f.filename
            and os.path.basename(f.filename) != "warnings.py"
        ]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames[::-1][:5])
        self.sites[f"{str(message)[:40]}... at {where}"] += 1

    def enable(self) -> None:
        import warnings

        import torch

        self._saved = (warnings.showwarning, warnings.filters[:])
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")

    def disable(self) -> None:
        import warnings

        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning, warnings.filters[:] = self._saved

    def summary(self) -> str:
        rows = [f"  - {n / self.steps:.1f}/step: {site}" for site, n in self.sites.most_common()]
        return "\n".join(rows) or "  - none"


def timeline_table(steps: int = 10, warmup: int = 5) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    runs = (
        ("plain loop", lambda dtype, probe: _plain_loop(dtype, probe, steps, warmup)),
        ("hf", lambda dtype, probe: _hf_phases(dtype, probe, steps, warmup)[0]),
        (
            "hf-quiet",
            lambda dtype, probe: _hf_phases(dtype, probe, steps, warmup, nosync=True, nolink=True)[0],
        ),
    )
    for dtype in (torch.bfloat16, torch.float16):
        for name, run in runs:
            timeline = _Timeline(steps)
            ms = run(dtype, timeline)
            print(
                f"\n### {str(dtype)[6:]}, {name}: {ms:.1f} ms/step under the profiler\n{timeline.summary()}"
            )
            sites = _SyncSites(steps)
            run(dtype, sites)
            print(f"synchronizing calls (sync debug mode):\n{sites.summary()}", flush=True)
            torch.cuda.empty_cache()


def profile_table(steps: int = 15, warmup: int = 5) -> None:
    import cProfile

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype)[6:]
        plain = _plain_loop(dtype, None, steps, warmup)
        total, inside, between = _hf_phases(dtype, None, steps, warmup)
        print(
            f"\n### {name}, not profiled: plain loop {plain:.1f} ms/step; HF Trainer {total:.1f} ms/step, host "
            f"inside a step {inside:.1f} ms, between steps {between:.2f} ms (medians); both synchronized at the ends",
            flush=True,
        )
        profile = cProfile.Profile()
        plain = _plain_loop(dtype, profile, steps, warmup)
        print(
            f"\n### {name}, plain loop under cProfile: {plain:.1f} ms/step\n\n{_top(profile, steps)}",
            flush=True,
        )
        profile = cProfile.Profile()
        total, inside, between = _hf_phases(dtype, profile, steps, warmup)
        print(
            f"\n### {name}, HF Trainer under cProfile: {total:.1f} ms/step (inside {inside:.1f}, between "
            f"{between:.2f})\n\n{_top(profile, steps)}",
            flush=True,
        )
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hooks", action="store_true", help="the grad hooks' host cost per param (any machine)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="host time by function, halfprec's plain loop vs the HF Trainer",
    )
    parser.add_argument(
        "--timeline", action="store_true", help="GPU busy/idle time and host syncs, plain loop vs HF"
    )
    parser.add_argument(
        "--ops", action="store_true", help="the torch ops of one training step, on the CPU (any machine)"
    )
    args = parser.parse_args()
    if args.ops:
        op_count()
    elif args.timeline:
        timeline_table()
    elif args.profile:
        profile_table()
    elif args.hooks:
        hook_cost()
    else:
        gpu_table()


if __name__ == "__main__":
    main()
