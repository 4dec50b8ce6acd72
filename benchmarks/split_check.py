"""Split masters against fp32 masters on a real model, on a CUDA device.

The demo's byte-level GPT (8 layers, width 512, 25M params) trains on the standard library's text with
``FusedAdamW(lr 1e-3, weight decay 0.1)`` and bf16 params, two ways:

1. Same grads: one model with fp32 masters computes each step's grads; a second optimizer with
   ``masters="split"`` over its own copy of the params gets the very same grads. After every step the fp32
   masters the split optimizer represents must equal the fp32-master optimizer's bit for bit; the bf16 params
   may differ only where a master's low half is exactly 0x8000 over an even top half (ties rounded away from zero
   instead of to even), counted.
2. Independent runs: each optimizer trains its own model on the same batches; the loss curves are printed side by
   side (the two models differ only through those ties).

    PYTHONPATH=src python benchmarks/split_check.py --steps 1000
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from halfprec.cli.demo_data import load_corpus
from halfprec.cli.demo_model import GPT, GPTConfig
from halfprec.optim import FusedAdamW
from halfprec.optim.split import split_master

HP = dict(lr=1e-3, weight_decay=0.1)


def build(cfg: GPTConfig, masters: str, seed: int, nudge: int = 0):
    torch.manual_seed(seed)
    model = GPT(cfg).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    with torch.no_grad():  # the control run: `nudge` random weights one bf16 ulp away
        for _ in range(nudge):
            p = list(model.parameters())[
                int(torch.randint(len(list(model.parameters())), (1,), generator=g, device="cuda"))
            ]
            i = int(torch.randint(p.numel(), (1,), generator=g, device="cuda"))
            p.view(-1)[i] *= 1 + 2.0**-7
    opt = FusedAdamW(model.parameters(), **HP, param_dtype=torch.bfloat16, masters=masters)
    return model, opt


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def ties(master: torch.Tensor) -> torch.Tensor:
    b = bits(master)
    return ((b & 0xFFFF) == 0x8000) & (((b >> 16) & 1) == 0)


def same_grads(cfg, corpus, args) -> None:
    ref_model, ref = build(cfg, "fp32", args.seed)
    split_model, split = build(cfg, "split", args.seed)
    ref_params, split_params = list(ref_model.parameters()), list(split_model.parameters())
    differ_masters = param_ties = 0
    for step in range(args.steps):
        x, y = (
            t.cuda()
            for t in corpus.batch("train", step=step, batch_size=args.batch, seq_len=cfg.seq_len, seed=0)
        )
        loss_of(ref_model, x, y).backward()
        for p, q in zip(split_params, ref_params, strict=True):
            p.grad = q.grad.clone()
        ref.step()
        split.step()
        ref.zero_grad()
        split.zero_grad()
        for m, r, p, q in zip(
            split.master_params(), ref.master_params(), split_params, ref_params, strict=True
        ):
            differ_masters += int((bits(m) != bits(r)).sum())
            if step == args.steps - 1:
                where = bits(p) != bits(q)
                assert torch.equal(where, ties(r).view(where.shape)), "a param differs outside a tie"
                param_ties += int(where.sum())
        if (step + 1) % args.every == 0:
            print(f"same grads: step {step + 1}: masters differing so far {differ_masters}", flush=True)
    n = sum(p.numel() for p in ref_params)
    print(
        f"same grads, {args.steps} AdamW steps, {n:,} params: masters differing (summed over steps) "
        f"{differ_masters}; bf16 params differing after the last step {param_ties} (all ties)"
    )


def train(cfg, corpus, args, masters: str, seed: int, *, nudge: int = 0, away: bool = False) -> list[float]:
    """One run's per-step train losses; ``away``: fp32 masters whose bf16 params are rounded ties away from zero at
    construction and after every step (what split masters keep), the control split masters must equal bit for bit."""
    model, opt = build(cfg, masters, seed, nudge)

    def round_away() -> None:
        with torch.no_grad():
            for p, m in zip(opt.model_params(), opt.master_params(), strict=True):
                p.copy_(split_master(m.float())[0].view(p.shape))

    if away:
        round_away()
    losses = []
    for step in range(args.steps):
        x, y = (
            t.cuda()
            for t in corpus.batch("train", step=step, batch_size=args.batch, seq_len=cfg.seq_len, seed=seed)
        )
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if away:
            round_away()
        losses.append(loss.detach())
    return [v.item() for v in losses]


def curves(cfg, corpus, args) -> None:
    torch.use_deterministic_algorithms(True)  # CUBLAS_WORKSPACE_CONFIG=:4096:8 is set by main()
    for seed in range(args.seeds):
        recipes = {
            "fp32": dict(masters="fp32"),
            "fp32-again": dict(masters="fp32"),
            "split": dict(masters="split"),
            "fp32-ties-away": dict(masters="fp32", away=True),
            "fp32-nudged": dict(masters="fp32", nudge=args.nudge),
        }
        runs = {name: train(cfg, corpus, args, seed=seed, **recipes[name]) for name in args.runs.split(",")}
        names = list(runs)
        print(f"seed {seed}: mean train loss over each window of steps")
        print("| steps | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for end in range(args.every, args.steps + 1, args.every):
            row = [sum(runs[m][end - args.every : end]) / args.every for m in names]
            print(f"| {end - args.every + 1}-{end} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
        for a, b in (("fp32", "fp32-again"), ("split", "fp32-ties-away"), ("fp32", "split")):
            if a not in runs or b not in runs:
                continue
            equal = sum(x == y for x, y in zip(runs[a], runs[b], strict=True))
            print(f"seed {seed}: {b} vs {a}: loss bit-equal at {equal} of {args.steps} steps")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nudge", type=int, default=200, help="weights nudged in the control run")
    parser.add_argument("--parts", default="same,curves")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--runs",
        default="fp32,fp32-again,split,fp32-ties-away,fp32-nudged",
        help="fp32-ties-away: fp32 masters whose params are rounded as split masters round them; fp32-nudged: "
        "--nudge weights one bf16 ulp off at the start",
    )
    args = parser.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cfg = GPTConfig(seq_len=256, n_layer=8, n_head=8, n_embd=512)
    corpus = load_corpus()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    t0 = time.perf_counter()
    if "same" in args.parts:
        same_grads(cfg, corpus, args)
    if "curves" in args.parts:
        curves(cfg, corpus, args)
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
