"""One rank of the ZeRO-0 oracle (``_worker.py zero0``): the exact and fused optimizers with ``process_group=``
and fp32 accumulation, against the sum ``_accum.py`` computes (each rank's fp32 sum in micro-batch order, the
ranks' sums added in fp32, divided by the world size and by the loss scale). Rank 1 alone also trains ``unused``:
a param with a grad on some ranks only is stepped on every rank."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from _accum import oracle, rank_sums, record_step
from _worker import DTYPES, RANK, Net, group_order_names, loss_of, make_model, make_optimizer, make_scaler

import halfprec
from halfprec.optim import FusedAdamW
from halfprec.optim.fused.grads import GradViews


def loss_some_ranks(
    model, step: int, rank: int, micro: int, dtype: torch.dtype, poison: list
) -> torch.Tensor:
    loss = loss_of(model, step, rank, micro, dtype, poison)
    if rank == 1:
        loss = loss + (model.unused.float() * (micro + 1)).sum() * 0.25
    return loss


class _Spy:
    """Records, at the fused step's all-reduce, each param's view of the flat grad buffers right after it (what
    the kernels read, still scaled)."""

    def __init__(self, names: list[str]) -> None:
        self.names, self.seen = names, {}

    def __enter__(self):
        self.real = GradViews.all_reduce

        def spy(views, chunks, group):
            self.real(views, chunks, group)
            self.seen = {
                n: chunk.grad_views[k].clone() for n, (chunk, k) in zip(self.names, views.where, strict=True)
            }

        GradViews.all_reduce = spy
        return self

    def __exit__(self, *exc) -> None:
        GradViews.all_reduce = self.real


def _run(cfg: dict, impl: str) -> dict:
    dtype = DTYPES[cfg["dtype"]]
    model = make_model(dtype)
    names = group_order_names(model)
    options = dict(loss_scaler=make_scaler(cfg), grad_accum_dtype="fp32", process_group=dist.group.WORLD)
    torch_opt = make_optimizer(model, "adamw")
    if impl == "torch":
        opt = halfprec.MixedPrecisionOptimizer(torch_opt, impl="torch", **options)
    else:  # built directly: select.fused_from_torch does not pass process_group on (yet)
        opt = FusedAdamW(torch_opt.param_groups, **options)
    ref = Net()
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters(), strict=True):
            p.copy_(q.float())
    ref_opt = make_optimizer(ref, "adamw")
    steps = []
    for step in range(cfg["steps"]):
        scale = opt.loss_scale
        grads, differs = oracle(rank_sums(model, step, cfg, scale, loss_some_ranks), scale)
        for m in range(cfg["micro"]):
            opt.backward(loss_some_ranks(model, step, RANK, m, dtype, cfg.get("poison", [])))
        if impl == "torch":
            opt.unscale_()
            seen = {
                n: m.grad.clone()
                for n, m in zip(names, opt.master_params(), strict=True)
                if m.grad is not None
            }
            opt.step()
        else:
            with _Spy(names) as spy:
                opt.step()
            seen = {n: g * (1.0 / scale) for n, g in spy.seen.items()}  # the fused grads stay scaled
        steps.append(record_step(opt, ref, ref_opt, seen, grads, differs))
        opt.zero_grad()
    return {
        "impl": opt.impl,
        "steps": steps,
        "masters": {n: m.detach().clone() for n, m in zip(names, opt.master_params(), strict=True)},
        "reference": {n: p.detach().clone() for n, p in ref.named_parameters()},
    }


ERRORS = {  # name: the options of MixedPrecisionOptimizer on 2 ranks (impl="torch" unless given)
    "no group": dict(grad_accum_dtype="fp32"),
    "16-bit sums": dict(process_group="group"),
    "not a group": dict(grad_accum_dtype="fp32", process_group="world"),
}


def _triton() -> list:
    """``MixedPrecisionOptimizer(..., impl="triton", process_group=...)``: the fused optimizer, with the group."""
    opt = halfprec.MixedPrecisionOptimizer(
        make_optimizer(make_model(torch.float16), "adamw"),
        impl="triton",
        grad_accum_dtype="fp32",
        process_group=dist.group.WORLD,
    )
    return [type(opt).__name__, opt.process_group is dist.group.WORLD]


def _errors() -> dict:
    out = {}
    for name, options in ERRORS.items():
        options = {"impl": "torch"} | {k: dist.group.WORLD if v == "group" else v for k, v in options.items()}
        try:
            halfprec.MixedPrecisionOptimizer(make_optimizer(make_model(torch.float16), "adamw"), **options)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def _own_master() -> dict:
    """The exact path with an fp32 param among bf16 ones (its own master, accumulating in its ``.grad``): at
    ``unscale_()`` its grad is the mean of the ranks' local sums, as the masters' are."""
    model = make_model(torch.bfloat16)
    model.gain.data = model.gain.data.float()
    opt = halfprec.MixedPrecisionOptimizer(
        make_optimizer(model, "adamw"),
        impl="torch",
        grad_accum_dtype="fp32",
        process_group=dist.group.WORLD,
    )
    for m in range(4):
        opt.backward(loss_some_ranks(model, 0, RANK, m, torch.bfloat16, []))
    local = [torch.zeros_like(model.gain.grad) for _ in range(2)]
    dist.all_gather(local, model.gain.grad.clone())
    opt.unscale_()
    return {"got": model.gain.grad.clone(), "want": (local[0] + local[1]) / 2, "dtype": str(model.gain.dtype)}


def scenario_zero0(out: str, configs: list) -> dict:
    res: dict = {i: {impl: _run(cfg, impl) for impl in cfg["impls"]} for i, cfg in enumerate(configs)}
    res["errors"] = _errors()
    res["triton"] = _triton()
    res["own"] = _own_master()
    return res


def _engine(model: torch.nn.Module):
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return halfprec.initialize(
        model, make_optimizer(inner, "adamw"), precision="bf16", gradient_accumulation_steps=4
    )


def scenario_engine_zero0(out: str) -> dict:
    """The engine at zero_stage 0 on 2 ranks, bf16, 4 micro-batches: "auto" resolves to fp32 accumulation and the
    optimizer all-reduces; rank 0 saves, both ranks resume; a DDP-wrapped model is refused."""
    torch.manual_seed(0)
    engine = _engine(Net())
    for step in range(2):
        for micro in range(4):
            engine.backward(loss_some_ranks(engine.module, step, RANK, micro, torch.bfloat16, []))
        engine.step()
    torch.manual_seed(100 + RANK)  # the ranks' RNG streams differ (dropout), and each must come back
    path = engine.save_checkpoint(Path(out) / "ck")
    after_save = torch.rand(3)
    resumed = _engine(Net())
    resumed.load_checkpoint(Path(out) / "ck")
    after_load = torch.rand(3)
    try:
        _engine(torch.nn.parallel.DistributedDataParallel(Net()))
        ddp = "no error"
    except ValueError as e:
        ddp = str(e)
    return {
        "grouped": engine.optimizer.process_group is not None,
        "accum": str(engine.optimizer.grad_accum_dtype),
        "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        "resumed": {n: p.detach().clone() for n, p in resumed.module.named_parameters()},
        "path": str(path),
        "ddp": ddp,
        "rng": [after_save, after_load],
    }
