"""Where one fused AdamW step at 268M params spends its time (torch.profiler, CUDA).

    python benchmarks/profile_step.py [--dtype float16|bfloat16] [--masters fp32|split] [--as-called]

Default: the GPU time of each kernel over 10 steps, grads written once and marked (``opt.mark_grads()``), as
``halfprec bench`` times the step alone. ``--as-called``: the host's side of ``step()`` as a training loop calls it
(``zero_grad()``, a real backward, a synchronize, then ``step()``, as ``time_as_users_call`` times it): the median
host time in ``step()`` without the profiler, then per step the host time of every op and CUDA runtime call made
inside ``step()`` (self time, so nothing is counted twice; the self time of the ``Optimizer.step#...`` range,
which ``step()`` opens under a profiler, and the rest are Python), then cProfile's table of the Python functions
``step()`` runs (time per step). On a synchronized device whatever ``step()`` does before its first launch (a graph
replay: the norm pass, or all three kernels) is time the GPU waits.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
from collections import defaultdict

import torch

from halfprec.cli.bench_step import (
    WORKLOADS,
    bench_fused_optimizer,
    bench_params,
    time_as_users_call,
    users_backward,
)

_RANGE = "halfprec.step"  # the profiler range around each step() in --as-called


def kernel_times(opt) -> None:
    """The GPU time of each kernel over 10 steps of grads written once (the default mode)."""
    for _ in range(5):
        opt.mark_grads()  # the bench's grads are written once, not by a backward: count them as each step's
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            opt.mark_grads()
            opt.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def steps_as_called(opt, params, grads, steps: int, around) -> None:
    """``steps`` steps as a loop calls them (a real backward, a synchronize), each ``step()`` inside ``around()``."""
    for _ in range(steps):
        users_backward(opt, params, grads)
        torch.cuda.synchronize()
        with around():
            opt.step()
        torch.cuda.synchronize()


def host_as_called(opt, params, grads, steps: int = 20) -> None:
    """The host's side of ``step()`` as a loop calls it (``--as-called``; module docstring)."""
    for _ in range(3):  # fp16: the dynamic scale backs off from its initial overflow
        users_backward(opt, params, grads)
        opt.step()
    _, host_ms = time_as_users_call(opt, params, grads, warmup=5, iters=30)
    print(f"host time in step() as called, no profiler: median {host_ms * 1e3:.1f} us (30 steps)")
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[cpu, cuda]) as prof:
        steps_as_called(opt, params, grads, steps, around=lambda: torch.profiler.record_function(_RANGE))
    events = prof.events()
    cpu_side = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    # the CPU range only: with CUDA activity the profiler also shows the range on the GPU's timeline
    ranges = [(e.time_range.start, e.time_range.end) for e in cpu_side if e.name == _RANGE]
    inside: dict[str, list[float]] = defaultdict(list)
    for e in cpu_side:
        if e.name == _RANGE:
            continue
        if any(start <= e.time_range.start and e.time_range.end <= end for start, end in ranges):
            inside[e.name].append(e.self_cpu_time_total)
    total = statistics.mean(end - start for start, end in ranges)
    rows = sorted(
        ((sum(v) / len(ranges), len(v) / len(ranges), name) for name, v in inside.items()), reverse=True
    )
    print(f"under the profiler: {total:.1f} us per step() ({len(ranges)} steps); self time per step:")
    print(f"{'us':>8} {'calls':>6}  op or CUDA runtime call")
    shown = 25
    for us, calls, name in rows[:shown]:
        print(f"{us:8.1f} {calls:6.1f}  {name[:90]}")
    print(
        f"{sum(us for us, _, _ in rows[shown:]):8.1f}         {max(len(rows) - shown, 0)} other ops and calls"
    )
    print(f"{total - sum(us for us, _, _ in rows):8.1f}         outside any op: Python")
    python_functions(opt, params, grads, steps)


def python_functions(opt, params, grads, steps: int) -> None:
    """cProfile over ``step()`` alone: the functions with the most own time, per step (cProfile slows Python
    down, so compare the rows, not the sum, with the host time above)."""
    profiler = cProfile.Profile()
    steps_as_called(opt, params, grads, steps, around=lambda: profiler)  # enabled inside each step() only
    stats = pstats.Stats(profiler)
    print(
        f"cProfile, {steps} steps: {stats.total_tt / steps * 1e6:.1f} us per step() under it; own time per step:"
    )
    print(f"{'us':>8} {'calls':>6}  function")
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)  # (file, line, name): stats
    for (file, line, name), (_, calls, own, _, _) in rows[:30]:
        where = "/".join(file.rsplit("/", 2)[-2:]) + f":{line}"  # a builtin's file is "~", its line 0
        print(f"{own / steps * 1e6:8.1f} {calls / steps:6.1f}  {name} ({where})"[:110])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--masters", choices=("fp32", "split"), default="fp32")
    parser.add_argument(
        "--as-called", action="store_true", help="the host's side of step() (module docstring)"
    )
    args = parser.parse_args()
    if args.masters == "split" and args.dtype != "bfloat16":
        parser.error("--masters split: bf16 params only (--dtype bfloat16)")
    params = bench_params(WORKLOADS["268M"], getattr(torch, args.dtype))
    opt = bench_fused_optimizer("adamw", params, masters=args.masters)
    if args.as_called:
        host_as_called(opt, params, [p.grad.clone() for p in params])
    else:
        kernel_times(opt)


if __name__ == "__main__":
    main()
