"""ZeRO-0 / 1 / 2 per-rank cost: optimizer-step time, backward (with grad communication), pure comm time, memory.

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_distributed.py --layers 16 --width 4096
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --layers 2 --width 512   # CPU smoke

Model: ``layers`` x Linear(width, width) (+ bias), bf16 (``--fp16`` for fp16), AdamW wrapped by halfprec.
ZeRO-0 is MixedPrecisionOptimizer + DDP. Columns (rank 0's timings, the max over ranks for memory):

* ``step ms``: ``opt.step()`` (for ZeRO-1/2 includes the param all-gather);
* ``bwd ms``: backward of a tiny batch, which for every variant includes the grad reduction;
* ``comm ms``: the bare collectives on a buffer of the model's size (all-reduce for ZeRO-0; reduce-scatter
  + all-gather for ZeRO-1/2) in the reduce dtype;
* ``held B/param``: bytes held by params, grads, masters, master grads and optimizer state, per param;
* ``local step``: ``torch`` (the wrapped torch AdamW on the pieces) or ``triton`` (the fused update kernel
  over the flat local buffers, ``impl="triton"``);
* ``model B/param``: 2 (param) + 2 (grad) + 12 (master, m, v) + 4 (fp32 master grads) at ZeRO-0; 2 + 2 + 16/d
  at stage 1; 2 + 16/d at stage 2: the fp32 grad shard (4/d) is kept on both local-step paths (the
  reduce-scatter sums into it in fp32), so the fused path's figure is the same. Bucket buffers are not counted;
* ``peak B/param``: ``torch.cuda.max_memory_allocated`` over a step, per param (GPU only).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer

_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters: int) -> float:
    fn()
    _sync(device)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters * 1e3


def _held_bytes(opt, model) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for group in opt.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
            for v in opt.state.get(p, {}).values():
                add(v)
    for name in ("flat_master",):
        add(getattr(opt, name, None))
    reducer = getattr(opt, "_reducer", None)
    if reducer is not None:
        add(reducer.flat_grad)
        add(reducer.grad_shard)
    for chunk in getattr(getattr(opt, "_store", None), "chunks", []):
        add(chunk.data)
        add(chunk.grad)
    return total


def run(zero: int, impl: str, args, device, dtype) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(
        device
    )
    n = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if zero == 0:
        opt = halfprec.MixedPrecisionOptimizer(inner, param_dtype=dtype, max_grad_norm=1.0, impl="torch")
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        opt = ShardedMixedPrecisionOptimizer(
            inner,
            named_parameters=model,
            stage=zero,
            param_dtype=dtype,
            max_grad_norm=1.0,
            reduce_dtype=args.reduce,
            impl=impl,
        )
        net = model
    x = torch.randn(8, args.width, device=device, dtype=dtype)

    def backward():
        opt.zero_grad()
        opt.backward(net(x).float().square().mean())

    backward()
    opt.step()  # state allocated
    bwd = _time(backward, device, args.iters)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms = 0.0
    for _ in range(args.iters):  # backward outside the timed region, each step timed alone
        backward()
        _sync(device)
        dist.barrier()
        t = time.perf_counter()
        opt.step()
        _sync(device)
        step_ms += (time.perf_counter() - t) * 1e3 / args.iters
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    held = _held_bytes(opt, model)

    world = dist.get_world_size()
    comm_dtype = torch.float32 if (zero > 0 and args.reduce == "fp32") else dtype
    buf = torch.zeros(n + (-n) % world, device=device, dtype=comm_dtype)
    out = torch.empty(buf.numel() // world, device=device, dtype=comm_dtype)
    params = torch.zeros(buf.numel(), device=device, dtype=dtype)
    if zero == 0:
        comm = _time(lambda: dist.all_reduce(buf), device, args.iters)
    else:
        comm = _time(lambda: (_rs(out, buf), _ag(params, params[: out.numel()])), device, args.iters)
    d = world
    model_bytes = {0: 2 + 2 + 12 + 4, 1: 2 + 2 + 16 / d, 2: 2 + 16 / d}[zero]
    stats = torch.tensor([held / n, peak / n if peak == peak else -1.0], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {
        "zero": zero,
        "impl": impl,
        "params": n,
        "step": step_ms,
        "bwd": bwd,
        "comm": comm,
        "held": stats[0].item(),
        "model": model_bytes,
        "peak": stats[1].item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--reduce", default="fp32", choices=("fp32", "param"))
    ap.add_argument("--zero", default="0,1,2")
    ap.add_argument("--impls", default="torch,triton", help="local step of ZeRO-1/2 (ZeRO-0 runs torch only)")
    args = ap.parse_args()
    dist.init_process_group(backend=None)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    rows = []
    for z in args.zero.split(","):
        for impl in ["torch"] if z == "0" else args.impls.split(","):
            rows.append(run(int(z), impl, args, device, dtype))
            gc.collect()  # the previous variant's buffers must not count in the next one's peak
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(
            f"world size {world}, {rows[0]['params'] / 1e6:.1f}M params, {dtype}, reduce {args.reduce}, "
            f"{device.type}, torch {torch.__version__}"
        )
        print(
            "| ZeRO | local step | step ms | bwd ms | comm ms | held B/param | model B/param | peak B/param |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            peak = "n/a" if r["peak"] < 0 else f"{r['peak']:.2f}"
            print(
                f"| {r['zero']} | {r['impl']} | {r['step']:.2f} | {r['bwd']:.2f} | {r['comm']:.2f} | {r['held']:.2f} | "
                f"{r['model']:.2f} | {peak} |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
