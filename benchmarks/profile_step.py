"""Per-kernel GPU times of one fused AdamW step at 268M fp16 params (torch.profiler), to see where time goes."""

from __future__ import annotations

import torch

from halfprec.cli.bench_step import WORKLOADS, _fused_opt, _params


def main() -> None:
    params = _params(WORKLOADS["268M"], torch.float16)
    opt = _fused_opt("adamw", params)
    for _ in range(5):
        opt._flags.fill_(1)
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            opt._flags.fill_(1)
            opt.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
