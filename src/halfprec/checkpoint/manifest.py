"""``manifest.json``, the record every checkpoint directory is verified against, and ``CheckpointError``.

:func:`seal` writes it last: the format, the layout (which kind of checkpoint the directory holds), the name the
directory is published as, each file's size and SHA-256, the writer's counters, and its own SHA-256. Readers verify
it before they open any file (:func:`read_manifest`, :func:`read_dcp_manifest`) and open only files it lists
(:func:`_check_listed`). They never guess the layout from the files present, except for checkpoints written before
it was recorded (by the rule of that time: where DCP's ``.metadata`` is).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .atomic import fsync_path, located, write_synced

__all__ = [
    "CheckpointError",
    "reraised",
    "writing",
    "FORMAT",
    "LEGACY_FORMATS",
    "DCP_FORMAT",
    "MANIFEST",
    "ENGINE",
    "ENGINE_SHARDED",
    "DCP",
    "file_digest",
    "manifest_digest",
    "seal",
    "peek_manifest",
    "layout_of",
    "read_manifest",
    "read_dcp_manifest",
    "check_counters",
]

FORMAT = "halfprec-checkpoint/2"  # /2: the manifest carries its own SHA-256
LEGACY_FORMATS = ("halfprec-checkpoint/1",)  # still loaded (without the manifest's self-digest)
DCP_FORMAT = "halfprec-dcp/2"  # a DCP optimizer checkpoint's manifest: its name, digests, its own SHA-256
# only the format (and the items' version): loaded with a warning that nothing can be verified
DCP_LEGACY_FORMATS = ("halfprec-dcp/1",)
MANIFEST = "manifest.json"

ENGINE = "engine"
ENGINE_SHARDED = "engine-sharded"  # its optimizer a DCP directory ``optimizer/``
DCP = "dcp"  # a bare ``halfprec.distributed.checkpoint.save``
_LAYOUTS = (ENGINE, ENGINE_SHARDED, DCP)

# The files a reader of each layout opens, as globs under the checkpoint: (needed, read when present). The manifest
# must list each of them that is there, or the reader would use bytes that no digest covers.
_READS = {
    ENGINE: (("model.safetensors", "engine.pt", "optimizer.pt"), ("rng-*.pt",)),
    ENGINE_SHARDED: (("model.safetensors", "engine.pt", "optimizer/.metadata"), ("rng-*.pt", "optimizer/*")),
    DCP: ((".metadata",), ("*.distcp",)),
}


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or of another model."""


@contextlib.contextmanager
def reraised(errors: Any, what: str, kind: type[Exception] = CheckpointError) -> Iterator[None]:
    """Re-raise ``errors`` (a type or a tuple) as ``kind(f"{what}: {error}")``, chained."""
    try:
        yield
    except errors as e:
        raise kind(f"{what}: {e}") from e


@contextlib.contextmanager
def writing(file: Path) -> Iterator[None]:
    """Turn a failed write of ``file`` into a CheckpointError that names the file and the OS error under it."""
    try:
        yield
    except Exception as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"cannot write checkpoint file {file}: {reason}; nothing was published (free space or raise the "
            "file-size limit, then save again)"
        ) from e


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON, its own digest field left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    body = json.loads(json.dumps(body))  # as read back: int dict keys become strings
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of the file at ``path``, hex."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except FileNotFoundError as e:  # pruned or replaced by another process since the caller listed it
        raise CheckpointError(f"checkpoint file {path} is missing") from e


def seal(tmp: Path, tag: str, info: dict[str, Any]) -> None:
    """fsync every file under ``tmp``, then write the manifest (sizes, digests, ties, ``info``, which may set the
    format and layout)."""
    entries = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        fsync_path(path)
        entries[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    ties = {}
    if (tmp / "model.safetensors").exists():
        from safetensors import safe_open

        with safe_open(str(tmp / "model.safetensors"), framework="pt") as f:
            ties = json.loads((f.metadata() or {}).get("ties", "{}"))
    manifest = {"format": FORMAT, "layout": ENGINE, "tag": tag, "ties": ties, "files": entries, **info}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    with writing(tmp / MANIFEST):
        write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))  # fsyncs tmp too
    for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        fsync_path(sub)


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
    """:data:`ENGINE`, :data:`ENGINE_SHARDED` or :data:`DCP` for the checkpoint at ``path``; None if there is none.

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
        raise CheckpointError(f"{path / MANIFEST} names layout {layout!r}, expected one of {list(_LAYOUTS)}")
    return layout


def read_manifest(path: Path) -> dict[str, Any]:
    """Read an engine checkpoint's ``manifest.json``, verify it (:func:`_verify`) and that it lists every file its
    layout reads (:func:`_check_listed`); errors name the file."""
    manifest = _manifest_json(path)
    if _format(manifest) in (DCP_FORMAT, *DCP_LEGACY_FORMATS):
        raise CheckpointError(
            f"{path} is an optimizer checkpoint of halfprec.distributed.checkpoint.save, not an engine checkpoint: "
            "load it with halfprec.distributed.checkpoint.load(optimizer, path)"
        )
    digest = {"manifest_sha256"} & set(manifest) if isinstance(manifest, dict) else set()
    _verify(path, manifest, FORMAT, LEGACY_FORMATS, digest)
    _check_listed(path, manifest, layout_of(path, manifest))
    return manifest


_UNVERIFIED: set[str] = set()  # DCP checkpoints already warned about in this process


def read_dcp_manifest(path: Path) -> None:
    """Verify the DCP optimizer checkpoint at ``path`` as :func:`read_manifest` does; warn, once per process, for
    one written before its manifest had digests (:data:`DCP_LEGACY_FORMATS`)."""
    manifest = _manifest_json(path) if (path / MANIFEST).exists() else None
    extra = set(manifest) - {"format", "format_version"} if isinstance(manifest, dict) else set()
    if manifest is not None and (_format(manifest) not in DCP_LEGACY_FORMATS or extra):
        _verify(path, manifest, DCP_FORMAT, DCP_LEGACY_FORMATS, extra)
        _check_listed(path, manifest, DCP)
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


def _verify(path: Path, manifest: Any, current: str, legacy: tuple[str, ...], extra: set[str]) -> None:
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
    if found == current and manifest.get("manifest_sha256") != manifest_digest(manifest):
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
        if file_digest(file) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {file} is corrupted: its SHA-256 does not match the manifest"
            )


def _check_listed(path: Path, manifest: dict[str, Any], layout: str) -> None:
    """Raise unless ``manifest`` lists every file that a reader of ``layout`` opens in ``path``: those the layout
    needs, and those read when present."""
    needed, when_present = _READS[layout]
    for name in needed:
        if name not in manifest["files"]:
            raise CheckpointError(
                f"{path / MANIFEST} does not list {name}, which a checkpoint of layout {layout!r} needs, so "
                f"{path / name} cannot be verified: the manifest was edited after the save; load an intact copy of "
                "this checkpoint, or another tag"
            )
    for pattern in when_present:
        for file in sorted(path.glob(pattern)):
            if file.is_file() and file.relative_to(path).as_posix() not in manifest["files"]:
                raise CheckpointError(
                    f"{file} is not listed in {path / MANIFEST}, so it cannot be verified: it was added after the "
                    "save or its entry was removed; delete it if it is not part of the checkpoint, else load an "
                    "intact copy of this checkpoint, or another tag"
                )


def check_counters(path: Path, manifest: dict[str, Any], found: dict[str, tuple[Any, str]]) -> None:
    """Raise unless each value the manifest records equals the one read from the checkpoint's files: ``found``
    is ``{key: (value, file it was read from)}``. A manifest edited and re-sealed to say otherwise is refused
    rather than believed."""
    for key, (value, source) in found.items():
        if key in manifest and value is not None and manifest[key] != value:
            raise CheckpointError(
                f"{path / MANIFEST} says {key} is {manifest[key]!r} but {path / source} holds {value!r}: the "
                "manifest was edited after the save, so the checkpoint cannot be trusted"
            )
