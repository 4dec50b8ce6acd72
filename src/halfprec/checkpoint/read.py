"""Reading a checkpoint directory: find it (``latest``, tags, a DCP directory), verify it, load its files.

Every reader goes through these few functions: the manifest is verified (sizes, SHA-256, its own digest) before
any file is used, and ``*.pt`` files load with ``torch.load(weights_only=True)``, so no code from the file runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .atomic import located
from .directory import LATEST, CheckpointError, _digest, _manifest_digest, check_tag, read_latest
from .formats import DCP_FORMAT, FORMAT, LEGACY_FORMATS, MANIFEST, layout_of

__all__ = ["resolve", "read_manifest", "load_weights", "load_pt"]


def resolve(directory: str | os.PathLike, tag: str | None = None, *, tag_option: str = "tag=") -> Path:
    """The checkpoint directory for ``tag``, or the one ``latest`` points at; also a tag directory or a DCP
    optimizer checkpoint's. ``tag_option`` is how the caller's user names a tag (``"--tag"`` on the command
    line), for the error hints. A checkpoint whose replace died midway is found at its aside."""
    root = located(Path(directory))
    if tag is None and layout_of(root) is not None:
        return root
    if root.exists() and not root.is_dir():
        raise CheckpointError(
            f"no checkpoint at {root}: it is a file, not a checkpoint directory; pass the directory that "
            "save_checkpoint() wrote to, or one of its tag directories"
        )
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist")
    if tag is None:
        pointer = root / LATEST
        if not pointer.exists():
            tags = _tags_in(root)
            raise CheckpointError(
                f"no checkpoint in {root}: no {LATEST} pointer and no tag directory with a {MANIFEST}; pass the "
                "directory that save_checkpoint() wrote to"
                if tags == "(none)"
                else f"no checkpoint in {root}: {pointer} does not exist; pass {tag_option} with one of: {tags}"
            )
        tag = read_latest(root)
        try:
            check_tag(tag)
        except ValueError as e:
            raise CheckpointError(
                f"{pointer} is damaged: {e}; pass {tag_option} with one of: {_tags_in(root)}"
            ) from e
    path = located(root / check_tag(tag))
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; checkpoints in {root}: {_tags_in(root)}")
    return path


def _tags_in(root: Path, limit: int = 10) -> str:
    """Names of the checkpoint directories in ``root`` (the first ``limit``; ``(none)``), for error messages."""
    try:
        tags = sorted(
            p.name for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()
        )
    except OSError:
        tags = []
    more = [f"... ({len(tags) - limit} more)"] if len(tags) > limit else []
    return ", ".join(tags[:limit] + more) or "(none)"


def read_manifest(path: Path) -> dict[str, Any]:
    """Read ``manifest.json`` and check every file's size and digest; errors name the file."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupted: {e}") from e
    if isinstance(manifest, dict) and manifest.get("format") == DCP_FORMAT:
        raise CheckpointError(
            f"{path} is an optimizer checkpoint of halfprec.distributed.checkpoint.save, not an engine checkpoint: "
            "load it with halfprec.distributed.checkpoint.load(optimizer, path)"
        )
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, *LEGACY_FORMATS):
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{manifest_path} has format {found!r}, expected {FORMAT!r}")
    if manifest["format"] == FORMAT and manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(
            f"{manifest_path} is corrupted: its contents do not match the SHA-256 it was written with"
        )
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"checkpoint file {file} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint file {file} is truncated or extended: {size} bytes, expected {entry['size']}"
            )
        if _digest(file) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {file} is corrupted: its SHA-256 does not match the manifest"
            )
    return manifest


def load_weights(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state dict, ties restored (an alias is the same tensor object as its stored name)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / "model.safetensors"))
    except SafetensorError as e:
        raise CheckpointError(f"cannot read {path / 'model.safetensors'}: {e}") from e
    for alias, name in manifest.get("ties", {}).items():
        weights[alias] = weights[name]
    return weights


def load_pt(path: Path, name: str) -> Any:
    """``<path>/<name>.pt`` through ``torch.load(weights_only=True)``: plain data only, no code runs."""
    file = path / f"{name}.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot load {file} with weights_only=True: {e}") from e
