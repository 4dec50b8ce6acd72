"""Data-parallel training: ZeRO-1/2 sharded optimizer and reshardable DCP checkpoints.

Importing this package imports nothing heavy; the classes load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ShardedMixedPrecisionOptimizer", "consolidate", "load", "read_checkpoint", "save"]

_HOME = {  # name -> the module that defines it
    "ShardedMixedPrecisionOptimizer": "halfprec.optim.sharded",
    "save": "halfprec.distributed.checkpoint",
    "load": "halfprec.distributed.checkpoint",
    "consolidate": "halfprec.checkpoint.consolidate",
    "read_checkpoint": "halfprec.checkpoint.consolidate",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'halfprec.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
