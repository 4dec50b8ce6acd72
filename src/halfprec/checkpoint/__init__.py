"""Checkpoints: the engine's directory format, reshardable DCP optimizer checkpoints, export of weights.

Both formats share one atomic commit (``atomic``), one record of the layout (``formats``) and one reader
(``read``). This package gives the directory format's functions; ``dcp`` (public as
``halfprec.distributed.checkpoint``), ``consolidate`` and ``export`` import heavier modules, so on use.
"""

from __future__ import annotations

from .atomic import commit
from .directory import (
    LATEST,
    CheckpointError,
    _digest,  # noqa: F401 - used by tests that re-seal a tampered checkpoint
    _manifest_digest,  # noqa: F401
    check_tag,
    prepare,
    publish,
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
    "prepare",
    "stage",
    "seal",
    "commit",
    "publish",
    "save_pt",
    "load_weights",
    "load_pt",
    "rng_state",
    "set_rng_state",
    "check_plain",
]
