"""The precision effect of fp32 gradient accumulation on a real run, on a CUDA device.

The demo's byte-level GPT (8 layers, width 512, 25M params) trains on the standard library's text through
``halfprec.initialize`` with AdamW (lr 6e-4, weight decay 0.1, clipping 1.0) and 16 micro-batches per step, three
ways: bf16 with the micro-batch grads summed in the 16-bit ``.grad`` (``grad_accum_dtype="param"``), bf16 summed in
fp32 (``"fp32"``), and an fp32 reference (``precision="fp32"``). Every run sees the same micro-batches, with
``torch.use_deterministic_algorithms(True)``. Printed: the mean train loss per window of steps and the validation
loss at the end.

    PYTHONPATH=src python benchmarks/accum_curve.py --steps 150
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

import halfprec
from halfprec.cli.demo_data import load_corpus
from halfprec.cli.demo_model import GPT, GPTConfig

RUNS = {
    "bf16, 16-bit accumulation": dict(precision="bf16", grad_accum_dtype="param"),
    "bf16, fp32 accumulation": dict(precision="bf16", grad_accum_dtype="fp32"),
    "fp32 reference": dict(precision="fp32"),
}


def loss_of(model, x, y) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))


def train(cfg, corpus, args, options) -> tuple[list[float], float]:
    torch.manual_seed(args.seed)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    engine = halfprec.initialize(
        model, opt, gradient_accumulation_steps=args.accum, max_grad_norm=1.0, **options
    )
    losses = []
    for step in range(args.steps):
        total = torch.zeros((), device="cuda")
        for micro in range(args.accum):
            x, y = (
                t.cuda()
                for t in corpus.batch(
                    "train",
                    step=step * args.accum + micro,
                    batch_size=args.batch,
                    seq_len=cfg.seq_len,
                    seed=0,
                )
            )
            loss = loss_of(engine.module, x, y)
            engine.backward(loss)
            engine.step()  # acts at the accumulation boundary only
            total += loss.detach()
        losses.append(total / args.accum)
    with torch.no_grad():
        val = torch.stack(
            [
                loss_of(
                    engine.module,
                    *(
                        t.cuda()
                        for t in corpus.batch("val", step=k, batch_size=32, seq_len=cfg.seq_len, seed=0)
                    ),
                )
                for k in range(8)
            ]
        ).mean()
    return [v.item() for v in losses], val.item()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--accum", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    cfg = GPTConfig(seq_len=256, n_layer=8, n_head=8, n_embd=512)
    corpus = load_corpus()
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.accum} micro-batches of {args.batch}"
    )
    t0 = time.perf_counter()
    results = {name: train(cfg, corpus, args, options) for name, options in RUNS.items()}
    names = list(results)
    print("| steps | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for end in range(args.every, args.steps + 1, args.every):
        row = [sum(results[m][0][end - args.every : end]) / args.every for m in names]
        print(f"| {end - args.every + 1}-{end} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
    print("| val | " + " | ".join(f"{results[m][1]:.4f}" for m in names) + " |")
    print(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
