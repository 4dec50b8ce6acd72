"""A small deterministic training run through the engine, shared by the engine and checkpoint tests.

Also run as a script in a fresh process: ``python -m tests.engine_util CKPT_DIR STEPS OUT [precision gas]``
loads the checkpoint, trains STEPS more steps and saves everything comparable to OUT.
"""

from __future__ import annotations

import sys
from dataclasses import asdict

import torch

import halfprec
from halfprec.checkpoint.directory import write_checkpoint
from halfprec.checkpoint.manifest import ENGINE
from halfprec.checkpoint.plain import rng_state


class TiedLM(torch.nn.Module):
    """Embedding tied to the output head, a LayerNorm with buffers-free params, an odd hidden size."""

    def __init__(self, vocab: int = 37, width: int = 24) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + torch.tanh(self.mix(h))
        return self.head(self.norm(h))


def build(precision: str = "fp16", gas: int = 1, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    kw = dict(precision=precision, gradient_accumulation_steps=gas, max_grad_norm=1.0)
    if precision == "fp16":
        kw.update(initial_scale=2.0**14, growth_interval=3)  # the scale changes within a few steps
    kw.update(overrides)
    return halfprec.initialize(model, opt, lr_scheduler=sched, **kw)


def batch(step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 37, (4, 9), generator=gen)


def train(engine, steps: int, *, inject_inf_at: tuple[int, ...] = ()) -> list[float]:
    """``steps`` optimizer steps; data depends on global_step only, so a resumed run sees the same batches."""
    losses = []
    device = next(engine.module.parameters()).device
    for _ in range(steps):
        step = engine.global_step
        for micro in range(engine.gradient_accumulation_steps):
            idx = batch(step, micro).to(device)
            logits = engine(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 37), idx[:, 1:].reshape(-1))
            loss = loss + 1e-3 * torch.randn(()).item() * 0  # consumes the torch RNG: resume must restore it
            engine.backward(loss)
            losses.append(loss.item())
        if step in inject_inf_at:
            engine.module.mix.weight.grad.view(-1)[0] = float("inf")
        engine.step()
    return losses


def snapshot(engine) -> dict:
    mp = engine.optimizer
    return {
        "weights": {k: v.clone() for k, v in engine.module.state_dict().items()},
        "masters": [m.detach().clone() for m in mp.master_params()],
        "state": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in mp.state[m].items()}
            for m in mp.master_params()
        ],
        "scaler": mp.loss_scaler.state_dict(),
        "counters": [engine.global_step, engine.micro_step, engine.skipped_steps],
        "lr": [g["lr"] for g in mp.param_groups],
        "sched": engine.lr_scheduler.state_dict()["last_epoch"],
        "rng": torch.get_rng_state(),
    }


def legacy_checkpoint(engine, directory, tag: str | None = None, *, client_state: dict | None = None):
    """What ``engine.save_checkpoint(directory, tag=tag)`` wrote in a single process before the optimizer moved
    to the reshardable format: layout ``engine``, the optimizer's state dict in ``optimizer.pt``, the RNG states
    in ``engine.pt``. For the tests that check that such checkpoints still load, or are refused, as before."""
    names = {p: n for n, p in engine.module.named_parameters()}
    engine_state = {
        "global_step": engine.global_step,
        "micro_step": engine.micro_step,
        "param_names": [names.get(p) for p in engine.optimizer.model_params()],
        "config": asdict(engine.config),
        "lr_scheduler": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
        "client_state": client_state or {},
        "rng": rng_state(),
    }
    info = {
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
        "precision": engine.config.precision,
        "loss_scale": engine.optimizer.loss_scale,
        "layout": ENGINE,
    }
    return write_checkpoint(
        directory,
        f"step-{engine.global_step}" if tag is None else tag,
        weights=engine.module.state_dict(),
        files={"optimizer": engine.optimizer.state_dict(), "engine": engine_state},
        info=info,
    )


def _main(argv: list[str]) -> None:
    ckpt_dir, steps, out = argv[0], int(argv[1]), argv[2]
    precision = argv[3] if len(argv) > 3 else "fp16"
    gas = int(argv[4]) if len(argv) > 4 else 1
    engine = build(precision, gas, seed=123)  # another seed: everything must come from the checkpoint
    engine.load_checkpoint(ckpt_dir)
    losses = train(engine, steps)
    torch.save({"losses": losses, **snapshot(engine)}, out)


if __name__ == "__main__":
    _main(sys.argv[1:])
