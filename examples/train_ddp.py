"""Data-parallel mixed-precision training with halfprec: ZeRO-0 (DDP), ZeRO-1 or ZeRO-2.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --zero 1            # CPU, gloo
    torchrun --standalone --nproc-per-node 8 examples/train_ddp.py --zero 2 --fp16     # GPUs, NCCL

A small MLP regression on synthetic data; each rank draws its own micro-batches. ``--ckpt DIR`` keeps
reshardable checkpoints in DIR, one per run, named by the optimizer step reached (``DIR/step-50``): a run resumes
from the newest one there (at any world size and stage), trains ``--steps`` more and saves ``DIR/step-<reached>``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer, checkpoint


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--zero",
        type=int,
        default=1,
        choices=(0, 1, 2),
        help="0: DDP; 1: shard optimizer state; 2: and grads",
    )
    ap.add_argument(
        "--fp16", action="store_true", help="fp16 weights with dynamic loss scaling (default bf16)"
    )
    ap.add_argument("--steps", type=int, default=50, help="optimizer steps to train in this run")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--width", type=int, default=256, help="hidden width of the MLP")
    ap.add_argument(
        "--ckpt",
        default=None,
        help="folder of step-N checkpoints: resume from the newest, save step-<reached>",
    )
    return ap.parse_args()


def newest_checkpoint(folder: str | None) -> tuple[str | None, int]:
    """``(path, step)`` of the ``step-N`` checkpoint with the largest N in ``folder``, or ``(None, 0)``."""
    found = []
    if folder and os.path.isdir(folder):
        for name in os.listdir(folder):
            m = re.fullmatch(r"step-(\d+)", name)
            # a save that did not finish has no .metadata (it is written last): not a checkpoint
            if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
                found.append((int(m.group(1)), os.path.join(folder, name)))
    if not found:
        return None, 0
    step, path = max(found)
    return path, step


@record
def main() -> None:
    args = parse()
    dist.init_process_group(backend=None)  # "cpu:gloo,cuda:nccl"
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width),
        torch.nn.GELU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.GELU(),
        torch.nn.Linear(args.width, 1),
    ).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    if args.zero == 0:
        # ZeRO-0: every rank holds everything; DDP averages the grads, so an overflow on one rank is an inf on
        # every rank and all of them skip the same step
        opt = halfprec.MixedPrecisionOptimizer(inner, param_dtype=dtype, max_grad_norm=1.0)
        net = torch.nn.parallel.DistributedDataParallel(model)
        no_sync = net.no_sync
    else:
        opt = ShardedMixedPrecisionOptimizer(
            inner, named_parameters=model, stage=args.zero, param_dtype=dtype, max_grad_norm=1.0
        )
        net = model
        # stage 1 accumulates locally inside no_sync(); stage 2 reduces every micro-batch anyway
        no_sync = opt.no_sync if args.zero == 1 else contextlib.nullcontext

    # The step count lives in the checkpoint's name: the optimizer's counters do not hold it (a skipped step
    # advances no optimizer counter), and the name is what a user lists.
    resume_path, start = newest_checkpoint(args.ckpt)
    if resume_path is not None:
        checkpoint.load(opt, resume_path, named_parameters=model)
        if rank == 0:
            print(f"resumed from {resume_path} (step {start})")

    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(start, start + args.steps):
        # each rank its own data; step N's batches are the same whether the run was resumed or not
        g = torch.Generator().manual_seed(1234 + 100_003 * step + rank)
        for micro in range(args.accum):
            x = torch.randn(64, 32, generator=g)
            y = x @ w_true
            ctx = no_sync() if micro < args.accum - 1 else contextlib.nullcontext()
            with ctx:  # DDP decides in forward whether to reduce: run forward inside the context too
                loss = F.mse_loss(net(x.to(device, dtype)).float(), y.to(device)) / args.accum
                opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == start + args.steps - 1):
            skipped = " (skipped)" if opt.step_was_skipped else ""
            print(
                f"step {step:4d} loss {loss.item() * args.accum:.5f} grad_norm {opt.grad_norm:.4f} "
                f"scale {opt.loss_scale:g}{skipped}"
            )

    if args.ckpt:
        path = os.path.join(args.ckpt, f"step-{start + args.steps}")  # named by the step reached
        checkpoint.save(opt, path, named_parameters=model)
        if rank == 0:
            print(f"saved {path} (world size {world}; loads at any world size)")
    dist.barrier()  # no rank tears its connections down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
