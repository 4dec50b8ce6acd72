"""FP32 gradient accumulation for the exact strategy (``grad_accum_dtype="fp32"``), and ZeRO-0 data
parallelism over the fp32 sums (``process_group=``, the exact and fused strategies).

A post-accumulate-grad hook on every 16-bit trained param adds the grad backward just produced into the param's
fp32 master grad (``MasterStore.add_grad``: the buffer the 16-bit path copies into at the step, so no memory is
added) and releases the 16-bit ``.grad``: k micro-batches round once each in fp32 instead of in 16 bits. fp32
params are their own masters and accumulate in their ``.grad`` as usual.

Not with DDP: its reducer all-reduces the 16-bit ``.grad`` in buckets it owns before any hook of ours sees the
sum, and a comm hook gets that 16-bit bucket, not our fp32 buffer. So data parallelism with fp32 sums is
halfprec's own: ZeRO-1/2 in the sharded reducer (``sharded/grads.py``), ZeRO-0 here, as ``process_group=`` on the
unsharded strategies (which keep their layouts and checkpoint formats) rather than a stage 0 of the sharded
optimizer. At ``step()``, before the unscale and the norm: one all-reduce of the "got a grad" flags, then one
all-reduce per flat fp32 grad buffer, divided by the world size (the sharded reducer's mean). A param that got a
grad on any rank is stepped on every rank, with a zero grad where it got none; on none, it is not stepped. Every
rank then holds the same grads, so the norm, the overflow check and the loss-scale update agree without another
collective. Not overlapped with backward: one pass of 4 B/param plus the collectives.

FSDP2 (DTensor params, ``mesh.py``) calls a sharded param's post-accumulate-grad hooks after each reduce-scatter,
with ``.grad`` the reduced 16-bit shard: the same hooks sum the shards in fp32, without an unsharded fp32 buffer.
A backward under ``set_requires_gradient_sync(False)`` reduces nothing and calls no hook (FSDP2 sums its grads in
its unsharded buffer, in 16 bits or its reduce dtype), so the step counts the backwards against the hooks and
refuses the gap (``results.Delivered``; torch 2.11's FSDP2 calls no hook under compiled autograd either, and the
error then names that).

Three hook sets collect grads: these (the exact strategy's fp32 sums), the fused strategy's (``fused/grads.py``) and
the sharded reducer's (``sharded/grads.py``). What they have in common lives once: the flat grad buffers and their
views (``chunk.py``, ``layout.py``), the grad marks, weak hooks and the refusal of a backward after ``unscale_()``
(``results.py``), ZeRO-0's mean (``all_reduce_mean``). They differ in more than where a grad lands: the fused hooks
batch their copies and keep the marks on the host and in a device array (a step there is host-paced at ~150
params, and a captured CUDA graph replays the hooks' device work), the sharded hooks count each bucket's grads and
launch its reduce-scatter in bucket order, the same on every rank; these add into the ``.grad`` of a master that
the wrapped torch optimizer reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .chunk import MasterStore
from .mesh import local
from .results import Delivered, ScaleGuard, StepState, refuse_backward_after_unscale, weak_hook

__all__ = ["GradAccumulator", "all_reduce_master_grads", "all_reduce_mean", "check_process_group"]


def check_process_group(group: Any, grad_accum_dtype: Any, *, stage: int = 0) -> None:
    """Raise ValueError unless ``group`` is None, or a process group of an initialised ``torch.distributed``; at
    stage 0 given with ``grad_accum_dtype="fp32"`` (what the ZeRO-0 all-reduce sums)."""
    if group is None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"process_group={group!r} but torch.distributed is not initialised: call "
            "torch.distributed.init_process_group() first, or pass process_group=None (no data parallelism)"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"process_group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD), got "
            f"{type(group).__name__}"
        )
    if stage == 0 and grad_accum_dtype != "fp32":
        raise ValueError(
            f"process_group= all-reduces the fp32 grad sums, which needs grad_accum_dtype='fp32', got "
            f"{grad_accum_dtype!r}; for 16-bit accumulation wrap the model in DDP and pass no process_group"
        )


@torch.no_grad()
def all_reduce_mean(buffers: list[torch.Tensor], group: Any) -> None:
    """Sum each fp32 buffer over ``group`` in place, then divide by the world size (the sharded reducer's mean)."""
    world = dist.get_world_size(group)
    works = [dist.all_reduce(b, op=dist.ReduceOp.SUM, group=group, async_op=True) for b in buffers]
    for b, work in zip(buffers, works, strict=True):
        work.wait()
        if world > 1:
            b.div_(world)


@torch.no_grad()
def all_reduce_master_grads(
    store: MasterStore, own: list[torch.nn.Parameter], group: Any
) -> list[torch.Tensor]:
    """The exact path's ZeRO-0 reduction: make every master grad (and every fp32 own param's ``.grad``) the mean
    over ``group`` of the ranks' fp32 sums; a param with a grad on some rank only gets one everywhere (zero where
    it had none), one with none anywhere keeps None. Returns the master grads that hold a grad."""
    masters = store.master_params()
    holders = masters + own
    device = store.chunks[0].device if store.chunks else own[0].device if own else torch.device("cpu")
    got = torch.tensor([h.grad is not None for h in holders], dtype=torch.float32, device=device)
    dist.all_reduce(got, op=dist.ReduceOp.SUM, group=group)
    buffers, views = [], []
    for chunk, chunk_masters in zip(store.chunks, store.masters, strict=True):
        if chunk.grad is None:
            chunk.make_grad(torch.float32)
        for m, view in zip(chunk_masters, chunk.grad_views, strict=True):
            if m.grad is None:
                view.zero_()  # may hold a sum an earlier step consumed
        buffers.append(chunk.grad)
        views += chunk.grad_views
    if own:
        flat = torch.cat(
            [torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in own]
        )
        buffers.append(flat)
        views += [g.view_as(p) for p, g in zip(own, flat.split([p.numel() for p in own]), strict=True)]
    all_reduce_mean(buffers, group)
    for holder, view, n in zip(holders, views, got.tolist(), strict=True):
        holder.grad = view if n > 0 else None
    return [m.grad for m in masters if m.grad is not None]


class GradAccumulator:
    """The hooks that accumulate ``store``'s model grads into its fp32 master grads. ``state``: the optimizer's
    step record (its ``unscaled`` flag makes a backward between ``unscale_()`` and ``step()`` an error).
    ``backwards``: for FSDP2's sharded params, the guard whose ``marks`` count the backwards (``Delivered``)."""

    def __init__(self, store: MasterStore, state: StepState, backwards: ScaleGuard | None = None) -> None:
        self.store = store
        self.state = state
        self.consumed = False  # a step read the master grads: the next grad starts a new accumulation
        self.hooked = 0  # chunks of the store whose params carry the hook (add_param_group adds chunks)
        self.delivered = None if backwards is None else Delivered(backwards)  # FSDP2 (module docstring)
        self.hook_new_chunks()

    def hook_new_chunks(self) -> None:
        """Hook the params of the store's chunks made since the last call."""
        for c in range(self.hooked, len(self.store.chunks)):
            for k, p in enumerate(self.store.chunks[c].params):
                p.register_post_accumulate_grad_hook(weak_hook(self.on_grad, c, k))
        self.hooked = len(self.store.chunks)

    def on_grad(self, c: int, k: int) -> None:
        """Param ``k`` of chunk ``c`` got a grad: add it into its master grad and release it."""
        if self.state.unscaled:
            refuse_backward_after_unscale("its grads would be added, still loss-scaled, to unscaled ones")
        if self.delivered is not None:
            self.delivered.fire((c, k))
        self.take(c, k, self.store.chunks[c].params[k])

    def cleared(self) -> None:
        """The optimizer's ``zero_grad`` cleared the master grads (to None or zero): the next grad adds to them."""
        self.consumed = False

    def collect(self) -> list[torch.Tensor]:
        """At the step: take the model grads assigned by hand (no hook ran for them), end the accumulation (the
        next grad starts a new one) and return the master grads that hold a grad (still scaled)."""
        if self.delivered is not None:
            self.delivered.check()
        for c, chunk in enumerate(self.store.chunks):
            for k, p in enumerate(chunk.params):
                if p.grad is not None:
                    self.take(c, k, p)
        self.consumed = True
        return [m.grad for m in self.store.master_params() if m.grad is not None]

    def take(self, c: int, k: int, param: torch.Tensor) -> None:
        """Add ``param.grad`` into master ``k`` of chunk ``c`` and release it; first drop the master grads a step
        consumed, so that a loop that clears only the model's grads (``model.zero_grad()``, which cannot reach
        the masters) starts each accumulation from zero, not from grads that were unscaled, clipped and applied."""
        if self.consumed:
            self.store.clear_grads()
            self.consumed = False
        self.store.add_grad(c, k, local(param.grad))
        param.grad = None
