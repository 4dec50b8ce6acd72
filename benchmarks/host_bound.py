"""Is a training step host-bound? The host's enqueue time per step against the GPU's, and halfprec's grad-hook
cost per param on the host.

    python benchmarks/host_bound.py            # on a CUDA machine: bench_train's Llama under halfprec and autocast
    python benchmarks/host_bound.py --hooks    # anywhere: a fused optimizer's post-accumulate-grad hooks, per param

For each system and dtype: 5 warm-up steps, then 15 steps timed by CUDA events (the GPU timeline, idle gaps
included) and by the host's time to enqueue each step, then 8 steps each between two ``synchronize()``. When the
enqueue time matches the event time, the host sets the pace: the GPU waits for launches, and the host's speed (on
a shared machine, its neighbours') moves the step time. ``--hooks`` times the backward of a 148-param fp16 MLP
with tiny layers (kernel time negligible) with and without a fused optimizer's grad hooks, on the CPU (the Triton
interpreter is imported but runs no kernel in a backward), after ``zero_grad(set_to_none=True)`` and ``False``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


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
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from halfprec.optim import FusedAdamW

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(74)]).half()

    def backward_ms(model, set_to_none: bool, opt=None) -> float:
        x, times = torch.randn(4, 8).half(), []
        for _ in range(rounds):
            loss = model(x).float().square().mean()
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
        print(f"{n} params, zero_grad(set_to_none={set_to_none}): backward {a:.2f} ms plain, {b:.2f} ms with a "
              f"fused optimizer's grad hooks: {(b - a) / n * 1e3:.1f} us per param", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--hooks", action="store_true", help="the grad hooks' host cost per param (any machine)"
    )
    args = parser.parse_args()
    if args.hooks:
        hook_cost()
    else:
        gpu_table()


if __name__ == "__main__":
    main()
