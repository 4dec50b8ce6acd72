"""Reading a checkpoint directory: find it (``latest``, tags, a DCP directory), verify its manifest before any
file is used (both formats), load its files."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .atomic import located
from .directory import LATEST, CheckpointError, _digest, _manifest_digest, check_tag, read_latest, reraised
from .formats import DCP_FORMAT, DCP_LEGACY_FORMATS, FORMAT, LEGACY_FORMATS, MANIFEST, layout_of

__all__ = ["resolve", "read_manifest", "read_dcp_manifest", "check_counters", "load_weights", "load_pt"]


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
    """Read an engine checkpoint's ``manifest.json`` and verify it (:func:`_verify`); errors name the file."""
    manifest = _manifest_json(path)
    if _format(manifest) in (DCP_FORMAT, *DCP_LEGACY_FORMATS):
        raise CheckpointError(
            f"{path} is an optimizer checkpoint of halfprec.distributed.checkpoint.save, not an engine checkpoint: "
            "load it with halfprec.distributed.checkpoint.load(optimizer, path)"
        )
    digest = {"manifest_sha256"} & set(manifest) if isinstance(manifest, dict) else set()
    return _verify(path, manifest, FORMAT, LEGACY_FORMATS, digest)


_UNVERIFIED: set[str] = set()  # DCP checkpoints already warned about in this process


def read_dcp_manifest(path: Path) -> None:
    """Verify the DCP optimizer checkpoint at ``path`` (:func:`_verify`); warn, once per process, for one written
    before its manifest had digests (``formats.DCP_LEGACY_FORMATS``)."""
    manifest = _manifest_json(path) if (path / MANIFEST).exists() else None
    extra = set(manifest) - {"format", "format_version"} if isinstance(manifest, dict) else set()
    if manifest is not None and (_format(manifest) not in DCP_LEGACY_FORMATS or extra):
        _verify(path, manifest, DCP_FORMAT, DCP_LEGACY_FORMATS, extra)
    elif str(path) not in _UNVERIFIED:
        _UNVERIFIED.add(str(path))
        warnings.warn(
            f"{path} was written by an older halfprec, without a manifest of digests: a damaged file cannot "
            "be detected; save it again with this version to protect it",
            RuntimeWarning,
            stacklevel=4,
        )


def _format(manifest: Any) -> str:
    return manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__


def _manifest_json(path: Path) -> Any:
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete")
    with reraised((json.JSONDecodeError, UnicodeDecodeError), f"{manifest_path} is corrupted"):
        return json.loads(manifest_path.read_text())


def _verify(
    path: Path, manifest: Any, current: str, legacy: tuple[str, ...], extra: set[str]
) -> dict[str, Any]:
    """Check the format (``current``, or one of ``legacy``, which must not carry the keys ``extra`` that only
    ``current`` writes), the manifest's own SHA-256, that ``path`` is the directory it was written as (not
    renamed, nor a link to another tag), and every file's size and SHA-256."""
    manifest_path, found = path / MANIFEST, _format(manifest)
    if found not in (current, *legacy):
        raise CheckpointError(f"{manifest_path} has format {found!r}, expected {current!r}")
    if found != current and extra:
        raise CheckpointError(
            f"{manifest_path} claims format {found!r} but carries {sorted(extra)}, which only {current!r} "
            "writes: its format was edited, so it cannot be trusted; save the checkpoint again"
        )
    if found == current and manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(
            f"{manifest_path} is corrupted: its contents do not match the SHA-256 it was written with"
        )
    here = Path(os.path.abspath(path))
    tag = manifest.get("tag")
    if not isinstance(tag, str) or "/" in tag or located(here.parent / tag) != here:
        raise CheckpointError(
            f"{path} holds the checkpoint written as {tag!r} (its manifest says so): it was renamed, or is a link, "
            f"and would load as another checkpoint than the one it names; rename it back to {tag!r}"
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


def check_counters(path: Path, manifest: dict[str, Any], found: dict[str, tuple[Any, str]]) -> None:
    """Raise unless each value the manifest records equals the one read from the checkpoint's files: ``found``
    is ``{key: (value, file it was read from)}``. Tools show the files' values; a manifest edited and re-sealed
    to say otherwise is refused rather than believed."""
    for key, (value, source) in found.items():
        if key in manifest and value is not None and manifest[key] != value:
            raise CheckpointError(
                f"{path / MANIFEST} says {key} is {manifest[key]!r} but {path / source} holds {value!r}: the "
                "manifest was edited after the save, so the checkpoint cannot be trusted"
            )


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
