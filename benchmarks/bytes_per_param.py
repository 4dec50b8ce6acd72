"""Allocated bytes per param of the fused AdamW, by master storage and grad accumulation dtype, on a CUDA device.

For each configuration: ``torch.cuda.memory_allocated()`` above the baseline, divided by the param count, (a) after
the first backward-like grads and ``step()`` (grads still held) and (b) after ``zero_grad()`` (the flat grad buffer
released). Workload: the bench's 268M shapes (16 x 4096x4096 + 16 x 4096), bf16 params.

    PYTHONPATH=src python benchmarks/bytes_per_param.py
"""

from __future__ import annotations

import gc

import torch

from halfprec.cli.bench_step import WORKLOADS
from halfprec.optim import FusedAdamW

CONFIGS = [
    ("fp32 masters, 16-bit grads", dict(masters="fp32")),
    ("fp32 masters, fp32 grads", dict(masters="fp32", grad_accum_dtype="fp32")),
    ("split masters, 16-bit grads", dict(masters="split")),
    ("split masters, fp32 grads", dict(masters="split", grad_accum_dtype="fp32")),
]


def measure(options) -> tuple[float, float]:
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    params = [
        torch.nn.Parameter(torch.zeros(s, device="cuda", dtype=torch.bfloat16)) for s in WORKLOADS["268M"]
    ]
    n = sum(p.numel() for p in params)
    opt = FusedAdamW(params, lr=1e-4, weight_decay=0.1, **options)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
        opt.mark_grads()  # what backward's hook does for each param as its grad arrives
    opt.step()
    torch.cuda.synchronize()
    held = (torch.cuda.memory_allocated() - base) / n
    opt.zero_grad()
    torch.cuda.synchronize()
    released = (torch.cuda.memory_allocated() - base) / n
    return held, released


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16 AdamW, 268M params")
    print("| configuration | B/param after step (grads held) | B/param after zero_grad |")
    print("|---|---|---|")
    for name, options in CONFIGS:
        try:
            held, released = measure(options)
        except ValueError as e:
            print(f"| {name} | refused: {e} | |")
            continue
        print(f"| {name} | {held:.3f} | {released:.3f} |")


if __name__ == "__main__":
    main()
