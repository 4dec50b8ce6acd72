"""Data-parallel training: ZeRO-1/2 sharded optimizer and reshardable DCP checkpoints.

Importing this package imports nothing heavy; the classes load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ShardedMixedPrecisionOptimizer",
    "consolidate",
    "load",
    "read_checkpoint",
    "save",
]


def __getattr__(name: str) -> Any:
    if name == "ShardedMixedPrecisionOptimizer":
        from ..optim.sharded import ShardedMixedPrecisionOptimizer

        return ShardedMixedPrecisionOptimizer
    if name in ("save", "load"):
        from . import checkpoint

        return getattr(checkpoint, name)
    if name in ("consolidate", "read_checkpoint"):
        from ..checkpoint import consolidate

        return getattr(consolidate, name)
    raise AttributeError(f"module 'halfprec.distributed' has no attribute {name!r}")
