"""The one directory commit of every checkpoint format, crash-safe, and the removal of leftovers no writer holds.

POSIX ``rename`` cannot replace a non-empty directory, so :func:`commit` replaces one in two renames: the existing
``final`` goes to ``.<name>.replaced`` (found again by :func:`located` for readers and by :func:`recover` for the
next save), then ``tmp`` becomes ``final``.

A writer holds an exclusive ``flock(2)`` on its temporary file or directory while it uses it (:func:`held`); the
kernel drops it when the process dies, so :func:`remove_if_dead` removes a leftover only if it can take that lock
without waiting. The lock is on the leftover itself: a lock file would add an entry to every checkpoint directory,
whose listing tests pin.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "fsync_path",
    "write_synced",
    "commit",
    "recover",
    "located",
    "held",
    "tmp_dir",
    "remove_if_dead",
    "remove_leftovers",
    "unique_suffix",
]

_REPLACED = ".{}.replaced"
_TRASH = ".{}.trash-"


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(file.parent)


def unique_suffix() -> str:
    """The random part of every temporary name (8 hex digits): leftovers are recognised by it."""
    return uuid.uuid4().hex[:8]


def _aside(final: Path) -> Path:
    return final.with_name(_REPLACED.format(final.name))


def commit(tmp: Path, final: Path, *, replace: bool = True) -> None:
    """Rename the complete directory ``tmp`` to ``final``; with ``replace=False`` an existing ``final`` (written
    since the caller checked) is a FileExistsError."""
    aside = _aside(final)
    recover(final)
    if final.exists() or final.is_symlink():
        if not replace:
            raise FileExistsError(
                f"{final} appeared while this save was writing and was kept; nothing was published: pick another "
                "tag, or pass overwrite=True to replace it"
            )
        if aside.exists():  # a commit died after its second rename: final is newer, the aside is garbage
            _discard(final)
        os.rename(final, aside)
        fsync_path(final.parent)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if aside.exists():
        _discard(final)


def recover(final: Path) -> None:
    """Undo a replace that died between its two renames: put the complete ``.<name>.replaced`` back."""
    aside = _aside(final)
    if not (final.exists() or final.is_symlink()) and aside.is_dir():
        os.rename(aside, final)
        fsync_path(final.parent)


def located(final: Path) -> Path:
    """Where the checkpoint named ``final`` is: ``final``, or its complete aside if a replace died midway."""
    if final.exists() or final.is_symlink():
        return final
    aside = _aside(final)
    return aside if aside.is_dir() else final


def _discard(final: Path) -> None:
    """Remove ``final``'s aside, renaming it out of the way first so that a crash never leaves it half-removed."""
    trash = final.with_name(_TRASH.format(final.name) + unique_suffix())
    os.rename(_aside(final), trash)
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def held(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file or directory ``path``: :func:`remove_if_dead` will not touch it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # a filesystem without flock: then no cleaner can lock it either
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def tmp_dir(path: Path) -> Iterator[Path]:
    """Make the directory ``path`` and hold it (:func:`held`) while the caller fills it; remove what is left of it
    (all of it on error, nothing once the caller has renamed it) at the end."""
    path.mkdir()
    try:
        with held(path):
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_if_dead(path: Path) -> bool:
    """Remove the leftover ``path`` if no live process holds it (:func:`held`); True if it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its writer is alive (or this filesystem has no flock: nothing can be proved dead)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return not (path.exists() or path.is_symlink())
    finally:
        os.close(fd)


def remove_leftovers(root: Path, pattern: re.Pattern[str]) -> None:
    """Remove the entries of ``root`` whose name fully matches ``pattern`` and that no live writer holds (trash
    whether held or not: nothing reads it, its writer only deletes it)."""
    try:
        entries = [entry for entry in root.iterdir() if pattern.fullmatch(entry.name)]
    except OSError:
        return
    for entry in entries:
        if ".trash-" in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
        else:
            remove_if_dead(entry)
