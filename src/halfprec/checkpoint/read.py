"""Reading a checkpoint directory: find it (``latest``, tags, a DCP directory) and load its files, once its
manifest is verified (``manifest.read_manifest``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .atomic import located
from .directory import LATEST, check_tag, read_latest
from .manifest import (
    MANIFEST,
    CheckpointError,
    layout_of,
    reraised,
)

__all__ = ["resolve", "load_weights", "load_pt"]


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


def load_weights(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state dict, ties restored (an alias is the same tensor object as its stored name)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with reraised(SafetensorError, f"cannot read {path / 'model.safetensors'}"):
        weights = load_file(str(path / "model.safetensors"))
    for alias, name in manifest.get("ties", {}).items():
        weights[alias] = weights[name]
    return weights


def load_pt(path: Path, name: str) -> Any:
    """``<path>/<name>.pt`` through ``torch.load(weights_only=True)``: plain data only, no code runs."""
    with reraised(Exception, f"cannot load {path / name}.pt with weights_only=True"):
        return torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True)
