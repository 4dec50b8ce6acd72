"""fp32 masters in one flat buffer, in a ``Layout``'s local coordinates: fp32 values, or split masters.

Every strategy keeps its masters here: the exact and fused strategies per chunk (``optim/chunk.py``: a world-size-1
layout), the sharded optimizer for its rank's shards. ``param`` is the global flat 16-bit param buffer that the
model's params view; or ``params``, each param's own 16-bit tensor by layout index, read and written in place
(FSDP2's local shards, which live in storage FSDP2 owns); or neither, where there are no 16-bit params to write
(the exact strategy's params; fp32 params, which are their own masters).

Split masters (``masters="split"``: bf16 params in a flat buffer or their own; ``optim/split.py``): no fp32 buffer;
``low`` holds the low 16 bits of the masters and the high half is the rank's part of the params (the master rounded
ties away).
The update kernels read and write both, so an all-gather moves the params as with fp32 masters. The sharded
optimizer's ``pieces`` (1-D fp32 Parameters the wrapped torch optimizer holds: state keys, param groups) then view
no values of their own (one fp32 element, expanded): ``join()`` points them at a temporary fp32 buffer of the
masters they represent, which a checkpoint reads or loads into and ``restore()`` splits back; ``release()`` frees
it, before anything changes the masters.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .layout import Bucket, Layout, Piece
from .split import join_master, split_master, store_split

__all__ = ["MASTERS", "Masters", "check_masters"]

MASTERS = ("fp32", "split")  # master storages: fp32 buffers, or split (bf16 param + low 16 bits)


def check_masters(masters: Any, dtypes: Iterable[torch.dtype | None] = ()) -> None:
    """ValueError unless ``masters`` is a master storage (``MASTERS``) that params of ``dtypes`` can use."""
    if masters not in MASTERS:
        raise ValueError(f"masters must be one of {MASTERS}, got {masters!r}")
    if masters == "split" and torch.float16 in set(dtypes):
        raise ValueError(
            "masters='split' keeps exact fp32 masters only for bf16 params, got torch.float16 params: fp16's "
            "exponent range is narrower than fp32's, so its split is not exact; use masters='fp32' (or bf16)"
        )


class Masters:
    """``fp32`` (fp32 masters) or ``low`` (split) over ``layout``'s local coordinates, and the moves between them
    and the 16-bit params (``param`` or ``params``)."""

    @torch.no_grad()
    def __init__(
        self, layout: Layout, sources: dict[int, torch.Tensor], *, param: torch.Tensor | None, split: bool,
        device: torch.device, params: Sequence[torch.Tensor] | None = None,
    ) -> None:  # fmt: skip
        """``sources``: the best fp32 value of each param by layout index (any shape; a param without one takes
        its 16-bit weight from ``param`` or ``params``, so without them every piece needs one). ``params``: each
        param's own contiguous 16-bit tensor, by layout index (instead of ``param``)."""
        if param is not None and params is not None:
            raise ValueError(
                "the 16-bit params are a flat buffer (param) or tensors of their own (params), not both"
            )
        if split and param is None and params is None:
            raise ValueError(
                "split masters keep their high halves in the 16-bit params (a flat param buffer or each param's own "
                "tensor), and none was given"
            )
        self.layout = layout
        self.param = param
        self.params = None if params is None else list(params)
        self.device = device
        self.fp32: torch.Tensor | None = None
        self.low: torch.Tensor | None = None
        self.joined: torch.Tensor | None = None  # split: the fp32 values the pieces view, while held
        self.pieces: dict[int, torch.nn.Parameter] = {}
        numel = layout.local_numel
        if split:
            self.low = torch.zeros(numel, dtype=torch.int16, device=device)
            for i, source in sources.items():  # every rank rounds every param the same way (ties away)
                high, low = split_master(source.detach().to(device, torch.float32).reshape(-1))
                self._whole(i).copy_(high)
                if (pc := layout.piece_of.get(i)) is not None:
                    self.low[pc.local : pc.local + pc.numel].copy_(low[pc.lo : pc.hi])
        else:  # without an fp32 source the master is the 16-bit weight (split: its low half is 0)
            self.fp32 = torch.zeros(numel, dtype=torch.float32, device=device)
            for pc in layout.pieces:
                if pc.param in sources:
                    source = sources[pc.param].detach().reshape(-1)[pc.lo : pc.hi]
                else:
                    source = self._whole(pc.param)[pc.lo : pc.hi]
                self.fp32[pc.local : pc.local + pc.numel].copy_(source)

    @property
    def kernel_buffer(self) -> torch.Tensor:
        """The master buffer as the update kernels take it (an int16 one: split, ``PARAM`` 3)."""
        return self.fp32 if self.low is None else self.low

    def shards(self) -> Iterator[tuple[Bucket, int, int]]:
        """``(bucket, lo, hi)``: this rank's shard of every bucket in the global flat buffer."""
        for b in self.layout.buckets:
            yield (b, *b.shard_range(self.layout.rank))

    def point_params(self, params: Sequence[torch.Tensor]) -> None:
        """The params' own tensors moved (FSDP2 gave its shards new storage): read and write ``params`` from now
        on."""
        if self.params is None or len(params) != len(self.params):
            raise ValueError(f"{len(params)} params to point at, and these masters hold no list of that size")
        self.params = list(params)

    def _whole(self, i: int) -> torch.Tensor:
        # param i's 16-bit values, flat: a slice of the global buffer, or a view of its own tensor
        if self.params is not None:
            return self.params[i].view(-1)
        start = self.layout.offsets[i]
        return self.param[start : start + self.layout.numels[i]]

    def _runs(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``(local offset, 16-bit values)`` covering this rank's params: its shard of each bucket of ``param``
        (padding included), or each piece of a param's own tensor; none without 16-bit params."""
        if self.param is not None:
            for b, lo, hi in self.shards():
                yield b.local, self.param[lo:hi]
        elif self.params is not None:
            for pc in self.layout.pieces:
                yield pc.local, self._whole(pc.param)[pc.lo : pc.hi]

    # --- the pieces ----------------------------------------------------------------------------------------
    def make_pieces(self) -> dict[int, torch.nn.Parameter]:
        """A 1-D fp32 Parameter over each of this rank's pieces, by layout index (split: see the module)."""
        self.pieces = {
            pc.param: torch.nn.Parameter(self._piece_view(pc), requires_grad=True)
            for pc in self.layout.pieces
        }
        return self.pieces

    def _piece_view(self, pc: Piece) -> torch.Tensor:
        flat = self.fp32 if self.low is None else self.joined
        if flat is None:  # split and not joined: no values
            return torch.zeros((), dtype=torch.float32, device=self.device).expand(pc.numel)
        return flat[pc.local : pc.local + pc.numel]

    def _point_pieces(self) -> None:
        for pc in self.layout.pieces:
            if pc.param in self.pieces:
                self.pieces[pc.param].data = self._piece_view(pc)

    # --- the fp32 values -----------------------------------------------------------------------------------
    @torch.no_grad()
    def join(self) -> torch.Tensor:
        """This rank's fp32 masters (split: joined into a fresh buffer the pieces view until ``release``)."""
        if self.low is None:
            return self.fp32
        self.release()
        self.joined = torch.zeros(self.layout.local_numel, dtype=torch.float32, device=self.device)
        for start, values in self._runs():
            low = self.low[start : start + values.numel()]
            self.joined[start : start + values.numel()].copy_(join_master(values, low))
        self._point_pieces()
        return self.joined

    def release(self) -> None:
        """Split: drop the joined buffer (the pieces view one expanded element again)."""
        if self.joined is not None:
            self.joined = None
            self._point_pieces()

    @torch.no_grad()
    def load(self, masters: torch.Tensor) -> None:
        """Set the masters to the fp32 ``masters`` (local coordinates): copied, or split into the param shards
        (rounded ties away) and the low halves."""
        if self.low is None:
            self.fp32.copy_(masters)
            return
        for start, values in self._runs():
            local = slice(start, start + values.numel())
            store_split(masters[local], values, self.low[local])

    def restore(self) -> None:
        """Split: keep what was written into the joined pieces (a checkpoint load) and release them."""
        if self.joined is not None:
            self.load(self.joined)
            self.release()

    # --- the 16-bit params ---------------------------------------------------------------------------------
    @torch.no_grad()
    def round_into_params(self) -> None:
        """fp32 masters: round them into this rank's part of the params, to nearest even (split: the params are
        their high halves already; no 16-bit params: nothing to round into)."""
        if self.fp32 is not None:
            for start, values in self._runs():
                values.copy_(self.fp32[start : start + values.numel()])

    @torch.no_grad()
    def reset(self) -> None:
        """The masters become this rank's part of the params exactly (split: the low halves become 0)."""
        self.release()
        if self.low is not None:
            self.low.zero_()
            return
        for start, values in self._runs():
            self.fp32[start : start + values.numel()].copy_(values)
