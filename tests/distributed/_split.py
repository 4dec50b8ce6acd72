"""Split masters on the sharded optimizer (``_worker.py split`` / ``split_load``): the same training with fp32 and
split masters (fused local step), checkpoints saved by each, and loads of one into the other, here or at another
world size. The pytest side (``test_split.py``) compares them."""

from __future__ import annotations

from pathlib import Path

import torch
from _worker import build_sharded, pieces, train

from halfprec.distributed import checkpoint

MASTERS = ("fp32", "split")


def _params(model: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def scenario_split(out: str, configs: list, steps: int, more: int) -> dict:
    """Per config and master storage: ``steps`` steps, a save, ``more`` steps; then each checkpoint loaded into
    the other storage and ``more`` steps; and the rank-local state dict of each loaded into the other."""
    res: dict = {}
    for i, cfg in enumerate(configs):
        r: dict = {}
        local: dict = {}
        for masters in MASTERS:
            model, opt = build_sharded(cfg, impl="triton", masters=masters)
            assert (opt.flat_master is None, opt.flat_low is None) == (masters == "split", masters == "fp32")
            trace = {"norms": [], "skipped": [], "scales": []}
            train(model, opt, cfg, range(steps), trace)
            checkpoint.save(opt, Path(out) / f"{masters}{i}")
            # the save released the fp32 buffer it joined: split pieces view one element again
            held = [p.untyped_storage().nbytes() for g in opt.optimizer.param_groups for p in g["params"]]
            r[f"released-{masters}"] = max(held) <= 4 if masters == "split" else True
            r[f"saved-{masters}"] = {"pieces": pieces(opt)}
            train(model, opt, cfg, range(steps, steps + more), trace)
            r[masters] = {"trace": trace, "pieces": pieces(opt), "params": _params(model)}
            local[masters] = opt.state_dict()
            r[masters]["local_masters"] = local[masters]["masters"].clone()
        for source, target in (("split", "fp32"), ("fp32", "split")):
            model, opt = build_sharded(cfg, impl="triton", masters=target)
            checkpoint.load(opt, Path(out) / f"{source}{i}")
            train(model, opt, cfg, range(steps, steps + more))
            r[f"{source}->{target}"] = {"pieces": pieces(opt), "params": _params(model)}
            model, opt = build_sharded(cfg, impl="triton", masters=target)
            opt.load_state_dict(local[source])
            r[f"local {source}->{target}"] = {"pieces": pieces(opt), "params": _params(model)}
        res[i] = r
    return res


def scenario_split_load(out: str, configs: list) -> dict:
    """Each checkpoint of ``scenario_split`` loaded into either storage at this world size."""
    res: dict = {}
    for i, cfg in enumerate(configs):
        for source in MASTERS:
            for target in MASTERS:
                model, opt = build_sharded(cfg, impl="triton", masters=target)
                checkpoint.load(opt, Path(out) / f"{source}{i}")
                res[f"{i} {source}->{target}"] = {"pieces": pieces(opt), "params": _params(model)}
    return res
