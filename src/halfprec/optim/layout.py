"""The flat-buffer layout every strategy uses: one alignment (``ALIGN``), per-param offsets, local coordinates.

``Layout`` (all in elements): the *global* flat buffer holds the params back to back in the order given; a *bucket*
is a run of whole params padded to a multiple of ``world_size * PAD``, so it splits into ``world_size`` equal shards
(rank ``r`` owns shard ``r`` of each); *local* is a rank's shards of all buckets back to back: the index space of
its fp32 masters (``optim/masters.py``), grads and state. A shard may cut through a param: the part inside one
rank's shard is a *piece*.

World size 1 is the unsharded case, which the exact and fused strategies use (``optim/chunk.py``): one bucket, local
= global, every param one piece, and each param's offset ``ALIGN``-aligned (``align=True``) so the fused kernels'
blocks start and end on multiples of 16 (see ``build_table``). The sharded optimizer (params in the reverse of the
optimizer's order, roughly the order backward produces grads) packs them unaligned: its fused step's rows follow
the pieces, which shards cut anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels.slots import ALIGN

__all__ = ["ALIGN", "PAD", "aligned", "build_table", "Bucket", "Piece", "Layout"]

PAD = ALIGN  # elements per rank a sharded bucket is padded to (64 bytes of fp32 per shard boundary)


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def build_table(
    offsets: Sequence[int], sizes: Sequence[int], indices: Sequence[int], block: int, device: torch.device
) -> torch.Tensor:
    """The fused kernels' int64 [programs, 3] rows (start, end, param index) splitting every param into blocks of
    at most ``block`` elements without crossing a param boundary, so each program reads one param's scalars.
    Rows end at the param's ``ALIGN``-padded end: with block starts and ends known to be multiples of 16 the
    compiler vectorises the loads and the mask (unaligned ends made every access scalar: 1.56x the floor)."""
    rows: list[tuple[int, int, int]] = []
    for off, n, gi in zip(offsets, sizes, indices, strict=True):
        end = off + aligned(n)
        rows.extend((s, min(s + block, end), gi) for s in range(off, end, block))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(device)


@dataclass(frozen=True)
class Bucket:
    index: int
    start: int  # global offset of the bucket
    numel: int  # padded size, a multiple of world_size * PAD
    params: tuple[int, ...]  # layout indices of the params inside, in layout order
    shard: int  # numel // world_size
    local: int  # offset of this rank's shard in the local buffers

    def shard_range(self, rank: int) -> tuple[int, int]:
        begin = self.start + rank * self.shard
        return begin, begin + self.shard


@dataclass(frozen=True)
class Piece:
    param: int  # layout index of the param
    bucket: int
    lo: int  # first element of the param (flattened) held here
    hi: int  # one past the last
    local: int  # offset of element ``lo`` in the local buffers

    @property
    def numel(self) -> int:
        return self.hi - self.lo


class Layout:
    """Where every param lives in the global flat buffer, and which pieces ``rank`` owns."""

    def __init__(
        self, numels: list[int], *, world_size: int, rank: int, bucket_size: int, align: bool = False
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size!r}")
        self.numels = list(numels)
        self.world_size = world_size
        self.rank = rank
        self.offsets: list[int] = []
        self.bucket_of: list[int] = []
        self.buckets: list[Bucket] = []
        unit = world_size * PAD
        start, local, members, filled = 0, 0, [], 0

        def close() -> None:
            nonlocal start, local, members, filled
            numel = max(unit, (filled + unit - 1) // unit * unit)
            shard = numel // world_size
            self.buckets.append(Bucket(len(self.buckets), start, numel, tuple(members), shard, local))
            start, local, members, filled = start + numel, local + shard, [], 0

        for i, n in enumerate(self.numels):
            room = aligned(n) if align else n  # align: every param starts at a multiple of ALIGN
            if members and filled + room > bucket_size:
                close()
            self.offsets.append(start + filled)
            self.bucket_of.append(len(self.buckets))
            members.append(i)
            filled += room
        if members:
            close()
        self.total = start
        self.local_numel = local
        self.piece_of: dict[int, Piece] = {}
        for i, (n, off) in enumerate(zip(self.numels, self.offsets, strict=True)):
            bucket = self.buckets[self.bucket_of[i]]
            lo_g, hi_g = bucket.shard_range(rank)
            begin, end = max(off, lo_g), min(off + n, hi_g)
            if begin < end:
                self.piece_of[i] = Piece(i, bucket.index, begin - off, end - off, bucket.local + begin - lo_g)
        self.pieces = list(self.piece_of.values())  # layout order
