"""FSDP2 under the tools: what the adapters share about a model sharded by ``fully_shard`` (DTensor params).

halfprec trains FSDP2's shards on each rank's rows (``optim/mesh.py``; the fused strategy where it can run, as
``impl="auto"`` picks it, else the exact one). Where a tool builds the halfprec optimizer over the shards, that
works as in a plain loop; where a tool replaces the optimizer's params after it was built (Accelerate's
``prepare``, the HF Trainer), it cannot, since halfprec's masters are of the params it was given. An adapter that
casts a sharded fp32 model itself (the Lightning plugin) keeps each shard's fp32 rows (``prepare.fp32_rows``) until
the optimizer is wrapped, so that the masters start from them (``prepare.start_masters_from``) and not from their
16-bit roundings, as the engine does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..optim.mesh import is_dtensor

__all__ = ["trains_shards"]


def trains_shards(params: Iterable[torch.Tensor]) -> bool:
    """Whether any trainable one of ``params`` is an FSDP2 shard (a DTensor)."""
    return any(is_dtensor(p) for p in params if p.requires_grad)
