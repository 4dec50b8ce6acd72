"""One rank of the grad-source scenarios (``_worker.py grads``): grads that reach a ZeRO-1/2 step other than as one
hook call per param per backward, against a plain fp32 torch optimizer fed the mean grad.

``twice``: ``Shared`` applies one Linear twice, each application under reentrant activation checkpointing, so the
shared params' grad hooks fire twice in one backward (once per inner backward). With ``bucket_size=40`` every param
is a bucket of its own: the shared params' buckets are complete, and launched, after their first firing, and the
second firing is a contribution that arrives after its bucket's reduction started. With the default bucket size
one bucket holds everything.

``edits``: grads changed by hand between the last backward and the step: assigned to ``.grad`` (on every rank or on
rank 0 only; to a param the backward reached or one it did not), zeroed in place, set to None, or left alone (the
fast path: its step must run no collective beyond the usual ones).

Oracle: this rank computes every rank's grads on a plain 16-bit copy of the model whose hooks record each firing's
contribution, and combines them as the configuration does. 16-bit accumulation adds a rank's contributions in 16
bits (stage 1: all of the step's; stage 2: each backward's, reduced separately); fp32 accumulation adds each in
fp32. With ``reduce="param"`` each rank's value is divided by 2 and the two are added in 16 bits. (Stage 2, 16-bit, a bucket per param: the first backward's second hook calls are reduced apart, see
``_units``.) The hand edits act on what ``.grad`` shows after backward: the 16-bit whole grads at stage 1 (replaced,
zeroed, dropped), nothing at stage 2 or with fp32 accumulation, whose hooks release ``.grad`` (an assigned grad is
then added, as the unsharded fp32 accumulation adds it). Each reduction adds the ranks' fp32 values, the step adds
the reductions in fp32 and divides by 2.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.nn.functional as F
from _worker import RANK, WORLD, pieces
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer

LR, MOMENTUM = 0.5, 0.9
BIG = 2**23  # the default bucket size: one bucket


# --- models ------------------------------------------------------------------------------------------------
class Shared(torch.nn.Module):
    """``shared`` applied twice, each time under reentrant checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.inp = torch.nn.Linear(8, 16)
        self.shared = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(self.block, h, use_reentrant=True)
        return self.out(h)


class Pair(torch.nn.Module):
    """``b`` after ``a``, or (``use_b=False``) left out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h)) if use_b else h


def _loss(model: torch.nn.Module, step: int, rank: int, micro: int, use_b: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if isinstance(model, Shared):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        return F.mse_loss(model(x.bfloat16()).float(), y)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    return F.mse_loss(model(x.bfloat16(), use_b).float(), y)


def _assigned(rank: int, shape: torch.Size) -> torch.Tensor:
    """What rank ``rank`` assigns to ``.grad`` by hand (exact in bf16)."""
    return (torch.randn(shape, generator=torch.Generator().manual_seed(77 + rank)) * 4).round().bfloat16() / 8


# --- the oracle ------------------------------------------------------------------------------------------------
def _contributions(model: torch.nn.Module, step: int, cfg: dict) -> list[list[dict]]:
    """``[rank][micro] -> {name: [the grad of each hook firing, in order]}`` for ``model``'s current weights."""
    ref = type(model)().bfloat16()
    ref.load_state_dict(model.state_dict())
    fired: dict = {}

    def record(name: str):
        def hook(p: torch.Tensor) -> None:
            fired.setdefault(name, []).append(p.grad.detach().clone())
            p.grad = None

        return hook

    for name, p in ref.named_parameters():
        p.register_post_accumulate_grad_hook(record(name))
    out = []
    for rank in range(WORLD):
        per_micro = []
        for m in range(cfg["micro"]):
            fired = {}
            _loss(ref, step, rank, m, cfg.get("use_b", True)).backward()
            per_micro.append(fired)
        out.append(per_micro)
    return out


def _sum16(grads: list[torch.Tensor]) -> torch.Tensor | None:
    total = None
    for g in grads:
        total = g if total is None else total + g  # in 16 bits, as autograd accumulates .grad
    return total


def _units(
    per_micro: list[dict], name: str, shape: torch.Size, cfg: dict, rank: int, step: int
) -> tuple[list[torch.Tensor | None], bool]:
    """A rank's values of param ``name`` that are reduced with the other ranks' (each one reduction, in order),
    and whether the rank has a grad for it (the "used" flag)."""
    got = [c for fired in per_micro for c in fired.get(name, [])]
    used = bool(got)
    if cfg["accum"] == "fp32":
        units = []
        if got:
            total = torch.zeros(shape)
            for c in got:
                total = total + c.float()  # the hook's fp32 add, in firing order
            units = [total]
    elif cfg["stage"] == 1:
        units = [] if not got else [_sum16(got)]
    else:
        # Each backward's contributions are summed in 16 bits and reduced. With a bucket per param the shared
        # params' buckets are launched at their first hook call; in the first backward (the reducer has not seen
        # a param's hook run twice yet) the later calls' grads are held apart, 16-bit, and added into the bucket's
        # next reduction (the next backward's), or reduced on their own at the step.
        units, late = [], None
        for m, fired in enumerate(per_micro):
            calls = fired.get(name, [])
            if cfg["bucket"] == 40 and step == 0 and m == 0 and len(calls) > 1:
                units.append(calls[0])
                late = _sum16(calls[1:])
                continue
            total = _sum16(calls)
            if late is not None:
                total, late = (late if total is None else total + late), None
            units.append(total)  # None: the bucket is reduced with zeros from this rank
        if late is not None:
            units.append(late)
    edit = cfg.get("edit", "none")
    if name != "b.weight" or edit == "none" or (edit.endswith("rank0") and rank != 0):
        return units, used
    whole16 = cfg["stage"] == 1 and cfg["accum"] == "param"
    if edit.startswith("assign"):
        t = _assigned(rank, shape)
        if whole16:
            return [t], True
        if cfg["accum"] == "fp32":
            return [(units[0] if units else torch.zeros(shape)) + t.float()], True
        return [*units, t], True
    if edit.startswith("zero") and whole16:
        return [torch.zeros_like(units[0])], used
    if edit.startswith("drop") and whole16:
        return [], False
    return units, used


def oracle_grads(model: torch.nn.Module, step: int, cfg: dict) -> dict:
    """name -> the mean grad a step must apply (None: no rank has one, the param is not stepped)."""
    contribs = _contributions(model, step, cfg)
    out = {}
    for name, p in model.named_parameters():
        per_rank = [_units(contribs[r], name, p.shape, cfg, r, step) for r in range(WORLD)]
        if not any(used for _, used in per_rank):
            out[name] = None
            continue
        total = torch.zeros(p.shape)
        for u in range(max(len(units) for units, _ in per_rank)):
            values = [units[u] if u < len(units) and units[u] is not None else None for units, _ in per_rank]
            values = [torch.zeros(p.shape, dtype=torch.bfloat16) if v is None else v for v in values]
            if cfg.get("reduce", "fp32") == "fp32":
                reduced = torch.zeros(p.shape)
                for v in values:
                    reduced = reduced + v.float()
            else:  # each rank's grad divided by the world size, summed in 16 bits
                reduced = values[0] / WORLD
                for v in values[1:]:
                    reduced = reduced + v / WORLD
            total = total + reduced.float()
        out[name] = total / WORLD if cfg.get("reduce", "fp32") == "fp32" else total
    return out


# --- the system under test -------------------------------------------------------------------------------------
class Collectives(TorchDispatchMode):
    """Counts the c10d collectives run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _edit(model: Pair, cfg: dict) -> None:
    edit = cfg.get("edit", "none")
    if edit == "none" or (edit.endswith("rank0") and RANK != 0):
        return
    w = model.b.weight
    if edit.startswith("assign"):
        w.grad = _assigned(RANK, w.shape)
    elif edit.startswith("zero"):
        w.grad.zero_()
    elif edit.startswith("drop"):
        w.grad = None


def _reference(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 copies of ``model``'s 16-bit weights and a plain torch SGD over them."""
    ref = type(model)()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())
    return ref, torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)


def _feed(ref: torch.nn.Module, opt: torch.optim.Optimizer, grads: dict) -> dict:
    for name, p in ref.named_parameters():
        p.grad = grads[name]
    opt.step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _run(cfg: dict) -> dict:
    model = (Shared if cfg["model"] == "shared" else Pair)().bfloat16()
    ref, ref_opt = _reference(model)
    opt = ShardedMixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, foreach=False),
        named_parameters=model,
        stage=cfg["stage"],
        bucket_size=cfg["bucket"],
        grad_accum_dtype=cfg["accum"],
        reduce_dtype=cfg.get("reduce", "fp32"),
        impl=cfg.get("impl", "torch"),
    )
    steps, collectives = [], []
    for step in range(cfg["steps"]):
        want = oracle_grads(model, step, cfg)
        for m in range(cfg["micro"]):
            hold = cfg.get("no_sync") and m < cfg["micro"] - 1
            with opt.no_sync() if hold else contextlib.nullcontext():
                opt.backward(_loss(model, step, RANK, m, cfg.get("use_b", True)))
        if cfg.get("unscale_first"):
            opt.unscale_()
        _edit(model, cfg)
        with Collectives() as seen:
            opt.step()
        collectives.append(dict(seen.names))
        opt.zero_grad()
        steps.append(
            {
                "pieces": pieces(opt),
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "masters": _feed(ref, ref_opt, want),
            }
        )
    return {"steps": steps, "collectives": collectives, "buckets": len(opt.layout.buckets)}


def _engine_twice(stage: int, gas: int) -> dict:
    """The engine at ZeRO-``stage`` (0: the unsharded optimizer all-reducing fp32 sums) on ``Shared``."""
    torch.manual_seed(0)
    model = Shared()
    engine = halfprec.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        precision="bf16",
        zero_stage=stage,
        gradient_accumulation_steps=gas,
        grad_accum_dtype="fp32",
    )
    for step in range(2):
        for m in range(gas):
            engine.backward(_loss(engine.module, step, RANK, m, True))
        engine.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def scenario_grads(out: str, twice: list, edits: list) -> dict:
    return {
        "twice": [_run(cfg) for cfg in twice],
        "edits": [_run(cfg) for cfg in edits],
        "engine": {f"{s}-{gas}": _engine_twice(s, gas) for s in (0, 1, 2) for gas in (1, 2)},
    }
