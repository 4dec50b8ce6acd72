"""Per-kernel GPU times of one fused AdamW step at 268M fp16 params (torch.profiler), to see where time goes."""

from __future__ import annotations

import torch

from halfprec.cli.bench_step import WORKLOADS, bench_fused_optimizer, bench_params


def main() -> None:
    params = bench_params(WORKLOADS["268M"], torch.float16)
    opt = bench_fused_optimizer("adamw", params)
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


if __name__ == "__main__":
    main()
