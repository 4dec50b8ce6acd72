"""One rank of the raised-backward scenario (``_worker.py raised``): a backward that raises part-way, caught, then
training goes on. Each schedule runs twice on fresh, identical models: once with the backward that raises, once
with the oracle's actions; the test compares the two runs' weights, masters and state bit for bit.

``Chain``: six ``Linear(6, 6)``; with ``bucket_size=42`` each is one bucket of the sharded layout, in backward
order, and ``unused`` (no grad, ever) is the last bucket. A cut before layer 2 raises in backward (or, for the
oracle, detaches there) after layers 5..2 got their grads: at stages 1 and 2 their four buckets were launched
(stage 2 waits two of them: ``_MAX_IN_FLIGHT``), layers 1 and 0 and ``unused`` got nothing.

Actions: ``full`` (a backward of the whole loss), ``raise`` (the cut raises; the error is caught), ``partial``
(the loss with the cut detached: what a raised backward produced), ``_ns`` (inside ``no_sync()``), ``step``,
``zero`` (``zero_grad()``). A ``full`` backward's data depends on the steps taken so far only, so a schedule and
its oracle see the same batches even where the oracle leaves actions out.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from _worker import RANK, WORLD, pieces

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer

BODY = ["full", "step", "zero"] * 2
# name: (schedule, oracle). The contract: a raised backward keeps the grads it produced (those of "partial"),
# zero_grad() drops them, the next backward adds to them and a step applies them, as in torch.
SCHEDULES = {
    "zero_grad": (["raise", "zero", *BODY], BODY),
    "add": (["raise", *BODY], ["partial", *BODY]),
    "step": (["raise", "step", "zero", *BODY], ["partial", "step", "zero", *BODY]),
    "twice": (["raise", "raise", *BODY], ["partial", "partial", *BODY]),
}
# stage 1 and fp32 accumulation: a raise inside no_sync() (nothing is reduced there)
NO_SYNC = {
    "no_sync_zero_grad": (["raise_ns", "zero", *BODY], BODY),
    "no_sync_add": (["raise_ns", *BODY], ["partial_ns", *BODY]),
}


class Boom(RuntimeError):
    """What ``_Raise`` throws in backward (an OOM, a failing hook)."""


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("backward raised on purpose")


class Chain(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.unused = torch.nn.Parameter(torch.randn(5, generator=g))  # first: the last bucket of the layout
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(6))
        with torch.no_grad():
            for p in self.layers.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.to(dtype)

    def loss(self, seed: int, cut: str | None) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
        h = x.to(self.unused.dtype)
        for k, layer in enumerate(self.layers):
            if k == 2 and cut is not None:
                h = _Raise.apply(h) if cut == "raise" else h.detach()
            h = torch.tanh(layer(h))
        return torch.nn.functional.mse_loss(h.float(), y)


def _build(cfg: dict):
    model = Chain(torch.float16)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    scaler = halfprec.DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=1)
    accum = "fp32" if cfg["accumulate"] else "param"
    if cfg["kind"] == "sharded":
        opt = ShardedMixedPrecisionOptimizer(
            inner, named_parameters=model, stage=cfg["stage"], loss_scaler=scaler, reduce_dtype=cfg["reduce"],
            bucket_size=42, impl=cfg["impl"], grad_accum_dtype=accum,
        )  # fmt: skip
    else:  # ZeRO-0 with a group (fp32 sums all-reduced at the step), or no group at all
        group = dist.group.WORLD if cfg["kind"] == "zero0" else None
        opt = halfprec.MixedPrecisionOptimizer(
            inner, loss_scaler=scaler, impl=cfg["impl"], grad_accum_dtype=accum, process_group=group
        )
    return model, opt


def _run(cfg: dict, actions: list[str]) -> dict:
    model, opt = _build(cfg)
    steps, raised = 0, 0
    for action in actions:
        name, _, ns = action.partition("_")
        if name == "step":
            opt.step()
            steps += 1
        elif name == "zero":
            opt.zero_grad()
        else:
            seed = 1000 * steps + RANK + (0 if name == "full" else 500)
            with opt.no_sync() if ns else contextlib.nullcontext():
                try:
                    opt.backward(model.loss(seed, None if name == "full" else name))
                except Boom:
                    raised += 1
    return {"raised": raised, "state": _snapshot(model, opt)}


def _snapshot(model: Chain, opt) -> dict:
    """Weights, masters and optimizer state as one flat dict of tensors."""
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    if isinstance(opt, ShardedMixedPrecisionOptimizer):
        for name, pc in pieces(opt).items():
            out[f"master {name}"] = pc["master"]
            out.update({f"state {name}.{k}": v for k, v in pc["state"].items()})
        return out
    for name, m in zip([n for n, _ in model.named_parameters()], opt.master_params(), strict=True):
        out[f"master {name}"] = m.detach().clone()
        out.update({f"state {name}.{k}": v.clone() for k, v in opt.state.get(m, {}).items()})
    return out


def configs(world: int) -> list[dict]:
    """Stages 1 and 2 (reduce_dtype fp32 and param, or fp32 accumulation), ZeRO-0 with a group, and at world
    size 1 the unsharded optimizer without one; each with the exact and the fused local step."""
    out = []
    for impl in ("torch", "triton"):
        for stage in (1, 2):
            for reduce, accumulate in (("fp32", False), ("param", False), ("fp32", True)):
                out.append(dict(kind="sharded", stage=stage, reduce=reduce, accumulate=accumulate, impl=impl))
        out.append(dict(kind="zero0", accumulate=True, impl=impl))
        if world == 1:
            out += [dict(kind="plain", accumulate=a, impl=impl) for a in (False, True)]
    return out


def schedules(cfg: dict) -> dict:
    """``SCHEDULES``, and ``NO_SYNC`` where the sharded optimizer has ``no_sync()``."""
    whole = cfg["kind"] == "sharded" and (cfg["stage"] == 1 or cfg["accumulate"])
    return {**SCHEDULES, **(NO_SYNC if whole else {})}


def label(cfg: dict) -> str:
    where = f"stage{cfg['stage']}-{cfg['reduce']}" if cfg["kind"] == "sharded" else cfg["kind"]
    return f"{where}{'-acc32' if cfg['accumulate'] else ''}-{cfg['impl']}"


def scenario_raised(out: str) -> dict:
    res: dict = {}
    for cfg in configs(WORLD):
        oracles: dict = {}
        runs = {}
        for name, (actions, oracle) in schedules(cfg).items():
            key = " ".join(oracle)
            if key not in oracles:
                oracles[key] = _run(cfg, oracle)
            runs[name] = {"actions": actions, "got": _run(cfg, actions), "want": oracles[key]}
        res[label(cfg)] = runs
    return res
