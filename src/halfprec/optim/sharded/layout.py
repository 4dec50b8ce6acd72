"""Flat-buffer layout of a sharded optimizer: buckets, per-rank shard ranges and the param pieces they hold.

Coordinates (all in elements):

* global flat: the 16-bit param buffer that every rank holds whole; params sit back to back in layout order
  (the reverse of the optimizer's param order, which approximates the order backward produces grads);
* a bucket is a contiguous run of whole params, padded at its end to a multiple of ``world_size * PAD``
  so it splits into ``world_size`` equal shards; rank ``r`` owns shard ``r`` of every bucket;
* local: a rank's shards of all buckets, back to back: the index space of its fp32 masters, fp32 grads and
  optimizer state. A shard may cut through params: the part of a param inside one rank's shard is a *piece*.

Pure Python, no process group: the unit tests build layouts for any world size.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PAD", "Bucket", "Piece", "Layout"]

PAD = 16  # elements per rank a bucket is padded to (64 bytes of fp32 per shard boundary)


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

    def __init__(self, numels: list[int], *, world_size: int, rank: int, bucket_size: int) -> None:
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
            if members and filled + n > bucket_size:
                close()
            self.offsets.append(start + filled)
            self.bucket_of.append(len(self.buckets))
            members.append(i)
            filled += n
        if members:
            close()
        self.total = start
        self.local_numel = local
        self.pieces: list[Piece] = []
        self.piece_of: dict[int, Piece] = {}
        for i, n in enumerate(self.numels):
            bucket = self.buckets[self.bucket_of[i]]
            lo_g, hi_g = bucket.shard_range(rank)
            begin, end = max(self.offsets[i], lo_g), min(self.offsets[i] + n, hi_g)
            if begin < end:
                piece = Piece(
                    i,
                    bucket.index,
                    begin - self.offsets[i],
                    end - self.offsets[i],
                    bucket.local + begin - lo_g,
                )
                self.pieces.append(piece)
                self.piece_of[i] = piece

    def offset_in_bucket(self, i: int) -> int:
        return self.offsets[i] - self.buckets[self.bucket_of[i]].start
