"""FSDP2 under the tools: what the adapters share about a model sharded by ``fully_shard`` (DTensor params).

halfprec trains FSDP2's shards on each rank's rows (``optim/mesh.py``; the exact strategy, or the fused one with
``impl="triton"``). Where a tool
builds the halfprec optimizer over the shards, that works as in a plain loop; where a tool replaces the
optimizer's params after it was built (Accelerate's ``prepare``, the HF Trainer), it cannot, since halfprec's
masters are of the params it was given. An adapter that casts a sharded fp32 model itself (the Lightning plugin)
keeps each shard's fp32 rows until the optimizer is wrapped, so that the masters start from them and not from
their 16-bit roundings, as the engine's ``zero_stage=3`` does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..optim.base import MixedPrecisionOptimizer
from ..optim.mesh import is_dtensor
from ..prepare import start_masters_from

__all__ = ["start_masters", "trains_shards"]


def trains_shards(params: Iterable[torch.Tensor]) -> bool:
    """Whether any trainable one of ``params`` is an FSDP2 shard (a DTensor)."""
    return any(is_dtensor(p) for p in params if p.requires_grad)


def start_masters(mp: MixedPrecisionOptimizer, rows: dict[torch.Tensor, torch.Tensor]) -> None:
    """Start the masters of ``mp``'s params that ``rows`` holds from those fp32 rows (``prepare.fp32_rows``)."""
    mine = {p: rows[p] for p in mp.model_params() if p in rows}
    if not mine:
        return
    start_masters_from(mp, mine)
