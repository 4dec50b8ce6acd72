"""``halfprec bench``: time one optimizer step (fused, generic torch path, plain torch pipeline) on the GPU,
print a table and write JSON. The measurement lives in ``halfprec.cli.bench_step``; this module maps argparse to it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--workload",
        default="268M",
        choices=["268M", "1B", "small"],
        help="param shapes: 268M = 16 x 4096x4096 + 16 x 4096 (default), 1B = 16 x 8192x8192 + ...",
    )
    add("--optimizers", default="adamw", help="comma list of adamw, sgd, adagrad, lamb (lamb: fused only)")
    add("--dtypes", default="float16", help="comma list of float16, bfloat16")
    add(
        "--impls",
        default="fused,torch,plain",
        help="comma list of fused, fused32 (fp32 grads), split (bf16), torch, plain",
    )
    add("--warmup", type=int, default=5, help="untimed steps first, for compilation and caches (default 5)")
    add("--iters", type=int, default=20, help="timed steps; the table gives their median (default 20)")
    add(
        "--json",
        type=Path,
        default="halfprec-bench.json",
        help="where the JSON results go (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    import torch  # `halfprec bench --help` stays light

    for name, low in (("warmup", 0), ("iters", 1)):
        if getattr(args, name) < low:
            print(f"halfprec bench: --{name} must be >= {low}, got {getattr(args, name)}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print(
            "halfprec bench: needs a CUDA device (it times GPU kernels); run it on a machine with one",
            file=sys.stderr,
        )
        return 2
    from .bench_step import format_table, run_bench

    lists = {name: getattr(args, name).split(",") for name in ("optimizers", "dtypes", "impls")}
    result = run_bench(workload=args.workload, warmup=args.warmup, iters=args.iters, **lists)
    print(format_table(result))
    args.json.write_text(json.dumps(result, indent=2))
    print(f"results written to {args.json}")
    return 0
