"""Checkpoints: the engine's directory format (its functions are here), reshardable DCP optimizer checkpoints
(``dcp``, public as ``halfprec.distributed.checkpoint``), export; the last two import heavier modules, so on use.
"""

from __future__ import annotations

from .directory import (
    LATEST,
    CheckpointError,
    _digest,  # noqa: F401 - used by tests that re-seal a tampered checkpoint
    _manifest_digest,  # noqa: F401
    check_tag,
    reading,
    save_pt,
    saving,
    seal,
    stage,
    write_checkpoint,
)
from .formats import DCP, DCP_FORMAT, ENGINE, ENGINE_SHARDED, FORMAT, MANIFEST, layout_of
from .plain import check_plain, rng_state, set_rng_state
from .read import load_pt, load_weights, read_manifest, resolve

__all__ = [
    "CheckpointError",
    "FORMAT",
    "DCP_FORMAT",
    "MANIFEST",
    "LATEST",
    "ENGINE",
    "ENGINE_SHARDED",
    "DCP",
    "layout_of",
    "check_tag",
    "read_manifest",
    "resolve",
    "reading",
    "write_checkpoint",
    "saving",
    "stage",
    "seal",
    "save_pt",
    "load_weights",
    "load_pt",
    "rng_state",
    "set_rng_state",
    "check_plain",
]
