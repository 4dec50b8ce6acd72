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

A param's hook may run more than once in one backward: a layer applied twice under reentrant activation
checkpointing runs one inner backward per application, each calling the hook. The calls' grads are added (stage
2: in its staging buffer, in 16 bits, as autograd adds ``.grad``; fp32 accumulation: each in fp32), and a bucket
is complete once each of its params has had as many calls as the most it has had in one backward so far (at least
one). Until a param's second call has been seen, its bucket may be launched after its first, and a later call's
grad is then late: whole grads keep it in the buffer, stage 2 in a late buffer that the bucket's next reduction
(the next backward's) takes; either way the bucket is marked ``dirty``. The next backward waits for both calls.

Grads changed by hand after backward are this rank's grads too: ``collect()``, at the step, compares ``.grad`` with
the ``GradMarks`` taken when the reduction last read it and takes what changed (assigned, zeroed or edited in
place, set to None), marking its bucket ``dirty``. The step all-reduces the ``dirty`` flags in the collective that
sums the norm and the used flags, so only where some rank has one does every rank reduce that bucket again
(``reduce_again``: whole grads replace the shard's part with the reduction of the whole buffer; stage 2 adds the
reduction of the late buffers, zeros where a rank has none, rounding as stage 2 rounds micro-batches). A step
where no grad changed costs one identity and version check per param.

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
from ..results import GradMarks, refuse_backward_after_unscale, weak_hook

__all__ = ["GradReducer"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# stage 2: reduce-scatters in flight before the oldest is waited for (bounds staging memory)
_MAX_IN_FLIGHT = 2


class GradReducer:
    def __init__(
        self, params: list[torch.nn.Parameter], layout: Layout, *, stage: int, reduce_dtype: str, group,
        accumulate: bool = False, shard_dtype: torch.dtype = torch.float32, names: list[str] | None = None,
    ) -> None:  # fmt: skip
        self.params = params
        self.names = names or [f"param {i} of shape {tuple(p.shape)}" for i, p in enumerate(params)]
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
        # hook calls per param in one backward, learnt (at least 1): a bucket waits for that many of each param's
        self._fires = [1] * len(params)
        # per bucket: this rank's grads changed after the bucket's reduction (a late hook call, a grad set by hand)
        self.dirty = [False] * len(layout.buckets)
        # stage 2: those grads, 16-bit, until the bucket is reduced again
        self._late: dict[int, torch.Tensor] = {}
        # stage 1, 16-bit: the next grad is the first since a step or zero_grad(), when the caller may have
        # dropped .grad (model.zero_grad()) of params the coming backward does not reach
        self._unchecked = False
        self._reset_pass()
        self._mark()
        for i, p in enumerate(params):
            if layout.numels[i] > 0:
                p.register_post_accumulate_grad_hook(weak_hook(self.on_grad, i))

    # --- per-backward bookkeeping ----------------------------------------------------------------------
    def _reset_pass(self) -> None:
        self._ready = [0] * len(self.layout.buckets)  # params that got all their hook calls, per bucket
        self._calls = [0] * len(self.params)
        self._next = 0  # buckets below it are launched
        self._staging: dict[int, torch.Tensor] = {}
        self._pending: list = []
        self._callback: weakref.ref | None = None  # the end-of-backward callback this pass queued

    def _mark(self) -> None:
        """Remember the grads the shard now reflects (``collect`` tells a grad changed by hand from them)."""
        self._marks = GradMarks(self.params)
        self._version = None if self.flat_grad is None else self.flat_grad._version

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
            refuse_backward_after_unscale("its grads would not reach this step")
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
            if self._sync and b < self._next:
                self._wait_for(b)  # the in-flight reduction reads this buffer
            self.grad_view(i).add_(param.grad)  # fp32 += 16-bit: the exact upcast, one fp32 rounding
            param.grad = None
        elif self.stage == 1:
            if self._unchecked:
                self._forget_dropped()
            view = self.grad_view(i)
            if param.grad.data_ptr() != view.data_ptr():
                # p.grad was None (or replaced): autograd made a fresh tensor holding this backward's grad
                view.copy_(param.grad)
                param.grad = view
        if self.whole_grads and not self._sync:
            return
        self._calls[i] += 1
        late = b < self._next  # a hook call after the bucket's reduction started: reduced again later
        if self.stage == 2 and not self.accumulate:
            self._stage(i, b, param.grad, late=late, first=self._calls[i] == 1)
            param.grad = None
        if late and not self._aliased:
            self.dirty[b] = True
        if self._callback is None:
            self.overlapped = 0
            callback = self._end_of_backward  # a new bound method: autograd's engine holds the only reference
            self._callback = weakref.ref(callback)
            torch.autograd.Variable._execution_engine.queue_callback(callback)
        # a param whose hook runs again in one backward (a layer applied twice under reentrant checkpointing: one
        # call per inner backward) counts once, when its calls reach the most seen in one backward so far
        if self._calls[i] == self._fires[i]:
            self._ready[b] += 1
        self._fires[i] = max(self._fires[i], self._calls[i])
        while self._next < len(self._ready) and self._ready[self._next] >= self._expected[self._next]:
            self._launch(self._next)
            self._next += 1
            self.overlapped = self._next

    def _forget_dropped(self) -> None:
        """Stage 1, 16-bit: a param whose ``.grad`` the caller set to None since the step has no grad, as in
        torch: its part of the whole buffer (which ``.grad`` viewed) is zeroed and it is not stepped unless some
        backward reaches it again. Without this its old grad would be reduced and applied again."""
        self._unchecked = False
        for j, p in enumerate(self.params):
            if p.grad is None and self.flat_grad is not None and self.layout.numels[j]:
                self.grad_view(j).zero_()
                self.used[j] = False

    def _stage(self, i: int, b: int, grad: torch.Tensor, *, late: bool, first: bool) -> None:
        """Stage 2: put param ``i``'s 16-bit grad where bucket ``b``'s next reduction reads it (after the bucket's
        reduction started: the late buffer, reduced at its next launch or at the step)."""
        layout = self.layout
        bucket = layout.buckets[b]
        held = self._late if late else self._staging
        buffer = held.get(b)
        if buffer is None:
            buffer = held[b] = torch.zeros(bucket.numel, dtype=self.dtype, device=self.device)
        off = layout.offsets[i] - bucket.start
        part = buffer[off : off + layout.numels[i]]
        part.copy_(grad.reshape(-1)) if first and not late else part.add_(grad.reshape(-1))

    def _end_of_backward(self) -> None:
        with torch.no_grad():
            while self._next < len(self.layout.buckets):
                self._launch(self._next)
                self._next += 1
            while self._pending:
                self._complete(self._pending.pop(0))
        self._reset_pass()
        self.up_to_date = True
        self._mark()

    # --- collectives -----------------------------------------------------------------------------------
    def _bucket_input(self, b: int) -> torch.Tensor:
        bucket = self.layout.buckets[b]
        if self.whole_grads:
            grads = self._ensure_flat_grad()[bucket.start : bucket.start + bucket.numel]
        else:
            grads, late = self._staging.pop(b, None), self._late.pop(b, None)
            if late is not None:
                grads = late if grads is None else grads.add_(late)
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
        self.dirty[b] = False  # the reduction reads every grad of the bucket this rank holds
        if self.whole_grads and self.comm_dtype == shard.dtype:
            out = shard  # overwrite: the whole accumulated grad is reduced at once
        else:
            out = torch.empty(bucket.shard, dtype=self.comm_dtype, device=self.device)
        work = _reduce_scatter(out, data, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._pending.append((b, work, out, shard, data))
        if not self.whole_grads:
            while len(self._pending) > _MAX_IN_FLIGHT:
                self._complete(self._pending.pop(0))

    def _wait_for(self, b: int) -> None:
        """Complete the reductions in flight up to bucket ``b``'s."""
        while any(entry[0] == b for entry in self._pending):
            self._complete(self._pending.pop(0))

    def _complete(self, entry) -> None:
        _, work, out, shard, _ = entry
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

    @torch.no_grad()
    def collect(self) -> None:
        """At the step: take the grads changed by hand since the shard last reflected ``.grad``, as this rank's
        grads (each one marks its bucket ``dirty``; ``reduce_again`` reduces it on every rank).

        At stage 1 with 16-bit grads ``.grad`` shows the whole grads: a grad assigned replaces the param's, one set
        to None drops it (the param is then stepped only where some rank has a grad), an in-place edit (of any
        param: the views share one version counter) marks every bucket. Elsewhere the hooks release ``.grad``:
        a grad assigned is added to the param's (as the unsharded fp32 accumulation adds it). Nothing changed:
        one identity and version check per grad, no tensor op."""
        self._settle()
        if self._marks.same(self.params):
            return
        whole16 = self.stage == 1 and not self.accumulate
        edited = whole16 and self.flat_grad is not None and self.flat_grad._version != self._version
        changed = [
            i for i, p in enumerate(self.params) if self.layout.numels[i] > 0 and self._changed(i, p.grad)
        ]
        if not (changed or edited):
            self._mark()
            return
        if self.consumed and self.stage == 2:
            raise RuntimeError(
                f"a grad was assigned to {self.names[changed[0]]!r} after step() consumed the ZeRO-2 grad shard it "
                "would be added to; call zero_grad() after step(), then assign the grad before the next step()"
            )
        # a step consumed the shard in place (stage 1: unscaled and clipped it): every bucket is reduced again
        everything = edited or self.applied or self.consumed
        if self.consumed:
            self._restart()  # fp32 accumulation: a step ended the sum, this grad starts the next one
        for i in changed:
            self._take(i)
        for b, bucket in enumerate(self.layout.buckets):
            if everything and bucket.params and not self._aliased:
                self.dirty[b] = True
        self.applied = False
        self._mark()

    def _changed(self, i: int, grad: torch.Tensor | None) -> bool:
        if self.stage == 2 or self.accumulate:
            return grad is not None
        if grad is None:
            return self.used[i]
        return self.flat_grad is None or grad.data_ptr() != self.grad_view(i).data_ptr()

    def _take(self, i: int) -> None:
        """Make param ``i``'s ``.grad`` (changed by hand) this rank's grad of it."""
        param, b = self.params[i], self.layout.bucket_of[i]
        grad = param.grad
        if self.accumulate:
            self.grad_view(i).add_(grad)
            param.grad = None
        elif self.stage == 2:
            self._stage(i, b, grad, late=True, first=False)
            param.grad = None
        elif grad is None:
            self.grad_view(i).zero_()
        else:
            view = self.grad_view(i)
            view.copy_(grad)
            param.grad = view
        self.used[i] = grad is not None
        if not self._aliased:
            self.dirty[b] = True

    @torch.no_grad()
    def reduce_again(self, buckets: list[int], finish) -> None:
        """Reduce ``buckets`` again, every rank the same list (the ``dirty`` flags of all ranks, summed): with whole
        grads the shard's part becomes the reduction of the whole grads; at stage 2 the reduction of the late grads
        (zeros where a rank has none) is added. ``finish(t)`` turns a fresh reduction into what the shard holds
        (the mean, unscaled)."""
        shard = self._ensure_shard()
        works = []
        for b in buckets:
            bucket = self.layout.buckets[b]
            data = self._bucket_input(b)
            out = torch.empty(bucket.shard, dtype=self.comm_dtype, device=self.device)
            work = _reduce_scatter(out, data, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            works.append((bucket, work, out))
        for bucket, work, out in works:
            work.wait()
            part = shard[bucket.local : bucket.local + bucket.shard]
            reduced = finish(out.to(part.dtype))
            part.copy_(reduced) if self.whole_grads else part.add_(reduced)
        self.dirty = [False] * len(self.layout.buckets)

    # --- accumulation control ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self.whole_grads:
            raise RuntimeError(
                "no_sync() is only meaningful at stage 1 or with grad_accum_dtype='fp32': stage 2 keeps no "
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
        for _, work, *_ in self._pending:
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
        self.dirty = [False] * len(self.layout.buckets)
        self._late = {}
        self.up_to_date = False
        self.frozen = False
        self.applied = False
        self.consumed = False
        self._mark()

    def mark_applied(self) -> None:
        """A step read (and unscaled and clipped in place) the grad shard: applying it again is refused, and at
        stage 2 or with fp32 accumulation the next grad cannot be added to it (fp32: it starts a new sum)."""
        self.applied = True
        self.consumed = self.stage == 2 or self.accumulate
        self._unchecked = True

    def _restart(self) -> None:
        """The first grad after a step that consumed an fp32 accumulation: start a new one from zero."""
        self._ensure_flat_grad().zero_()
        self.used = [False] * len(self.params)
        self.consumed = False
