"""A chunk: the params of one device and dtype in a world-size-1 ``Layout`` (``optim/layout.py``), with their
masters (``optim/masters.py``), grads and optimizer state in flat buffers; and ``MasterStore``, the exact strategy's
chunks with the model-param <-> master mapping. The exact and fused strategies keep their params here, the sharded
optimizer keeps its rank's shards of the same layout model at world size N.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from ..kernels import interpreted
from .layout import ALIGN, Layout, aligned, build_table
from .masters import Masters
from .mesh import is_dtensor, local
from .split import join_master, store_split

__all__ = ["Chunk", "MasterStore", "UpdateRows", "chunk_params", "interpreter_reason", "written_in_place"]


def written_in_place(p: torch.Tensor) -> bool:
    """Whether the fused kernels write ``p`` where it lives, not in a flat buffer: FSDP2's 16-bit shards
    (``Chunk``'s docstring)."""
    return is_dtensor(p) and p.dtype != torch.float32


def interpreter_reason(params: Iterable[torch.Tensor]) -> str | None:
    """Why Triton's interpreter cannot run the fused step over ``params`` (None when it can): it copies each
    launch's tensors of another device to the host and back, and the shards written in place are reached by
    address, not passed, so the kernels would write host memory where no shard lives."""
    dev = next((p.device for p in params if written_in_place(p) and p.device.type != "cpu"), None)
    if dev is None or not interpreted():
        return None
    return (
        f"the fused kernels write FSDP2's 16-bit shards in place, and Triton's interpreter (TRITON_INTERPRET=1) "
        f"copies {dev.type} tensors to the host, where the shards are not"
    )


class UpdateRows(NamedTuple):
    """One launch of the update kernel over a chunk whose params are written in place (``Chunk.update_rows``)."""

    table: torch.Tensor  # int64 [rows, 3]: start, end, param index (layout.build_table's rows)
    aligned: bool  # every row's start, end and shift are multiples of ALIGN
    shift: torch.Tensor  # int64 per row: elements from the row's offset in the chunk to its param's address


class Chunk:
    """The params of one device and dtype, laid out flat at ``ALIGN``-padded offsets, and their fp32 masters.

    ``data``: the fp32 masters, filled from ``sources`` (each param's best fp32 value), with ``master_views``;
    ``param``: with ``flat_params``, the 16-bit buffer the params' ``.data`` become views of (fp32 params, their
    own masters, become views of ``data``); ``grad`` (``make_grad``) and ``state`` (``add_state``): made at the
    first grad and update. Padding is zero in every buffer and an update keeps it zero.

    ``masters="split"`` (bf16 params with ``flat_params``; ``optim/split.py``): no ``data``; the master is ``param``
    (its value rounded to nearest, ties away) plus ``low``, its low 16 bits (int16): 2 bytes per param instead of 4.
    ``master``/``load_master``/``reset_masters`` read and write either storage.

    FSDP2's shards (DTensors) live in storage FSDP2 owns and all-gathers from, so they cannot become views of a
    flat buffer. 16-bit shards are written ``in_place``: no ``param``; the update kernel takes ``anchor`` as its
    param buffer and each row of ``update_rows`` carries the shift from its offset in the chunk to its shard's
    address (a flat address space: CUDA's, or the CPU's for Triton's interpreter, which reads CPU tensors where
    they are), and split masters keep their high halves in the shards. The addresses are taken at construction
    and by ``point_params``; ``moved`` tells when FSDP2 or the user gave a shard new storage since. fp32 shards,
    their own masters, are ``staged``: ``data`` is a copy, which ``copy_out()`` writes back after an update.
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], sources: Sequence[torch.Tensor], *,
        flat_params: bool = False, masters: str = "fp32",
    ) -> None:  # fmt: skip
        self.params = list(params)
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        shapes = [local(p).shape for p in self.params]  # a DTensor's local shard (optim/mesh.py)
        numels = [s.numel() for s in shapes]
        self.layout = Layout(
            numels, world_size=1, rank=0, bucket_size=sum(map(aligned, numels)) or 1, align=True
        )
        self.offsets = self.layout.offsets
        self.numel = self.layout.total  # the total padded size
        # each param's (shape, contiguous strides, offset): one as_strided call makes its view of a flat buffer,
        # where a slice and a view take two (a chunk's grad views are made at every step after zero_grad())
        self._geometry = [
            (shape, torch.empty(shape, device="meta").stride(), off)
            for shape, off in zip(shapes, self.offsets, strict=True)
        ]
        split = masters == "split" and self.dtype != torch.float32  # fp32 params are their own masters
        self.param: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []
        self.state: dict[str, torch.Tensor] = {}
        shards = flat_params and is_dtensor(self.params[0])  # FSDP2's (see the class docstring)
        self.in_place = flat_params and written_in_place(self.params[0])
        self.staged = shards and not self.in_place
        # in place: the kernel's param base pointer, and the shards' addresses the shifts were taken from
        self.anchor: torch.Tensor | None = None
        self.param_ptrs: list[int | None] = []
        self.update_rows: list[UpdateRows] = []  # in place: the update kernel's launches (plan_updates)
        self._plan: tuple[Sequence[int], int] | None = None
        with torch.no_grad():
            if flat_params and self.dtype != torch.float32 and not self.in_place:
                self.param = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
                for p, view in zip(self.params, self.views(self.param), strict=True):
                    view.copy_(local(p))
            # split: the param becomes its master rounded ties away
            values = {k: local(src) for k, src in enumerate(sources)}
            own = [local(p) for p in self.params] if self.in_place else None
            self.masters = Masters(
                self.layout, values, param=self.param, params=own, split=split, device=self.device
            )
            self.master_views = [] if self.data is None else self.views(self.data)
            if flat_params and not shards:
                for p, view in zip(self.params, self.views(self.weights), strict=True):
                    p.data = view
        if self.in_place:
            self.anchor = torch.zeros(1, dtype=self.dtype, device=self.device)
            self.param_ptrs = self._shard_ptrs()

    @property
    def weights(self) -> torch.Tensor:
        """The flat buffer of the params' values: the 16-bit ``param``, or for fp32 params ``data``."""
        return self.data if self.param is None else self.param

    def _shard_ptrs(self) -> list[int | None]:
        # an empty shard (a rank that holds no rows) is never written: its address is not checked
        return [(t.data_ptr() if t.numel() else None) for t in map(local, self.params)]

    def moved(self) -> int | None:
        """In place: the index of the first param whose shard no longer lives where the kernel writes it."""
        for k, (p, ptr) in enumerate(zip(self.params, self.param_ptrs, strict=True)):
            if ptr is not None and local(p).data_ptr() != ptr:
                return k
        return None

    def point_params(self) -> bool:
        """In place: write the shards where they live now (FSDP2 gives a shard new storage on
        ``model.to_empty()``), and their values are the 16-bit params from now on (split masters: the high
        halves). True when one had moved."""
        if not self.in_place or self.moved() is None:
            return False
        for p, n in zip(self.params, self.layout.numels, strict=True):
            t = local(p)
            if t.device != self.device or t.dtype != self.dtype or t.numel() != n or not t.is_contiguous():
                raise RuntimeError(
                    f"the FSDP2 shard of the param of shape {tuple(p.shape)} is now {t.numel()} {t.dtype} elements "
                    f"on {t.device}{'' if t.is_contiguous() else ', not contiguous'}; the optimizer writes {n} "
                    f"contiguous {self.dtype} elements on {self.device} in place: keep the model's shards as they "
                    "were when the optimizer was built, or build a new optimizer"
                )
        self.masters.point_params([local(p) for p in self.params])
        self.param_ptrs = self._shard_ptrs()
        if self._plan is not None:
            self.plan_updates(*self._plan)
        return True

    def plan_updates(self, indices: Sequence[int], block: int) -> None:
        """In place: ``update_rows`` for ``indices`` (as in ``table``). Each param's rows stop at its end, not at
        the padded one (the padding is not the shard's); they are ``aligned`` up to its last multiple of ``ALIGN``
        when its shift is one too, and the rest (a tail, or every row of a shard at an odd address) run unaligned."""
        if not self.in_place:
            return
        self._plan = (indices, block)
        base, size = self.anchor.data_ptr(), self.anchor.element_size()
        rows: tuple[list, list] = ([], [])
        shifts: tuple[list, list] = ([], [])
        for off, n, gi, ptr in zip(self.offsets, self.layout.numels, indices, self.param_ptrs, strict=True):
            if ptr is None:
                continue
            assert (ptr - base) % size == 0, (ptr, base)
            shift = (ptr - base) // size - off
            cut = off + (n // ALIGN * ALIGN if shift % ALIGN == 0 else 0)
            for which, lo, hi in ((0, off, cut), (1, cut, off + n)):
                starts = range(lo, hi, block)
                rows[which].extend((s, min(s + block, hi), gi) for s in starts)
                shifts[which].extend(shift for _ in starts)
        self.update_rows = [
            UpdateRows(
                torch.tensor(r, dtype=torch.int64).reshape(-1, 3).to(self.device),
                which == 0,
                torch.tensor(s, dtype=torch.int64).to(self.device),
            )
            for which, (r, s) in enumerate(zip(rows, shifts, strict=True))
            if r
        ]

    @torch.no_grad()
    def copy_out(self) -> None:
        """Staged chunks (fp32 FSDP2 shards): write the masters into the shards (else the params are views of the
        flat buffers, or written in place)."""
        if self.staged:
            torch._foreach_copy_([local(p) for p in self.params], self.views(self.weights))

    @torch.no_grad()
    def copy_in(self) -> None:
        """Staged chunks: take the shards' current values into the masters (after a weights-only load)."""
        if self.staged:
            torch._foreach_copy_(self.views(self.weights), [local(p) for p in self.params])

    def take_own_masters(self) -> None:
        """Staged fp32 chunks: the shards are the masters (fp32 params are their own), so whatever wrote them
        since (a load into the model, a DCP load) is what the masters hold: copied in before they are read."""
        if self.staged and self.param is None:
            self.copy_in()

    @property
    def data(self) -> torch.Tensor | None:
        """The fp32 masters (None: split)."""
        return self.masters.fp32

    @property
    def low(self) -> torch.Tensor | None:
        """Split masters: their low 16 bits (int16; else None)."""
        return self.masters.low

    def kernel_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(param, master) as the update kernels take them: fp32 chunks are their own params; in place, the param
        is ``anchor`` (with ``update_rows``' shifts); split chunks pass ``low`` as the master
        (``kernels.update.param_arg`` reads the storage from its dtype)."""
        master = self.masters.kernel_buffer
        if self.in_place:
            return self.anchor, master
        return (master if self.param is None else self.param), master

    def master(self, k: int) -> torch.Tensor:
        """Param ``k``'s fp32 master: a view of ``data``, or for split masters a joined copy (writing to it
        changes nothing: use ``load_master``)."""
        if self.low is None:
            return self.master_views[k]
        return join_master(self._param_view(k), self.view(self.low, k))

    def load_master(self, k: int, value: torch.Tensor) -> None:
        """Set param ``k``'s master to ``value`` exactly (split: its param and low half; else ``data`` only, the
        param is rounded by ``round_params``)."""
        if self.low is None:
            self.master_views[k].copy_(value)
        else:
            store_split(value, self._param_view(k), self.view(self.low, k))

    def round_params(self) -> None:
        """Round the fp32 masters into the 16-bit params (to nearest even); split params already are theirs."""
        self.masters.round_into_params()

    def reset_masters(self) -> None:
        """The masters become the current 16-bit params exactly (after an external weights-only load)."""
        self.masters.reset()

    def _param_view(self, k: int) -> torch.Tensor:
        # param k's 16-bit values: its view of the flat param, or in place its shard
        return local(self.params[k]) if self.in_place else self.view(self.param, k)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        base = flat.storage_offset()
        return [flat.as_strided(shape, stride, base + off) for shape, stride, off in self._geometry]

    def view(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        shape, stride, off = self._geometry[k]
        return flat.as_strided(shape, stride, flat.storage_offset() + off)

    def make_grad(self, dtype: torch.dtype) -> None:
        self.grad = torch.zeros(self.numel, dtype=dtype, device=self.device)
        self.grad_views = self.views(self.grad)

    def free_grad(self) -> None:
        """Drop the grad buffer and its views (its memory goes with the last view held elsewhere)."""
        self.grad = None
        self.grad_views = []

    def add_state(self, name: str) -> None:
        if name not in self.state:
            self.state[name] = torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def table(self, indices: Sequence[int], block: int) -> torch.Tensor:
        """``indices``: this chunk's params' indices in the kernels' per-param arrays; the sizes are the layout's
        (an FSDP2 shard's: its local rows)."""
        return build_table(self.offsets, self.layout.numels, indices, block, self.device)


def chunk_params(
    params: Sequence[torch.nn.Parameter], sources: Sequence[torch.Tensor], *, flat_params: bool = False,
    masters: str = "fp32",
) -> list[tuple[Chunk, list[int]]]:  # fmt: skip
    """One ``Chunk`` per (device, dtype) in first-seen order, each with the indices in ``params`` of its params."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    placed = []
    for idx in groups.values():
        chunk = Chunk(
            [params[i] for i in idx], [sources[i] for i in idx], flat_params=flat_params, masters=masters
        )
        placed.append((chunk, idx))
    return placed


class MasterStore:
    """All master chunks of one optimizer, and the mapping between model params and their masters."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        # per chunk: the Parameters the inner optimizer steps
        self.masters: list[list[torch.nn.Parameter]] = []

    def add(self, params: Iterable[torch.nn.Parameter], originals: dict[torch.Tensor, torch.Tensor]) -> dict:
        """``{param: master}`` for new masters of ``params`` from ``originals[p]`` (else ``p``)."""
        params = list(params)
        mapping = {}
        for chunk, _ in chunk_params(params, [originals.get(p, p) for p in params]):
            masters = [torch.nn.Parameter(v, requires_grad=True) for v in chunk.master_views]
            self.chunks.append(chunk)
            self.masters.append(masters)
            mapping.update(zip(chunk.params, masters, strict=True))
        return mapping

    def master_params(self) -> list[torch.nn.Parameter]:
        return [m for masters in self.masters for m in masters]

    def model_params(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.params]

    def check_devices(self) -> None:
        for chunk in self.chunks:
            for p in chunk.params:
                if p.device != chunk.device:
                    raise RuntimeError(
                        f"a param of shape {tuple(p.shape)} is on {p.device} but its FP32 master is on "
                        f"{chunk.device}: the model moved after the optimizer was wrapped. Move the model to its "
                        "device first, then build and wrap the optimizer (halfprec does not move masters and "
                        "optimizer state behind your back)"
                    )

    def copy_grads_in(self) -> list[torch.Tensor]:
        """Point each master's ``.grad`` at its fp32 view, filled from the model grad (or None); return the filled
        ones (still scaled)."""
        filled_dst: list[torch.Tensor] = []
        filled_src: list[torch.Tensor] = []
        for chunk, masters in zip(self.chunks, self.masters, strict=True):
            if chunk.grad is None:
                chunk.make_grad(torch.float32)
            for p, m, view in zip(chunk.params, masters, chunk.grad_views, strict=True):
                m.grad = None if p.grad is None else view
                if p.grad is not None:
                    filled_dst.append(view)
                    filled_src.append(local(p.grad))
        if filled_dst:
            torch._foreach_copy_(filled_dst, filled_src)
        return filled_dst

    @torch.no_grad()
    def add_grad(self, c: int, k: int, grad: torch.Tensor) -> None:
        """Add the 16-bit ``grad`` into master ``k`` of chunk ``c``'s fp32 grad: a copy, or one fp32 rounding."""
        chunk, m = self.chunks[c], self.masters[c][k]
        if chunk.grad is None:
            chunk.make_grad(torch.float32)
        if m.grad is None:
            m.grad = chunk.grad_views[k]
            m.grad.copy_(grad)
        else:
            m.grad.add_(grad)

    @torch.no_grad()
    def clear_grads(self, set_to_none: bool = True) -> None:
        """What ``torch.optim.Optimizer.zero_grad`` does to the masters' grads: a zeroed grad is still a grad, so
        its master is stepped (momentum and decay move it), as torch steps a param whose grad was zeroed."""
        for m in self.master_params():
            if set_to_none or m.grad is None:
                m.grad = None
            else:
                m.grad.zero_()

    @torch.no_grad()
    def copy_params_out(self) -> None:
        """Round every master into its model param (to nearest even)."""
        params, masters = self.model_params(), self.master_params()
        if params:
            torch._foreach_copy_([local(p.data) for p in params], masters)

    @torch.no_grad()
    def refresh_from_params(self) -> None:
        params, masters = self.model_params(), self.master_params()
        if params:
            torch._foreach_copy_(masters, [local(p.data) for p in params])
