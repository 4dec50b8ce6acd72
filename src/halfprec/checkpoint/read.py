"""Reading an engine checkpoint directory: find it (``latest``, tags, a DCP directory), verify it before any file
is used (:func:`verify`, which ``Engine.load_checkpoint``, ``export`` and ``inspect`` all call), load its files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .atomic import located
from .directory import LATEST, check_tag, read_latest
from .manifest import (
    ENGINE_SHARDED,
    MANIFEST,
    CheckpointError,
    check_counters,
    layout_of,
    read_manifest,
    reraised,
)

__all__ = ["resolve", "verify", "load_weights", "load_pt"]


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


def verify(path: Path) -> dict[str, Any]:
    """Verify the engine checkpoint at ``path`` as every reader of it does first (``Engine.load_checkpoint``,
    ``export``, ``inspect``) and return its manifest: :func:`manifest.read_manifest` (every file it lists intact,
    every file its layout reads listed), then its counters checked against those its files hold."""
    manifest = read_manifest(path)
    check_counters(path, manifest, _counters(path, manifest))
    return manifest


def _counters(path: Path, manifest: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """``{key: (value, file)}`` for the counters a manifest records, as the files that a load restores them from
    hold them (None where a file lacks one: its reader names what is wrong with it)."""
    engine = load_pt(path, "engine")
    if layout_of(path, manifest) == ENGINE_SHARDED:
        from .consolidate import read_items  # noqa: PLC0415 - imports torch.distributed.checkpoint

        keys = ["counters/skipped_steps", "scaler/scale"]
        items = read_items(path / "optimizer", keys)
        source, (skipped, scale) = "optimizer", (items[k].item() if k in items else None for k in keys)
    else:
        optimizer = load_pt(path, "optimizer", mmap=True)  # two numbers: the tensors are not read
        skipped, scale = _get(optimizer, "skipped_steps"), _get(optimizer, "scaler", "scale")
        source = "optimizer.pt"
    return {
        "global_step": (_get(engine, "global_step"), "engine.pt"),
        "skipped_steps": (skipped, source),
        "precision": (_get(engine, "config", "precision"), "engine.pt"),
        "loss_scale": (scale, source),
    }


def _get(value: Any, *keys: str) -> Any:
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def load_weights(path: Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model state dict, ties restored (an alias is the same tensor object as its stored name)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with reraised(SafetensorError, f"cannot read {path / 'model.safetensors'}"):
        weights = load_file(str(path / "model.safetensors"))
    for alias, name in manifest.get("ties", {}).items():
        weights[alias] = weights[name]
    return weights


def load_pt(path: Path, name: str, *, mmap: bool = False) -> Any:
    """``<path>/<name>.pt`` through ``torch.load(weights_only=True)``: plain data only, no code runs. ``mmap``:
    tensors are read only when used."""
    with reraised(Exception, f"cannot load {path / name}.pt with weights_only=True"):
        return torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True, mmap=mmap)
