"""Checkpoint directories: atomic writes, safetensors weights, loads that never run code from the file.

Layout of ``<dir>/<tag>/``::

    model.safetensors   the model's state dict, each shared tensor stored once (ties listed in the manifest)
    optimizer.pt        MixedPrecisionOptimizer.state_dict(): torch-format inner state, fp32 masters, scaler
    engine.pt           counters, param names, LR scheduler, RNG states, client_state
    manifest.json       written last: format, counters, ties, each file's size and SHA-256, and its own SHA-256

A save writes everything into a hidden temporary sibling, fsyncs the files and the directory, renames it to
``<tag>`` and only then replaces ``<dir>/latest`` (itself written to a temporary file and renamed). A process
killed at any point leaves the previous checkpoint and pointer intact. ``<dir>/.published`` logs every tag
``latest`` has named: a tag is immutable once published, and ``keep_last`` keeps the most recently published.
``*.pt`` files are read with ``torch.load(weights_only=True)``; the manifest's digests catch truncated or flipped
bytes, which neither ``torch.load`` nor safetensors notices.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "FORMAT",
    "check_tag",
    "read_manifest",
    "resolve",
    "write_checkpoint",
    "prepare",
    "stage",
    "seal",
    "commit",
    "publish",
    "load_weights",
    "load_pt",
    "rng_state",
    "set_rng_state",
    "check_plain",
]

FORMAT = "halfprec-checkpoint/2"  # /2: the manifest carries its own SHA-256
_LEGACY_FORMATS = ("halfprec-checkpoint/1",)  # still loaded (without the manifest's self-digest)
MANIFEST = "manifest.json"
LATEST = "latest"
PUBLISHED = ".published"  # the tags ``latest`` has named, oldest first, one per line (hidden: not a tag)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or of another model."""


# --- writing ---------------------------------------------------------------------------------------------
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON, its own digest field left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    body = json.loads(json.dumps(body))  # as read back: int dict keys become strings
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TAG_RULE = (
    "a tag is a str of at most 200 letters, digits, '.', '_' and '-', starting with a letter or digit (no "
    "spaces, path separators or glob characters), and not 'latest'"
)


def check_tag(tag: Any) -> str:
    """Return ``tag`` if it is a valid checkpoint tag, else raise ValueError naming it and the rule.

    Tags become directory names next to ``latest`` and hidden ``.<tag>.tmp-*`` siblings, so they must be plain
    names: a space would not survive the ``latest`` pointer, a ``/`` would leave the directory, a ``*`` would make
    the cleanup of one tag's temporaries match another's. An int is refused rather than converted, so that
    ``tag=0`` cannot be mistaken for "no tag".
    """
    if not isinstance(tag, str):
        raise ValueError(
            f"invalid checkpoint tag {tag!r} of type {type(tag).__name__}: {_TAG_RULE}; e.g. tag=f'step-{{n}}'"
        )
    if tag == LATEST or len(tag) > 200 or not _TAG.fullmatch(tag):
        raise ValueError(f"invalid checkpoint tag {tag!r}: {_TAG_RULE}; use a plain name such as 'step-100'")
    return tag


def _split_ties(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Store each shared tensor once: ``{name: tensor}`` without aliases, and ``{alias: stored_name}``."""
    stored: dict[str, torch.Tensor] = {}
    ties: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tensor.shape,
            tensor.stride(),
            tensor.dtype,
        )
        if tensor.numel() and key in seen:
            ties[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = tensor.detach().to("cpu").contiguous()
    # safetensors refuses tensors that still share memory (overlapping views of one buffer): give them their own
    ptrs: dict[int, str] = {}
    for name, tensor in list(stored.items()):
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in ptrs:
            stored[name] = tensor.clone()
        ptrs[ptr] = name
    return stored, ties


def write_checkpoint(
    directory: str | os.PathLike,
    tag: str,
    *,
    weights: dict[str, torch.Tensor],
    files: dict[str, Any],
    info: dict[str, Any],
    overwrite: bool = False,
    keep_last: int | None = None,
) -> Path:
    """Write ``<directory>/<tag>`` atomically and point ``latest`` at it; returns the checkpoint's path.

    ``weights`` go to model.safetensors; each item of ``files`` to ``<name>.pt`` with ``torch.save``; ``info``
    (plain JSON values) into the manifest. ``overwrite=True`` replaces an existing tag: that removal and
    rename is not atomic, since a directory cannot be renamed onto a non-empty one.
    """
    root, final = prepare(directory, tag, overwrite=overwrite, keep_last=keep_last)
    tmp = root / f".{tag}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        stage(tmp, weights=weights, files=files)
        seal(tmp, tag, info)
        commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(root, tag, keep_last)
    return final


def prepare(
    directory: str | os.PathLike, tag: str, *, overwrite: bool, keep_last: int | None
) -> tuple[Path, Path]:
    """Check the arguments of a save; returns ``(root, final)``. Raises before anything is written.

    A save killed after its rename but before ``latest`` was replaced leaves a complete ``<tag>`` that ``latest``
    never named; the restarted run reaches the same tag again, so such an unpublished directory (not in the
    ``.published`` log) is moved aside with a warning instead of blocking it. A published tag is immutable.
    Temporary directories of killed saves of this tag are removed.
    """
    root = Path(directory)
    final = root / check_tag(tag)
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
    if final.exists() or final.is_symlink():
        if not _is_checkpoint_of(final, tag):
            raise FileExistsError(
                f"{final} exists and is not a halfprec checkpoint (no {MANIFEST} of format {FORMAT!r} for tag "
                f"{tag!r}); nothing was written, moved or removed: choose another tag or directory, or remove "
                f"{final} yourself"
            )
        if not overwrite and _unpublished(root, final):
            aside = root / f".{tag}.unpublished-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            warnings.warn(
                f"{final} was written by a save that did not finish (latest does not point at it); moved it to "
                f"{aside} and saving again",
                RuntimeWarning,
                stacklevel=3,
            )
        elif not overwrite:
            raise FileExistsError(
                f"checkpoint {final} already exists and tags are immutable; pick another tag or pass "
                "overwrite=True"
            )
    if root.is_dir():
        for stale in root.glob(f".{glob.escape(tag)}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    return root, final


def _is_checkpoint_of(path: Path, tag: str) -> bool:
    """True for a directory that a halfprec save of ``tag`` renamed into place: its manifest says so.

    The manifest is written last inside the temporary directory, before the rename, so every directory a halfprec
    save ever put at ``<dir>/<tag>`` has one; anything else there is the user's and must not be moved or replaced.
    """
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(manifest, dict)
        and manifest.get("format") in (FORMAT, *_LEGACY_FORMATS)
        and manifest.get("tag") == tag
    )


def stage(tmp: Path, *, weights: dict[str, torch.Tensor] | None, files: dict[str, Any]) -> None:
    """Write the weights (safetensors) and ``<name>.pt`` files into the temporary directory ``tmp``."""
    from safetensors.torch import save_file

    if weights is not None:
        stored, ties = _split_ties(weights)
        save_file(stored, str(tmp / "model.safetensors"), metadata={"format": "pt", "ties": json.dumps(ties)})
    for name, obj in files.items():
        torch.save(obj, tmp / f"{name}.pt")


def seal(tmp: Path, tag: str, info: dict[str, Any]) -> None:
    """fsync every file under ``tmp`` and write the manifest (sizes, digests, ties) last."""
    entries = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync_path(path)
        entries[path.relative_to(tmp).as_posix()] = {"size": path.stat().st_size, "sha256": _digest(path)}
    ties = {}
    if (tmp / "model.safetensors").exists():
        from safetensors import safe_open

        with safe_open(str(tmp / "model.safetensors"), framework="pt") as f:
            ties = json.loads((f.metadata() or {}).get("ties", "{}"))
    manifest = {"format": FORMAT, "tag": tag, "ties": ties, "files": entries, **info}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        _fsync_path(sub)
    _fsync_path(tmp)


def commit(tmp: Path, final: Path) -> None:
    """Rename the sealed ``tmp`` to ``final`` (replacing an existing one: not atomic) and fsync the parent."""
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(final.parent)


def publish(root: Path, tag: str, keep_last: int | None) -> None:
    """Point ``latest`` at ``tag`` (atomically), log the publication, then prune to the ``keep_last`` most
    recently published checkpoints."""
    # read first: a directory without a log yet is seeded from what it held before this save
    before = [t for t in _published(root) if t != tag]
    _write_latest(root, tag)
    log = root / PUBLISHED
    lines = [] if log.exists() else before
    with open(log, "a+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                lines.insert(0, "")  # end a torn last line before appending
        f.write("".join(t + "\n" for t in [*lines, tag]))
        f.flush()
        os.fsync(f.fileno())
    if keep_last is not None:
        _prune(root, keep_last, keep=tag)


def _published(root: Path) -> list[str]:
    """Tags in publication order, the one ``latest`` names last. A directory written before the log existed
    gets the rule that wrote it: its checkpoints up to ``latest``'s step were published, in step order."""
    pointer = root / LATEST
    latest = pointer.read_text().strip() if pointer.exists() else None
    try:
        tags = [line.strip() for line in (root / PUBLISHED).read_text().splitlines() if line.strip()]
    except OSError:
        tags = _legacy_published(root, latest)
    return [t for t in tags if t != latest] + ([latest] if latest else [])


def _legacy_published(root: Path, latest: str | None) -> list[str]:
    def step_of(path: Path) -> int | None:
        try:
            return int(json.loads((path / MANIFEST).read_text())["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    if latest is None:
        return []
    limit = step_of(root / latest)
    found = []
    for path in root.iterdir():
        step = step_of(path) if not path.name.startswith(".") and _is_checkpoint_of(path, path.name) else None
        if step is not None and limit is not None and step <= limit:
            found.append((step, path.name))
    return [name for _, name in sorted(found)]


def _unpublished(root: Path, final: Path) -> bool:
    """A complete ``<tag>`` that a save renamed into place but never published (killed before ``latest``)."""
    return final.name not in _published(root)


def _write_latest(root: Path, tag: str) -> None:
    tmp = root / f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_path(root)


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """Remove halfprec checkpoints but the ``keep_last`` most recently published (after a rewind, the
    checkpoints of the abandoned branch go first, whatever their step numbers)."""
    order = {tag: i for i, tag in enumerate(_published(root))}  # a tag's last publication counts
    found = sorted(
        (order.get(path.name, -1), path.name)
        for path in root.iterdir()
        if not path.name.startswith(".") and _is_checkpoint_of(path, path.name)
    )
    for _, name in found[:-keep_last]:
        if name != keep:
            shutil.rmtree(root / name)


# --- reading ---------------------------------------------------------------------------------------------
def resolve(directory: str | os.PathLike, tag: str | None = None, *, tag_option: str = "tag=") -> Path:
    """The checkpoint directory for ``tag``, or the one ``latest`` points at. Also accepts a tag directory.

    ``tag_option`` is how the caller's user names a tag (``"--tag"`` on the command line), for the error hints.
    """
    root = Path(directory)
    if tag is None and (root / MANIFEST).exists():
        return root
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist")
    if tag is None:
        pointer = root / LATEST
        if not pointer.exists():
            tags = _tags_in(root)
            if not tags:
                raise CheckpointError(
                    f"no checkpoint in {root}: no {LATEST} pointer and no tag directory with a {MANIFEST}; pass "
                    "the directory that save_checkpoint() wrote to"
                )
            raise CheckpointError(
                f"no checkpoint in {root}: {pointer} does not exist; pass {tag_option} with one of: "
                f"{', '.join(tags)}"
            )
        tag = pointer.read_text().strip()
        try:
            check_tag(tag)
        except ValueError as e:
            raise CheckpointError(
                f"{pointer} is damaged: {e}; pass {tag_option} with one of: {', '.join(_tags_in(root)) or '(none)'}"
            ) from e
    path = root / check_tag(tag)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist; checkpoints in {root}: {', '.join(_tags_in(root)) or '(none)'}"
        )
    return path


def _tags_in(root: Path, limit: int = 10) -> list[str]:
    """Names of the checkpoint directories in ``root`` (at most ``limit``), for error messages."""
    try:
        tags = sorted(
            p.name for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()
        )
    except OSError:
        return []
    return tags[:limit] + ([f"... ({len(tags) - limit} more)"] if len(tags) > limit else [])


def read_manifest(path: Path, *, verify: bool = True) -> dict[str, Any]:
    """Read ``manifest.json`` and check every file's size and digest; errors name the file."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"{manifest_path} is missing: the checkpoint is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{manifest_path} is corrupted: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, *_LEGACY_FORMATS):
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{manifest_path} has format {found!r}, expected {FORMAT!r}")
    if manifest["format"] == FORMAT and manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointError(
            f"{manifest_path} is corrupted: its contents do not match the SHA-256 it was written with"
        )
    if verify:
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
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    for alias, name in manifest.get("ties", {}).items():
        weights[alias] = weights[name]
    return weights


def load_pt(path: Path, name: str) -> Any:
    file = path / f"{name}.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot load {file} with weights_only=True: {e}") from e


# --- plain data ------------------------------------------------------------------------------------------
def check_plain(value: Any, where: str = "client_state") -> None:
    """Raise unless ``value`` is made of tensors, numbers, strings, None, lists, tuples and str-keyed dicts."""
    # exact types: a numpy float is a float subclass that torch.load(weights_only=True) refuses
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ValueError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise ValueError(
        f"{where} is a {type(value).__name__}; checkpoints hold plain data only (tensors, numbers, strings, "
        "lists, dicts) so that loading never runs code: convert it, e.g. with .state_dict() or int()"
    )


def rng_state() -> dict[str, Any]:
    """Python, torch CPU/CUDA and numpy RNG states as tensors and plain values (loadable weights_only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
        )
