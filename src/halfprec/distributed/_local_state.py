"""Rank-local state dict of the sharded optimizer: loads only at the same world size, rank and layout."""

from __future__ import annotations

from typing import Any

import torch

from ..migrate import restore_state_dtypes

__all__ = ["local_state_dict", "load_local_state_dict"]

_FORMAT = "halfprec.ShardedMixedPrecisionOptimizer/1"


def _fingerprint(opt) -> dict[str, Any]:
    return {
        "world_size": opt.world_size,
        "rank": opt.rank,
        "names": list(opt._names),
        "numels": list(opt.layout.numels),
        "bucket_numels": [b.numel for b in opt.layout.buckets],
    }


def local_state_dict(opt) -> dict[str, Any]:
    opt._run_hooks("_optimizer_state_dict_pre_hooks")
    out = {
        "format": _FORMAT,
        "layout": _fingerprint(opt),
        "optimizer": opt.optimizer.state_dict(),
        "masters": opt.flat_master.detach(),
        "scaler": opt.loss_scaler.state_dict(),
        "skipped_steps": opt._skipped_steps,
    }
    return opt._run_hooks("_optimizer_state_dict_post_hooks", out)


def load_local_state_dict(opt, state_dict: dict[str, Any]) -> None:
    state_dict = opt._run_hooks("_optimizer_load_state_dict_pre_hooks", state_dict)
    if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
        raise ValueError(
            "not a ShardedMixedPrecisionOptimizer state dict; checkpoints in model space (any world size) "
            "load with halfprec.distributed.checkpoint.load(...)"
        )
    if state_dict["layout"] != _fingerprint(opt):
        saved = state_dict["layout"]
        raise ValueError(
            f"rank-local state dict saved at world size {saved['world_size']} rank {saved['rank']} does not "
            f"match this layout (world size {opt.world_size} rank {opt.rank}); to change world size save and "
            "load with halfprec.distributed.checkpoint"
        )
    inner = state_dict["optimizer"]
    opt.optimizer.load_state_dict(inner)
    restore_state_dtypes(opt.optimizer, inner["state"], opt.master_params())
    with torch.no_grad():
        opt.flat_master.copy_(state_dict["masters"])
    opt._publish()
    opt.loss_scaler.load_state_dict(state_dict["scaler"])
    opt._skipped_steps = int(state_dict["skipped_steps"])
    opt._unscaled = False
    opt._run_hooks("_optimizer_load_state_dict_post_hooks")
