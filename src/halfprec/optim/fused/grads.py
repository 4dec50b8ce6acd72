"""Which params of a fused optimizer got a grad this step, with their grads kept as views of the flat grad buffers.

A post-accumulate-grad hook marks the param and, when ``.grad`` is not its view of the flat grad buffer (the
first backward, or after ``zero_grad(set_to_none=True)``/``model.zero_grad()``), has the fresh grad copied into the
view and the view re-attached as ``.grad``. Outside graph capture, ``step()`` also adopts a ``.grad`` assigned by
hand and unmarks params whose ``.grad`` was set to None. An unmarked param is not updated and its counter does not
advance.

On CUDA each small op is a launch, and at ~150 params a step is paced by the host, so a hook launches nothing:
- The copies are batched: a hook holds the fresh grad back (``.grad`` stays that tensor, so later hooks read and
  edit it), and ``flush`` copies the held grads with one multi-tensor copy per chunk when they reach
  ``_BATCH_BYTES`` (which bounds the memory they keep alive) and at the end of the backward. A copy per param was
  148 launches a step for a 16-layer Llama.
- The marks live on the host in ``_marked`` (what ``step()`` reads without a sync) and in ``flags`` (int32 per
  param, on the device), which the finalize program reads and clears. A hook marks the host; at the end of the
  backward one copy writes every changed mark to the device (a write per param was 147 launches).
The first hook of a backward queues that end-of-backward callback with autograd's engine. So outside a backward
the flat buffers hold the grads and the device holds the host's marks, as a CUDA graph captured next expects; a
backward that raised leaves both to the next ``step()``, and a captured step after it refuses. Once a graph was
captured (``pinned``) the hooks copy and write the device mark every time: a replay runs no Python.

The hook is the backward's hottest Python (once per param per backward; a step can be host-bound): it runs with
grad mode off, except in a ``create_graph=True`` backward, which alone pays for ``torch.no_grad()``.

With ``accum_dtype=torch.float32`` a 16-bit chunk's grad buffer is fp32: the hook copies a param's first grad of
the step into its fp32 view, adds later ones (one fp32 rounding each, in micro-batch order) and releases the
16-bit ``.grad``; the view becomes the ``.grad`` of the param's fp32 master (split masters have none: the buffer
alone holds the sum). The marks are the accumulation: a step or ``zero_grad`` clears them, so the next grad starts
a new sum whoever clears ``.grad``.

A chunk's flat grad buffer lives from the first grad of a step (or the step, for a chunk that got none) to
``zero_grad(set_to_none=True)``, which frees it with every view, so the next forward runs without it (2 B/param,
4 with fp32 accumulation). ``zero_grad(set_to_none=False)`` keeps it, zeroed; a step keeps it (and ``.grad``) until
then; ``model.zero_grad()`` cannot reach it, so it stays and the next backward reuses it. Once a backward, step or
``zero_grad`` was captured in a CUDA graph the buffers stay for good: the graph reads their addresses.

ZeRO-0 (``process_group=``, ``optim/accumulate.py``): at the step, ``all_reduce`` zeroes the views of params that got
no grad on this rank, replaces each flat fp32 buffer by the mean over the ranks of their sums and sums the marks
(a mark on any rank marks the param on every rank), on the device, without a host sync.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..accumulate import all_reduce_mean
from ..chunk import Chunk
from ..mesh import as_dtensor, is_dtensor, local_grad
from ..results import Delivered, weak_hook

__all__ = ["GradViews", "stream_capturing"]

# Fresh grads a backward holds back for one batched copy: 16-bit grads arrive one tensor per param, and a copy each
# was a launch each on CUDA (148 a step for a 16-layer Llama). The bound caps the memory they keep alive.
_BATCH_BYTES = 64 * 2**20


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class GradViews:
    """The grad marks of ``params``; ``where[i]`` is param ``i``'s (chunk, position in the chunk)."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], where: Sequence[tuple[Chunk, int]], device: torch.device,
        accum_dtype: torch.dtype | None = None, delivered: Delivered | None = None,
    ) -> None:  # fmt: skip
        self.params = list(params)
        self.delivered = delivered  # FSDP2 with fp32 sums: the backwards the hooks saw (results.Delivered)
        # FSDP2's shards: .grad is a DTensor, whose local tensor is read and becomes a view of the flat buffer
        self._dtensor = [is_dtensor(p) for p in self.params]
        self.accum_dtype = accum_dtype
        # the params whose grads are added into a wider buffer and released (fp32 params accumulate in .grad)
        self._accumulates = [accum_dtype not in (None, chunk.dtype) for chunk, _ in where]
        self.where = list(where)
        self.flags = torch.zeros(max(len(self.params), 1), dtype=torch.int32, device=device)
        self._flag_views = self.flags.unbind()  # made once: indexing flags costs each hook a view
        self._cuda = self.flags.is_cuda
        self._marked = [False] * len(self.params)
        self._on_device = [False] * len(self.params)  # what flags holds, but during all_reduce and finalize
        # got a grad since the last zero_grad(set_to_none=True): zero_grad(set_to_none=False) keeps it a (zero)
        # grad, which torch steps (momentum and decay move the param)
        self._had_grad = [False] * len(self.params)
        self._callback: weakref.ref | None = None  # this backward's queued write of the marks
        # fresh grads whose copy waits for flush(), with the stream their hook ran on (on CUDA)
        self._held_back: dict[int, tuple[torch.Tensor, Any]] = {}
        self._held_bytes = 0
        # the storages they keep alive, each counted once (FSDP2's sharded grads of one group share one)
        self._held_storages: set[int] = set()
        # where each param's grad view starts, once its chunk's grad buffer is made: one int compare per param in
        # adopt(), which is host time on a skipped step
        self._view_ptrs: list[int | None] = [None] * len(self.params)
        # the params are views of the flat buffers; FSDP2's shards are not: the chunk knows where it writes them
        # (in place) or copies into them at the step (staged)
        self._param_ptrs = [
            None if chunk.staged or chunk.in_place else p.data_ptr()
            for p, (chunk, _) in zip(self.params, where, strict=True)
        ]
        self._in_place = list({id(chunk): chunk for chunk, _ in where if chunk.in_place}.values())
        # the masters whose .grad is their fp32 sum (fp32 accumulation), which a step lets go of
        self._summed_masters = [
            chunk.master_views[local]
            for (chunk, local), summed in zip(where, self._accumulates, strict=True)
            if summed and chunk.master_views
        ]
        self.pinned = False  # a CUDA graph holds the grad buffers' addresses: zero_grad no longer frees them
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(weak_hook(self._hook, i))

    def _pin_if_capturing(self) -> bool:
        """``pinned``, set now if a CUDA graph is being captured: the graph writes the grad buffers and marks."""
        if not self.pinned and self._cuda and torch.cuda.is_current_stream_capturing():
            self.pinned = True
        return self.pinned

    def views(self, chunk: Chunk) -> list[torch.Tensor]:
        """The chunk's grad views, its flat grad buffer made at the first grad it gets in a step."""
        if chunk.grad is None:
            chunk.make_grad(self.accum_dtype or chunk.dtype)
            for i, (c, local) in enumerate(self.where):
                if c is chunk:
                    self._view_ptrs[i] = chunk.grad_views[local].data_ptr()
        return chunk.grad_views

    def _attach(self, i: int, view: torch.Tensor) -> None:
        """Make ``view`` param ``i``'s ``.grad`` (a DTensor laid out like an FSDP2 shard's)."""
        p = self.params[i]
        p.grad = as_dtensor(p, view) if self._dtensor[i] else view

    def _hook(self, i: int) -> None:
        """Backward's post-accumulate-grad hook: mark param ``i``; its copy into the flat buffer may wait for a
        batched one, and the device marks are written at the end of the backward."""
        if self.delivered is not None:
            self.delivered.fire(i)
        if self.mark(i, batched=True) and (self._callback is None or self._callback() is None):
            callback = self.end_of_backward  # a new bound method: autograd's engine holds the only reference
            self._callback = weakref.ref(callback)
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    def end_of_backward(self) -> None:
        self.flush()
        self.write_marks()

    def mark(self, i: int, batched: bool = False) -> bool:
        """Param ``i`` got a grad: make ``.grad`` its view of the flat buffer (copying a fresh tensor in; with
        ``batched``, in ``flush``), or add it into its fp32 view and release it. True when the device mark is left
        to ``write_marks``."""
        if torch.is_grad_enabled():  # a create_graph=True backward, or a call from outside a backward
            with torch.no_grad():
                return self.mark(i, batched)
        p, (chunk, local) = self.params[i], self.where[i]
        if p.dtype != chunk.dtype:
            return False  # cast after the optimizer was built: step() refuses it (checks.check_dtypes)
        pinned = self._pin_if_capturing()  # before the buffer is made: a captured backward makes it
        view = (self.views(chunk) if chunk.grad is None else chunk.grad_views)[local]
        g = local_grad(p) if self._dtensor[i] else p.grad
        if self._accumulates[i]:
            view.add_(g) if self._marked[i] else view.copy_(g)
            p.grad = None
            if chunk.master_views:  # split masters have no fp32 master tensor to hold it
                chunk.master_views[local].grad = view
        elif g is not None and g.data_ptr() != view.data_ptr():
            if batched and not pinned:
                # .grad stays the fresh tensor until the flush. Its hook's stream made it: the copy runs there,
                # as a copy in the hook would (the end of the backward may run on another stream)
                self._held_back[i] = (p.grad, torch.cuda.current_stream() if self._cuda else None)
                storage = g.untyped_storage()  # what it keeps alive (.grad may be a slice of a shared one)
                if storage.data_ptr() not in self._held_storages:
                    self._held_storages.add(storage.data_ptr())
                    self._held_bytes += storage.nbytes()
                if self._held_bytes >= _BATCH_BYTES:
                    self.flush()
            else:
                self._held_back.pop(i, None)  # of a backward that raised
                view.copy_(g)
                self._attach(i, view)
        self._marked[i] = True
        self._had_grad[i] = True
        if pinned:
            self._flag_views[i].fill_(1)
            self._on_device[i] = True
        return not pinned

    def flush(self) -> None:
        """Copy the fresh grads held back into their views, one batched copy per chunk, and make each view its
        param's ``.grad`` (unless ``.grad`` was replaced since: ``adopt`` sees to that one)."""
        if not self._held_back:
            return
        groups: dict[tuple[int, Any], tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = {}
        for i, (g, stream) in self._held_back.items():
            if self.params[i].grad is g:
                chunk, local = self.where[i]
                idx, views, grads = groups.setdefault((id(chunk), stream), ([], [], []))
                idx.append(i)
                views.append(chunk.grad_views[local])
                grads.append(local_grad(self.params[i]))
        self._held_back, self._held_bytes, self._held_storages = {}, 0, set()
        current = torch.cuda.current_stream(self.flags.device) if self._cuda else None  # the step's device
        with torch.no_grad():
            for (_, stream), (idx, views, grads) in groups.items():
                elsewhere = stream != current
                with torch.cuda.stream(stream) if elsewhere else contextlib.nullcontext():
                    torch._foreach_copy_(views, grads)  # one dtype and device: the multi-tensor kernel
                if elsewhere:
                    current.wait_stream(stream)  # the step (and the rest of this backward) reads the views
                for i, view in zip(idx, views, strict=True):
                    self._attach(i, view)

    def write_marks(self) -> None:
        """Write the host's marks to ``flags`` where they differ (one copy; none in a step like the last). Not
        during capture: a captured backward's hooks write their own marks."""
        if self._marked != self._on_device:
            n = len(self._marked)
            # from pinned memory: a copy from pageable memory may wait for the stream; torch's host allocator
            # keeps the pinned block until the copy has run
            marks = torch.tensor(self._marked, dtype=torch.int32, pin_memory=self._cuda)
            self.flags[:n].copy_(marks, non_blocking=True)
            self._on_device = list(self._marked)

    def held(self, i: int) -> torch.Tensor | None:
        """The grad param ``i`` holds now: its ``.grad`` (a shard's local tensor), or with fp32 accumulation its
        fp32 sum so far."""
        p = self.params[i]
        if p.grad is not None or not (self._accumulates[i] and self._marked[i]):
            return local_grad(p)
        chunk, local = self.where[i]
        return chunk.grad_views[local]

    def on_device(self, chunks: Sequence[Chunk]) -> bool:
        """Whether the flat buffers and the device's marks already hold this step's grads as the host knows them:
        every chunk has its grad buffer, no fresh grad waits for its copy and the device holds the host's marks
        (so a kernel that reads them now reads what the step will, unless ``adopt`` then changes something)."""
        return (
            not self._held_back
            and self._marked == self._on_device
            and all(c.grad is not None for c in chunks)
        )

    def adopt(self, owner: str) -> bool:
        """Mark grads assigned by hand and unmark params whose ``.grad`` was set to None (``owner``: the
        optimizer's name, for the error when a param no longer lives in the flat buffer). True when it changed a
        grad buffer or a mark."""
        changed = bool(self._held_back)
        self.flush()  # of a backward that raised before its end
        for chunk in self._in_place:
            if (k := chunk.moved()) is not None:
                raise RuntimeError(
                    f"the FSDP2 shard of the param of shape {tuple(chunk.params[k].shape)} no longer lives where "
                    f"{owner} writes it (given new storage by model.to_empty() or a .data assignment after the "
                    "optimizer was built), so its updates would not reach the model; call refresh_masters() to "
                    "take the shards' current values as the masters, or load_state_dict(), or build the "
                    "optimizer after the model is on its final device"
                )
        for i, p in enumerate(self.params):
            if self._param_ptrs[i] is not None and p.data_ptr() != self._param_ptrs[i]:
                raise RuntimeError(
                    f"the param of shape {tuple(p.shape)} no longer lives in {owner}'s flat buffer "
                    "(replaced by model.to(), .half()/.float(), load_state_dict(assign=True) or a .data "
                    "assignment after the optimizer was built), so its updates would not reach the model; "
                    "build the optimizer after the model is in its final dtype and device"
                )
            g = local_grad(p) if self._dtensor[i] else p.grad
            if g is None and self._marked[i] and not self._accumulates[i]:
                self._marked[i] = False
                changed = True
            elif g is not None and g.data_ptr() != self._view_ptrs[i]:
                self.mark(i)
                changed = True
        if self.delivered is not None:
            self.delivered.check()
        return changed

    def ready(self, chunks: Sequence[Chunk], *, capturing: bool) -> None:
        """Before a step's kernels: every chunk has its grad buffer (zero where no grad came). A captured step
        cannot make one (the graph would zero it at every replay) and pins them."""
        if not capturing:
            for chunk in chunks:
                self.views(chunk)
            self.write_marks()  # those adopt() changed, or of a backward that raised before its end
            return
        missing = [str(chunk.dtype) for chunk in chunks if chunk.grad is None]
        if missing:
            raise RuntimeError(
                f"step() is being captured in a CUDA graph, but the flat grad buffer of the {', '.join(missing)} "
                "params was freed by zero_grad(set_to_none=True) and no grad came since, and a captured step "
                "cannot make it; run the backward before capturing step(), or call zero_grad(set_to_none=False)"
            )
        if self._held_back or self._marked != self._on_device:
            raise RuntimeError(
                "step() is being captured in a CUDA graph, but the last backward raised before its end, so the "
                "device does not hold its grad marks and a captured step cannot write them; run a backward to "
                "its end (or zero_grad()) before capturing step()"
            )
        self.pinned = True

    @torch.no_grad()
    def all_reduce(self, chunks: Sequence[Chunk], group: Any) -> None:
        """Make every chunk's grad buffer the mean over ``group`` of the ranks' sums (zero where a rank got no
        grad: a view may hold a sum an earlier step consumed) and ``flags`` marked where any rank got a grad."""
        for i, marked in enumerate(self._marked):
            if not marked:
                chunk, local = self.where[i]
                chunk.grad_views[local].zero_()
        all_reduce_mean([chunk.grad for chunk in chunks], group)
        dist.all_reduce(self.flags, op=dist.ReduceOp.SUM, group=group)
        self.flags.clamp_(max=1)

    def consumed(self) -> None:
        """The finalize program read and cleared ``flags`` (call it right after, so the host copy follows)."""
        self._marked = [False] * len(self.params)
        self._on_device = [False] * len(self.params)
        for master in self._summed_masters:
            master.grad = None

    def clear(self, chunks: Sequence[Chunk], set_to_none: bool) -> None:
        """``zero_grad``: ``.grad`` to None and the flat buffers freed (kept when pinned or during capture), or
        the buffers zeroed with ``.grad`` kept as views (None when the view is wider than the param: fp32
        accumulation)."""
        self._pin_if_capturing()  # a captured zero_grad(set_to_none=False) writes the buffers
        self._held_back, self._held_bytes, self._held_storages = {}, 0, set()
        if set_to_none:
            for p in self.params:
                p.grad = None
        else:
            for chunk in chunks:
                self.views(chunk)
                chunk.grad.zero_()
            for i, (p, (chunk, local)) in enumerate(zip(self.params, self.where, strict=True)):
                view = chunk.grad_views[local]
                p.grad = None  # a wider view (fp32 accumulation) is no grad of a 16-bit param
                if view.dtype == p.dtype:
                    self._attach(i, view)
        if self.pinned or any(self._on_device):  # a step left them cleared: no launch
            self.flags.zero_()
        self.consumed()  # the masters' .grad (fp32 accumulation) let go of their views
        if set_to_none:
            self._had_grad = [False] * len(self.params)
        else:  # the zeroed grads are this step's grads, as torch steps a param whose grad was zeroed
            for i, had in enumerate(self._had_grad):
                if had:
                    self._marked[i] = True
                    # a captured step reads the device's marks, as a captured hook writes them
                    if self.pinned:
                        self._flag_views[i].fill_(1)
                        self._on_device[i] = True
                    chunk, local = self.where[i]
                    if self._accumulates[i] and chunk.master_views:
                        chunk.master_views[local].grad = chunk.grad_views[local]
        if set_to_none and not self.pinned:
            for chunk in chunks:
                chunk.free_grad()
            self._view_ptrs = [None] * len(self.params)
