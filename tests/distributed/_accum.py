"""One rank of the fp32-accumulation oracle (``_worker.py accum``): what a sharded step reads, against the sum
the issue asks for, computed on this rank for every rank from the same 16-bit weights.

Oracle of a step: each rank's micro-batch grads of the (scaled) loss in the model's 16-bit dtype, summed in fp32
in micro-batch order; the two ranks' sums added in fp32, divided by the world size and multiplied by 1/scale
(both powers of two). A plain fp32 torch optimizer stepped with those grads gives the reference masters.
"""

from __future__ import annotations

import contextlib

import torch
from _worker import DTYPES, RANK, WORLD, Net, build_sharded, loss_of, make_model, make_optimizer, pieces

from halfprec import MixedPrecisionOptimizer


def rank_sums(model: torch.nn.Module, step: int, cfg: dict, scale: float, loss=loss_of) -> list[dict]:
    """Per rank ``{name: (fp32 sum, 16-bit sum)}`` of the micro-batch grads of ``model``'s current weights
    (``loss``: ``loss_of``'s signature)."""
    dtype = DTYPES[cfg["dtype"]]
    ref = make_model(dtype)
    ref.load_state_dict(model.state_dict())
    out = []
    for rank in range(WORLD):
        sums: dict = {}
        for m in range(cfg["micro"]):
            ref.zero_grad(set_to_none=True)
            (loss(ref, step, rank, m, dtype, cfg.get("poison", [])) * scale).backward()
            for n, p in ref.named_parameters():
                if p.grad is not None:
                    f32, low = sums.get(n, (None, None))
                    sums[n] = (
                        (p.grad.float(), p.grad) if f32 is None else (f32 + p.grad.float(), low + p.grad)
                    )
        out.append(sums)
    return out


def oracle(sums: list[dict], scale: float) -> tuple[dict, bool]:
    """The grads a step must read, and whether 16-bit accumulation would have read other values. A param with no
    grad on a rank adds that rank's zeros (the "used anywhere" rule)."""
    grads, differs = {}, False
    for n in dict.fromkeys(n for s in sums for n in s):
        zero = torch.zeros_like(next(s[n] for s in sums if n in s)[0])
        fp32 = sum((s[n][0] if n in s else zero for s in sums[1:]), sums[0][n][0] if n in sums[0] else zero)
        low = sum((s[n][1].float() if n in s else zero for s in sums[1:]),
                  sums[0][n][1].float() if n in sums[0] else zero)  # fmt: skip
        grads[n] = fp32 / WORLD * (1.0 / scale)
        differs = differs or not torch.equal(fp32, low)
    return grads, differs


def record_step(opt, ref: torch.nn.Module, ref_opt, seen: dict, grads: dict, differs: bool) -> dict:
    """What a step read (``seen``) beside its oracle ``grads``; steps the fp32 reference with them unless they are
    not finite (the step must then have been skipped)."""
    finite = all(bool(g.isfinite().all()) for g in grads.values())
    if finite:
        for n, p in ref.named_parameters():
            p.grad = grads.get(n)
        ref_opt.step()
    return {
        "seen": seen,
        "oracle": grads,
        "differs": differs,
        "skipped": opt.step_was_skipped,
        "finite": finite,
    }


def _shard(opt) -> dict:
    """The fp32 grad shard after ``unscale_()``, in model space: name -> (lo, hi, values)."""
    shard = opt.reducer.grad_shard
    return {
        name: (pc.lo, pc.hi, shard[pc.local : pc.local + pc.numel].clone())
        for name, _s, _g, pc, _p in opt.model_space()
        if pc is not None
    }


def _run(cfg: dict, impl: str) -> dict:
    model, opt = build_sharded(cfg, impl=impl, grad_accum_dtype="fp32")
    ref = Net()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())
    ref_opt = make_optimizer(ref, cfg["opt"])
    steps = []
    for step in range(cfg["steps"]):
        scale = opt.loss_scale
        grads, differs = oracle(rank_sums(model, step, cfg, scale), scale)
        for m in range(cfg["micro"]):
            defer = cfg["no_sync"] and m < cfg["micro"] - 1
            with opt.no_sync() if defer else contextlib.nullcontext():
                opt.backward(loss_of(model, step, RANK, m, DTYPES[cfg["dtype"]], cfg.get("poison", [])))
            assert all(p.grad is None for p in model.parameters()), "a 16-bit grad outlived its hook"
        opt.unscale_()
        seen = _shard(opt)
        opt.step()
        steps.append(record_step(opt, ref, ref_opt, seen, grads, differs))
        if cfg["zero_grad"]:
            opt.zero_grad()  # else the next backward starts a new sum on its own
    return {
        "impl": opt.impl,
        "steps": steps,
        "pieces": pieces(opt),
        "reference": {n: p.detach().clone() for n, p in ref.named_parameters()},
    }


def _unsharded_refusal() -> str:
    """What the unsharded optimizer says to fp32 accumulation in a process group of 2 (DDP would all-reduce
    the 16-bit grads the hooks release)."""
    model = make_model(torch.bfloat16)
    try:
        MixedPrecisionOptimizer(make_optimizer(model, "adamw"), grad_accum_dtype="fp32")
    except ValueError as e:
        return str(e)
    return "no error"


def scenario_accum(out: str, configs: list) -> dict:
    res: dict = {i: {impl: _run(cfg, impl) for impl in ("torch", "triton")} for i, cfg in enumerate(configs)}
    res["unsharded"] = _unsharded_refusal()
    return res
