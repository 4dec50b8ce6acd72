"""Which kind of checkpoint a directory holds, as its writer recorded it in ``manifest.json`` (key ``layout``).

Readers never guess from the files present, except for checkpoints written before the layout was recorded (by the
rule of that time: where DCP's ``.metadata`` is).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "LEGACY_FORMATS",
    "DCP_FORMAT",
    "DCP_LEGACY_FORMATS",
    "MANIFEST",
    "ENGINE",
    "ENGINE_SHARDED",
    "DCP",
    "layout_of",
    "peek_manifest",
]

FORMAT = "halfprec-checkpoint/2"  # /2: the manifest carries its own SHA-256
LEGACY_FORMATS = ("halfprec-checkpoint/1",)  # still loaded (without the manifest's self-digest)
DCP_FORMAT = "halfprec-dcp/2"  # a DCP optimizer checkpoint's manifest: its name, digests, its own SHA-256
# only the format (and the items' version): loaded with a warning that nothing can be verified
DCP_LEGACY_FORMATS = ("halfprec-dcp/1",)
MANIFEST = "manifest.json"

ENGINE = "engine"
ENGINE_SHARDED = "engine-sharded"
DCP = "dcp"
_LAYOUTS = (ENGINE, ENGINE_SHARDED, DCP)


def peek_manifest(path: Path) -> dict[str, Any] | None:
    """``<path>/manifest.json`` as written, unverified, for a look before a reader verifies it: None when there
    is none, ``{}`` when it is unreadable or no JSON object (its reader names the damage)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def layout_of(path: str | Path, manifest: dict[str, Any] | None = None) -> str | None:
    """:data:`ENGINE`, :data:`ENGINE_SHARDED` (its optimizer a DCP directory ``optimizer/``) or :data:`DCP` (a
    bare ``halfprec.distributed.checkpoint.save``) for the checkpoint at ``path``; None if there is none.

    ``manifest`` is the already verified ``manifest.json`` of ``path``, if the caller has it. An unreadable
    manifest counts as an engine checkpoint's: its reader then names the damage.
    """
    path = Path(path)
    manifest = peek_manifest(path) if manifest is None else manifest
    if manifest is None:  # none, or older: a bare DCP checkpoint had .metadata
        return DCP if (path / ".metadata").is_file() else None
    if manifest.get("format") in (DCP_FORMAT, *DCP_LEGACY_FORMATS):
        return DCP
    layout = manifest.get("layout")
    if layout is None:  # older: the files (covered by the digests) told a sharded engine's optimizer
        return ENGINE_SHARDED if "optimizer/.metadata" in manifest.get("files", {}) else ENGINE
    if layout not in _LAYOUTS:
        from .directory import CheckpointError  # noqa: PLC0415 - directory imports this module

        raise CheckpointError(f"{path / MANIFEST} names layout {layout!r}, expected one of {list(_LAYOUTS)}")
    return layout
