"""The demo's text: the source files of Python's standard library, as bytes. Every machine has them.

Why the standard library: it is real text (code, docstrings, comments), a few tens of MB, and it is already on
disk wherever Python is, so the demo downloads nothing. Its exact content differs between Python versions, so
numbers are reproducible on one machine and comparable across machines, not identical.

Determinism: files are read in sorted path order; a file goes to validation when its index in that order is
``9 mod 10`` (whole files, so validation text is never a continuation of a training file); batches are a pure
function of ``(seed, split, step)`` through a ``torch.Generator``, so resuming at step ``k`` needs only ``k``.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "load_corpus", "stdlib_files"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SPLITS = ("train", "val")


def stdlib_files() -> list[Path]:
    """The ``*.py`` files under the standard library, sorted; third-party ``site-packages`` are left out."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, subdirs, names in os.walk(root):
        # Pruned, not filtered afterwards: site-packages (torch and friends) holds most of the files.
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    if not files:
        raise RuntimeError(f"no *.py files found under {root}; the demo reads the standard library's sources")
    return sorted(files)


@dataclass(frozen=True)
class Corpus:
    """Train and validation bytes as flat ``uint8`` tensors, and the batches drawn from them."""

    train: torch.Tensor
    val: torch.Tensor
    n_files: int

    def batch(
        self, split: str, *, step: int, batch_size: int, seq_len: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, both ``(batch_size, seq_len)`` int64, ``y`` being ``x`` shifted by one byte."""
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        data = getattr(self, split)
        if data.numel() <= seq_len + 1:
            raise ValueError(f"the {split} split has {data.numel()} bytes, too few for seq_len={seq_len}")
        # A distinct, fixed 63-bit seed per (seed, split, step); Python's hash() of a str is salted per
        # process, so the split enters as a small constant instead.
        mixed = seed * 1_000_003 + _SPLITS.index(split) * 7_919 + step * 104_729
        g = torch.Generator().manual_seed(mixed % (2**63 - 1))
        starts = torch.randint(data.numel() - seq_len - 1, (batch_size,), generator=g)
        offsets = torch.arange(seq_len + 1)
        window = data[starts[:, None] + offsets].long()  # (B, T+1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def load_corpus(*, max_bytes: int | None = None) -> Corpus:
    """Read the standard library; ``max_bytes`` stops reading once that many bytes are in (tests use it)."""
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = n_read = 0
    for i, path in enumerate(stdlib_files()):
        try:
            data = path.read_bytes()
        except OSError:  # an unreadable file (permissions, a broken link) is skipped, not fatal
            continue
        (val_parts if i % 10 == 9 else train_parts).append(data)  # a 90/10 split by file
        total += len(data)
        n_read += 1
        if max_bytes is not None and total >= max_bytes and val_parts:
            break
    return Corpus(train=_as_tensor(train_parts), val=_as_tensor(val_parts), n_files=n_read)


def _as_tensor(parts: list[bytes]) -> torch.Tensor:
    # bytearray: torch.frombuffer wants a writable buffer, and copies nothing.
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
