"""Checkpoint directories: atomic writes, safetensors weights, a manifest of digests (docs/checkpoints.md).

Layout of ``<dir>/<tag>/``::

    model.safetensors   the model's state dict, each shared tensor stored once (ties listed in the manifest)
    optimizer/          the optimizer, reshardable: a DCP directory (``checkpoint.dcp``) with its own manifest
      (or optimizer.pt) in checkpoints of layout ``engine``: MixedPrecisionOptimizer.state_dict()
    engine.pt           counters, param names, LR scheduler, client_state (layout ``engine``: RNG states too)
    rng-<rank>.pt       each rank's RNG states
    manifest.json       written last (``manifest.seal``): counters, ties, each file's size and SHA-256, ...

``<dir>/.published`` logs every tag ``latest`` has named (published tags are immutable; ``keep_last`` keeps the
most recent).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._checks import is_int
from .atomic import commit, fsync_path, held, recover, remove_leftovers, tmp_dir, unique_suffix
from .manifest import FORMAT, LEGACY_FORMATS, MANIFEST, peek_manifest, seal, writing

__all__ = [
    "LATEST",
    "check_tag",
    "check_directory",
    "write_checkpoint",
    "saving",
    "locked",
    "reading",
    "stage",
    "save_pt",
    "save_safetensors",
    "read_latest",
]

LATEST = "latest"
PUBLISHED = ".published"  # the tags ``latest`` has named, oldest first, one per line (hidden: not a tag)
LOCK = ".lock"  # held by every save into the directory (``locked``)

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TAG_RULE = (
    "a tag is a str of at most 200 letters, digits, '.', '_' and '-', starting with a letter or digit (no "
    "spaces, path separators or glob characters), and not 'latest'"
)


def check_tag(tag: Any) -> str:
    """``tag`` if it is a valid checkpoint tag, else ValueError. A space would not survive the ``latest`` pointer,
    a ``/`` would leave the directory, a ``*`` would make the cleanup of one tag's temporaries match another's; an
    int is refused, not converted, so that ``tag=0`` cannot be mistaken for "no tag"."""
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
    ptrs: set[int] = set()
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if t.numel() and key in seen:
            ties[name] = seen[key]
            continue
        seen[key] = name
        tensor = t.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        # safetensors refuses tensors that share memory (overlapping views of one buffer): give each its own
        stored[name] = tensor.clone() if tensor.numel() and ptr in ptrs else tensor
        ptrs.add(ptr)
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
    """Write ``<directory>/<tag>`` atomically and point ``latest`` at it: ``weights`` to model.safetensors, each
    item of ``files`` to ``<name>.pt``, ``info`` (plain JSON values) into the manifest."""
    with saving(directory, tag, overwrite=overwrite, keep_last=keep_last) as tmp:
        stage(tmp, weights=weights, files=files)
        seal(tmp, tag, info)
    return Path(directory) / tag


@contextlib.contextmanager
def saving(
    directory: str | os.PathLike,
    tag: str,
    *,
    overwrite: bool,
    keep_last: int | None,
    tmp_name: str | None = None,
) -> Iterator[Path]:
    """Under the directory's lock, :func:`_prepare`, then yield a new temporary directory to :func:`stage` and
    :func:`manifest.seal`; on success commit it to ``<directory>/<tag>`` and :func:`_publish` it, on error remove it.
    ``tmp_name`` is a fixed name for it, for a save whose other ranks must know where to write."""
    root, final = _checked(directory, tag, keep_last)
    _refuse_foreign(final)  # before the lock file is made: such a save writes nothing
    with locked(root):
        _prepare(root, final, overwrite=overwrite)
        with tmp_dir(root / (tmp_name or f".{tag}.tmp-{unique_suffix()}")) as tmp:
            yield tmp
            commit(tmp, final, replace=overwrite)
        _publish(root, tag, keep_last)


def _lock(root: Path):
    from filelock import FileLock

    return FileLock(os.fspath(root / LOCK))


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """Hold ``<root>/.lock`` exclusively: the saves into one directory run one at a time, across processes, so
    nothing a save checks in :func:`_prepare` changes before its commit, and pruning sees every publication.
    The kernel releases the OS lock when its holder dies, so a killed save never blocks the next one."""
    root.mkdir(parents=True, exist_ok=True)
    with _lock(root):
        yield


@contextlib.contextmanager
def reading(root: Path) -> Iterator[None]:
    """Hold ``<root>/.lock`` while one process verifies and reads a checkpoint in ``root``, so that a save cannot
    swap files between the digest check and the read. A read-only directory, where nothing can save either, is
    read without it. Not for a collective load, whose ranks would wait for each other under the lock."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(_lock(root))
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
        yield


def check_directory(directory: str | os.PathLike) -> Path:
    """``directory`` as a Path, unless it is ``''`` (ValueError): ``Path('')`` would silently mean the current
    directory."""
    if not os.fspath(directory):
        raise ValueError(
            "checkpoint directory is '' (it would write into the current directory); pass a directory such as "
            "'checkpoints' (or '.' to mean the current directory)"
        )
    return Path(directory)


def _checked(directory: str | os.PathLike, tag: str, keep_last: int | None) -> tuple[Path, Path]:
    root = check_directory(directory)
    final = root / check_tag(tag)
    if keep_last is not None and (not is_int(keep_last) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
    return root, final


def _prepare(root: Path, final: Path, *, overwrite: bool) -> None:
    """Check a save under :func:`locked` (raising before anything is written), undo a replace of this tag that
    died midway, remove leftovers. A save killed between its rename and ``latest`` leaves a ``<tag>`` that
    ``latest`` never named: the rerun reaches that tag again, so it is moved aside with a warning (removed at
    the next save) rather than blocking it."""
    recover(final)
    _refuse_foreign(final)
    unpublished = not overwrite and (final.exists() or final.is_symlink())
    if unpublished and final.name in _published(root):
        raise FileExistsError(
            f"checkpoint {final} already exists and tags are immutable; pick another tag or pass "
            "overwrite=True"
        )
    _remove_leftovers(root)
    if unpublished:
        aside = root / f".{final.name}.unpublished-{unique_suffix()}"
        os.rename(final, aside)
        warnings.warn(
            f"{final} was written by a save that did not finish (latest does not point at it); moved it to "
            f"{aside} (removed at the next save) and saving again",
            RuntimeWarning,
            stacklevel=5,
        )


def _refuse_foreign(final: Path) -> None:
    if (final.exists() or final.is_symlink()) and not _is_checkpoint_of(final, final.name):
        raise FileExistsError(
            f"{final} exists and is not a halfprec checkpoint (no {MANIFEST} of format {FORMAT!r} for tag "
            f"{final.name!r}); nothing was written, moved or removed: choose another tag or directory, or "
            f"remove {final} yourself"
        )


# what killed saves leave: temporaries (held while in use), trash of a replace, moved-aside unpublished tags
_LEFTOVER = re.compile(r"\.[A-Za-z0-9][A-Za-z0-9._-]*\.(?:tmp-(?:[0-9a-f]{8}|sharded)|trash-[0-9a-f]{8})")
_UNPUBLISHED = re.compile(r"\.([A-Za-z0-9][A-Za-z0-9._-]*)\.unpublished-[0-9a-f]{8}")


def _remove_leftovers(root: Path) -> None:
    """Remove what killed saves left in ``root`` (unheld temporaries, trash) and the tags moved aside earlier."""
    remove_leftovers(root, _LEFTOVER)
    for entry in root.iterdir():
        match = _UNPUBLISHED.fullmatch(entry.name)
        if match and _is_checkpoint_of(entry, match.group(1)):
            shutil.rmtree(entry, ignore_errors=True)


def _is_checkpoint_of(path: Path, tag: str) -> bool:
    """True for a directory that a halfprec save of ``tag`` renamed into place: its manifest (written before
    the rename) says so. Anything else there is the user's and must not be moved or replaced."""
    if path.is_symlink() or not path.is_dir():
        return False
    manifest = peek_manifest(path) or {}
    return manifest.get("format") in (FORMAT, *LEGACY_FORMATS) and manifest.get("tag") == tag


def stage(tmp: Path, *, weights: dict[str, torch.Tensor] | None, files: dict[str, Any]) -> None:
    """Write the weights (safetensors) and ``<name>.pt`` files into the temporary directory ``tmp``."""
    if weights is not None:
        stored, ties = _split_ties(weights)
        save_safetensors(stored, tmp / "model.safetensors", {"format": "pt", "ties": json.dumps(ties)})
    for name, obj in files.items():
        save_pt(obj, tmp / f"{name}.pt")


def save_safetensors(tensors: dict[str, torch.Tensor], file: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` with the mode the umask gives (safetensors writes 0600)."""
    from safetensors.torch import save_file

    with writing(file):
        save_file(tensors, str(file), metadata=metadata)
    os.chmod(file, _file_mode(file.parent))


def _file_mode(directory: Path) -> int:
    """The mode a new file gets in ``directory`` (``0o666`` under the umask and default ACLs), found by making
    one: reading the umask through ``os.umask`` would change it for every thread for a moment."""
    probe = directory / f".mode-probe-{unique_suffix()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o7777
    finally:
        os.close(fd)
        probe.unlink()


def save_pt(obj: Any, file: Path) -> None:
    """``torch.save(obj, file)`` through a Python file object, so that a full disk or a file-size limit surfaces
    as the OS error (torch's writer says ``unexpected pos 2560 vs 2452``), named by :func:`manifest.writing`."""
    with writing(file), open(file, "wb") as f:
        torch.save(obj, f)


def _publish(root: Path, tag: str, keep_last: int | None) -> None:
    """Point ``latest`` at ``tag`` atomically, log it, prune to the ``keep_last`` most recently published."""
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
    latest = read_latest(root)
    if latest is not None and not _TAG.fullmatch(latest):
        latest = None  # a damaged pointer names no tag; this save replaces it
    try:
        tags = [line.strip() for line in (root / PUBLISHED).read_text().splitlines() if line.strip()]
    except OSError:
        tags = _legacy_published(root, latest)
    return [t for t in tags if t != latest] + ([latest] if latest else [])


def read_latest(root: Path) -> str | None:
    """The text of ``<root>/latest`` (None when there is none). Bytes that are not UTF-8 (a damaged pointer) come
    back as U+FFFD, which no tag holds, so that the caller's tag check names the damage."""
    try:
        return (root / LATEST).read_bytes().decode(errors="replace").strip()
    except FileNotFoundError:
        return None


def _legacy_published(root: Path, latest: str | None) -> list[str]:
    def step_of(path: Path) -> int | None:
        try:
            return int((peek_manifest(path) or {})["global_step"])
        except (ValueError, KeyError, TypeError):
            return None

    limit = None if latest is None else step_of(root / latest)
    if limit is None:
        return []
    steps = {name: step_of(root / name) for name in _checkpoints(root)}
    return [name for step, name in sorted((s, n) for n, s in steps.items() if s is not None and s <= limit)]


def _checkpoints(root: Path) -> list[str]:
    return [p.name for p in root.iterdir() if not p.name.startswith(".") and _is_checkpoint_of(p, p.name)]


def _write_latest(root: Path, tag: str) -> None:
    tmp = root / f".{LATEST}.tmp-{unique_suffix()}"
    with open(tmp, "w") as f, held(tmp):
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    fsync_path(root)


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """Remove halfprec checkpoints but the ``keep_last`` most recently published (after a rewind, the
    checkpoints of the abandoned branch go first, whatever their step numbers)."""
    order = {tag: i for i, tag in enumerate(_published(root))}  # a tag's last publication counts
    found = sorted((order.get(name, -1), name) for name in _checkpoints(root))
    for _, name in found[:-keep_last]:
        if name != keep:
            with contextlib.suppress(FileNotFoundError):  # removed by hand meanwhile: pruned all the same
                shutil.rmtree(root / name)
