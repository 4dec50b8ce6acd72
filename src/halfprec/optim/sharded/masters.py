"""This rank's fp32 masters for the sharded optimizer, in local coordinates: an fp32 buffer, or split masters.

Split masters (``masters="split"``, bf16 params, the fused local step; ``optim/split.py``): no fp32 buffer; the
rank keeps ``low``, the low 16 bits of its shards' masters, and the high half is its shard of the global flat
16-bit param buffer (the master rounded ties away). The update kernel reads and writes both, so the all-gather
moves the params as with fp32 masters. The pieces the inner optimizer holds (state keys, param groups) then view
no values of their own (one fp32 element, expanded): ``join()`` points them at a temporary fp32 buffer of the
masters they represent, which a checkpoint reads or loads into and ``restore()`` splits back; ``release()``
frees it, before anything changes the masters.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..layout import Bucket, Layout
from ..split import join_master, split_master, store_split

__all__ = ["ShardMasters"]


class ShardMasters:
    """``fp32`` (fp32 masters) or ``low`` (split), the pieces over them, and the moves between them and
    ``param``, the global flat 16-bit param buffer."""

    def __init__(
        self, layout: Layout, param: torch.Tensor, sources: dict[int, torch.Tensor], *, split: bool
    ) -> None:
        """``sources``: the best fp32 value of each param by layout index (else its 16-bit weight is used)."""
        self.layout = layout
        self.param = param
        self.device = param.device
        self.fp32: torch.Tensor | None = None
        self.low: torch.Tensor | None = None
        self.joined: torch.Tensor | None = None  # split: the fp32 values the pieces view, while held
        numel = layout.local_numel
        if split:
            self.low = torch.zeros(numel, dtype=torch.int16, device=self.device)
            for i, source in sources.items():  # every rank rounds every param the same way (ties away)
                high, low = split_master(source.detach().to(self.device, torch.float32).reshape(-1))
                param[layout.offsets[i] : layout.offsets[i] + high.numel()].copy_(high)
                if (pc := layout.piece_of.get(i)) is not None:
                    self.low[pc.local : pc.local + pc.numel].copy_(low[pc.lo : pc.hi])
        else:  # without an fp32 source the master is the 16-bit weight (split: its low half is 0)
            self.fp32 = torch.zeros(numel, dtype=torch.float32, device=self.device)
            for pc in layout.pieces:
                weight = param[layout.offsets[pc.param] + pc.lo : layout.offsets[pc.param] + pc.hi]
                source = sources[pc.param].reshape(-1)[pc.lo : pc.hi] if pc.param in sources else weight
                self.fp32[pc.local : pc.local + pc.numel].copy_(source)
        self.pieces = {
            pc.param: torch.nn.Parameter(self._piece_view(pc), requires_grad=True) for pc in layout.pieces
        }

    @property
    def kernel_buffer(self) -> torch.Tensor:
        """The master buffer as the update kernel takes it (an int16 one: split, ``PARAM`` 3)."""
        return self.fp32 if self.low is None else self.low

    def _piece_view(self, pc) -> torch.Tensor:
        flat = self.fp32 if self.low is None else self.joined
        if flat is None:  # split and not joined: no values
            return torch.zeros((), dtype=torch.float32, device=self.device).expand(pc.numel)
        return flat[pc.local : pc.local + pc.numel]

    def shards(self) -> Iterator[tuple[Bucket, int, int]]:
        """``(bucket, lo, hi)``: this rank's shard of every bucket in the global flat buffer."""
        for b in self.layout.buckets:
            yield (b, *b.shard_range(self.layout.rank))

    # --- the fp32 values -----------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self) -> torch.Tensor:
        """This rank's fp32 masters (split: joined into a fresh buffer the pieces view until ``release``)."""
        if self.low is None:
            return self.fp32
        self.release()
        self.joined = torch.empty(self.layout.local_numel, dtype=torch.float32, device=self.device)
        for b, lo, hi in self.shards():
            low = self.low[b.local : b.local + b.shard]
            self.joined[b.local : b.local + b.shard].copy_(join_master(self.param[lo:hi], low))
        self._point_pieces()
        return self.joined

    def release(self) -> None:
        """Split: drop the joined buffer (the pieces view one expanded element again)."""
        if self.joined is not None:
            self.joined = None
            self._point_pieces()

    def _point_pieces(self) -> None:
        for pc in self.layout.pieces:
            self.pieces[pc.param].data = self._piece_view(pc)

    @torch.no_grad()
    def load(self, masters: torch.Tensor) -> None:
        """Set the masters to the fp32 ``masters`` (local coordinates): copied, or split into the param shards
        (rounded ties away) and the low halves."""
        if self.low is None:
            self.fp32.copy_(masters)
            return
        for b, lo, hi in self.shards():
            local = slice(b.local, b.local + b.shard)
            store_split(masters[local], self.param[lo:hi], self.low[local])

    def restore(self) -> None:
        """Split: keep what was written into the joined pieces (a checkpoint load) and release them."""
        if self.joined is not None:
            self.load(self.joined)
            self.release()

    # --- the 16-bit params ---------------------------------------------------------------------------------
    @torch.no_grad()
    def round_into_params(self) -> None:
        """fp32 masters: round them into this rank's shards of the params (split: the params are their high
        halves already)."""
        if self.fp32 is not None:
            for b, lo, hi in self.shards():
                self.param[lo:hi].copy_(self.fp32[b.local : b.local + b.shard])

    @torch.no_grad()
    def reset(self) -> None:
        """The masters become this rank's shards of the params exactly (split: the low halves become 0)."""
        self.release()
        if self.low is not None:
            self.low.zero_()
            return
        for b, lo, hi in self.shards():
            self.fp32[b.local : b.local + b.shard].copy_(self.param[lo:hi])
