"""``halfprec.distributed.checkpoint``: reshardable optimizer checkpoints (``save``/``load``), kept at this public
name; the code lives in ``halfprec.checkpoint.dcp``, next to the engine's format, so that both share one atomic
commit and one record of the layout."""

from __future__ import annotations

from ..checkpoint.dcp import FORMAT_VERSION, load, save

__all__ = ["save", "load", "FORMAT_VERSION"]
