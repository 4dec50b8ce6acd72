"""Checkpoints: the engine's directory format (``directory`` writes it, ``read`` reads it), reshardable DCP optimizer
checkpoints (``dcp``, public as ``halfprec.distributed.checkpoint``), both verified against their ``manifest``;
weights and a summary of either (``export``). Here: what a user calls; the parts are imported from their modules.
"""

from __future__ import annotations

from .export import consolidated_weights, describe
from .manifest import MANIFEST, CheckpointError

# export() stays in halfprec.checkpoint.export: here the name would hide that module
__all__ = ["CheckpointError", "MANIFEST", "consolidated_weights", "describe"]
