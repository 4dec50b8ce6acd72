"""Gradient reduction for the sharded optimizer: post-accumulate-grad hooks, buckets, async reduce-scatter.

Every rank must issue the same collectives in the same order: buckets are launched strictly in index order
(bucket ``b`` waits for ``b - 1``), and a callback that the first grad hook of a backward queues launches, at its
end, the buckets whose params got no grad on this rank, with zeros. A backward that reaches no trained param on
some rank fires no hook there and the ranks' collectives mismatch (a hang or a crash): as with DDP, every rank's
backward must reach at least one trained param; a param unused on a rank (or on all ranks) is fine.

Stage 1 keeps a whole 16-bit grad buffer (``p.grad`` are views of it, so autograd accumulates micro-batches
in place); a bucket is reduced when backward completes it outside ``no_sync()``, each reduction overwriting
the rank's fp32 grad shard. Stage 2 keeps no whole grads: a param's grad is copied into its bucket's staging
buffer and freed, every backward reduces every bucket, and the results are added into the fp32 grad shard.

FP32 accumulation (``accumulate=True``, both stages): the whole buffer is fp32 and is the reduction's input; a
hook adds the 16-bit grad backward produced into its fp32 view (micro-batch order, one fp32 rounding each) and
releases it, so 16-bit grads are transient. Reduction is then stage 1's: outside ``no_sync()`` (allowed at both
stages) buckets are reduce-scattered in fp32 as backward completes them, overwriting the shard with the sum of
the ranks' fp32 sums; a step ends the accumulation (the next grad starts a new one, as on the exact path).
Memory: 4 B/param of whole grads on every rank at either stage (Megatron's distributed optimizer keeps the same
fp32 buffer), plus the 4/world B/param shard.

Communication dtype: ``"fp32"`` upcasts the bucket (or, accumulating in fp32, reads the buffer as it is) and
sums in fp32 (the mean is taken later, on the shard); ``"param"`` divides the 16-bit bucket by the world size
first (as DDP does, so the sum cannot overflow) and sums in the 16-bit dtype.

Shard dtype (``shard_dtype``): fp32, or with ``"param"`` for the fused local step the 16-bit dtype itself, read
by the update kernel as it is (2 B/param less; stage 2 then adds micro-batches in 16 bits, as stage 1 does). At
stage 1 and world size 1 a 16-bit shard is the whole grad buffer itself: nothing to reduce, no copy.

A backward that raises (caught by the user: an OOM retry loop) keeps the grads it produced, as in torch: the next
backward adds to them and a step applies them; ``zero_grad()`` drops them. Autograd drops the callbacks of a
backward that raised, so the reducer holds only a weak reference to its callback: dead before it ran, it tells the
next grad hook or ``finish()`` to end that pass (launch its remaining buckets, wait every reduction), and
``zero_grad()`` waits its reductions and forgets it. Every rank must raise at the same point, as every rank must
run the same backward: one rank raising alone desyncs the collectives (a hang or a crash, as with DDP).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..layout import Layout
from ..results import weak_hook

__all__ = ["GradReducer"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# stage 2: reduce-scatters in flight before the oldest is waited for (bounds staging memory)
_MAX_IN_FLIGHT = 2


class GradReducer:
    def __init__(
        self, params: list[torch.nn.Parameter], layout: Layout, *, stage: int, reduce_dtype: str, group,
        accumulate: bool = False, shard_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        self.params = params
        self.layout = layout
        self.stage = stage
        self.group = group
        self.dtype = params[0].dtype if params else torch.float32
        self.comm_dtype = torch.float32 if reduce_dtype == "fp32" else self.dtype
        self.device = params[0].device if params else torch.device("cpu")
        self.accumulate = accumulate  # fp32 accumulation: flat_grad is fp32 and p.grad is released
        # flat_grad holds this rank's whole grads (16-bit at stage 1, else fp32); no_sync() defers their reduction
        self.whole_grads = stage == 1 or accumulate
        self.flat_grad: torch.Tensor | None = None  # whole grads only, allocated by the first backward
        self.shard_dtype = shard_dtype
        self.grad_shard: torch.Tensor | None = None  # local coordinates; allocated on first use
        # stage 1, world size 1, 16-bit shard: the shard is flat_grad (local coordinates are global ones)
        self._aliased = (
            self.whole_grads and not accumulate and layout.world_size == 1 and shard_dtype == self.dtype
        )
        self.used = [False] * len(params)  # got a grad on this rank since zero_grad
        self.up_to_date = False  # grad_shard holds the reduction of every grad produced so far
        self.overlapped = 0  # buckets of the last backward launched before it ended (observability, tests)
        self._sync = True
        self.frozen = False  # set between unscale_() and step(): a new grad then would be silently lost
        self.applied = False  # step() applied grad_shard and no grad came since: applying it again is refused
        self.consumed = False  # stage 2 or fp32: step() consumed grad_shard in place (until zero_grad)
        self._expected = [sum(1 for i in b.params if layout.numels[i] > 0) for b in layout.buckets]
        self._reset_pass()
        for i, p in enumerate(params):
            if layout.numels[i] > 0:
                p.register_post_accumulate_grad_hook(weak_hook(self.on_grad, i))

    # --- per-backward bookkeeping ----------------------------------------------------------------------
    def _reset_pass(self) -> None:
        self._ready = [0] * len(self.layout.buckets)
        self._next = 0
        self._staging: dict[int, torch.Tensor] = {}
        self._pending: list = []
        self._callback: weakref.ref | None = None  # the end-of-backward callback this pass queued

    def _settle(self) -> None:
        """End the pass of a backward that raised after queueing its callback (autograd dropped it unrun)."""
        if self._callback is not None and self._callback() is None:
            self._end_of_backward()

    def _ensure_shard(self) -> torch.Tensor:
        if self.grad_shard is None and self._aliased:
            self.grad_shard = self._ensure_flat_grad()
        elif self.grad_shard is None:
            self.grad_shard = torch.zeros(self.layout.local_numel, dtype=self.shard_dtype, device=self.device)
        return self.grad_shard

    def _ensure_flat_grad(self) -> torch.Tensor:
        if self.flat_grad is None:
            dtype = torch.float32 if self.accumulate else self.dtype
            self.flat_grad = torch.zeros(self.layout.total, dtype=dtype, device=self.device)
        return self.flat_grad

    def grad_view(self, i: int) -> torch.Tensor:
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return self._ensure_flat_grad()[off : off + n].view(self.params[i].shape)

    @torch.no_grad()
    def on_grad(self, i: int) -> None:
        """The grad hook of param ``i``: copy (and at a bucket's last grad, reduce) its grad."""
        self._settle()
        if self.frozen:
            raise RuntimeError(
                "a backward ran after unscale_() and before step(): its grads would not reach this step. Call "
                "unscale_() after the last backward() of the step."
            )
        if self.consumed and self.accumulate:
            self._restart()
        if self.stage == 2 and self.consumed:
            raise RuntimeError(
                "ZeRO-2 reduces grads into a shard that step() consumed; call zero_grad() after step() before "
                "the next backward()"
            )
        param = self.params[i]
        self.applied = False
        self.used[i] = True
        self.up_to_date = False
        layout = self.layout
        b = layout.bucket_of[i]
        if self.accumulate:
            self.grad_view(i).add_(param.grad)  # fp32 += 16-bit: the exact upcast, one fp32 rounding
            param.grad = None
        elif self.stage == 1:
            view = self.grad_view(i)
            if param.grad.data_ptr() != view.data_ptr():
                # p.grad was None (or replaced): autograd made a fresh tensor holding this backward's grad
                view.copy_(param.grad)
                param.grad = view
        else:
            bucket = layout.buckets[b]
            staging = self._staging.get(b)
            if staging is None:
                staging = self._staging[b] = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
            off = layout.offsets[i] - bucket.start
            staging[off : off + layout.numels[i]].copy_(param.grad.reshape(-1))
            param.grad = None
        if self.whole_grads and not self._sync:
            return
        if self._callback is None:
            self.overlapped = 0
            callback = self._end_of_backward  # a new bound method: autograd's engine holds the only reference
            self._callback = weakref.ref(callback)
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        self._ready[b] += 1
        while self._next < len(self._ready) and self._ready[self._next] >= self._expected[self._next]:
            self._launch(self._next)
            self._next += 1
            self.overlapped = self._next

    def _end_of_backward(self) -> None:
        with torch.no_grad():
            while self._next < len(self.layout.buckets):
                self._launch(self._next)
                self._next += 1
            while self._pending:
                self._complete(self._pending.pop(0))
        self._reset_pass()
        self.up_to_date = True

    # --- collectives -----------------------------------------------------------------------------------
    def _bucket_input(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        if self.whole_grads:
            grads = self._ensure_flat_grad()[bucket.start : bucket.start + bucket.numel]
        else:
            grads = self._staging.pop(b, None)
            if grads is None:
                grads = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
        if self.comm_dtype == torch.float32:
            return grads.float()  # the fp32 accumulation buffer itself: collectives only read their input
        world = self.layout.world_size
        if world == 1:
            return grads
        return grads / world if self.stage == 1 else grads.div_(world)

    def _launch(self, b: int) -> None:
        bucket = self.layout.buckets[b]
        shard = self._ensure_shard()[bucket.local : bucket.local + bucket.shard]
        if self._aliased:
            return  # the shard is the whole grads: one rank's sum is its grads
        data = self._bucket_input(b)
        if self.whole_grads and self.comm_dtype == shard.dtype:
            out = shard  # overwrite: the whole accumulated grad is reduced at once
        else:
            out = torch.empty(bucket.shard, dtype=self.comm_dtype, device=self.device)
        work = _reduce_scatter(out, data, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending.append((work, out, shard, data))
        if not self.whole_grads:
            while len(self._pending) > _MAX_IN_FLIGHT:
                self._complete(self._pending.pop(0))

    def _complete(self, entry) -> None:
        work, out, shard, _ = entry
        work.wait()
        if out is shard:
            return
        if self.whole_grads:
            shard.copy_(out)
        else:
            shard.add_(out)

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """Make the grad shard hold the (summed) reduction of every grad since ``zero_grad``."""
        self._settle()
        if self.whole_grads and not self.up_to_date:
            self._next = 0
            self._end_of_backward()
        return self._ensure_shard()

    # --- accumulation control ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self.whole_grads:
            raise RuntimeError(
                "no_sync() is only meaningful at stage 1 or with grad_accum_dtype=torch.float32: stage 2 keeps no "
                "whole 16-bit gradients, so it reduces every micro-batch as backward produces it; call backward() "
                "for each micro-batch without no_sync()"
            )
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grads. ``set_to_none=False`` keeps the ``used`` flags, as torch keeps zero grads: a param
        that has had a grad since the last ``set_to_none=True`` call is then stepped with a zero grad. The
        reductions of a backward that raised are waited (they may write the shard) and the pass forgotten."""
        for work, *_ in self._pending:
            work.wait()
        self._reset_pass()
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            for i, p in enumerate(self.params):
                p.grad = None if self.accumulate else self.grad_view(i)
        if self.stage == 2:
            for p in self.params:
                p.grad = None
            if self.grad_shard is not None:
                self.grad_shard.zero_()
        if set_to_none:
            self.used = [False] * len(self.params)
        self.up_to_date = False
        self.frozen = False
        self.applied = False
        self.consumed = False

    def mark_applied(self) -> None:
        """A step read (and unscaled and clipped in place) the grad shard: applying it again is refused, and at
        stage 2 or with fp32 accumulation the next grad cannot be added to it (fp32: it starts a new sum)."""
        self.applied = True
        self.consumed = self.stage == 2 or self.accumulate

    def _restart(self) -> None:
        """The first grad after a step that consumed an fp32 accumulation: start a new one from zero."""
        self._ensure_flat_grad().zero_()
        self.used = [False] * len(self.params)
        self.consumed = False
