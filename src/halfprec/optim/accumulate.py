"""FP32 gradient accumulation for the exact strategy (``grad_accum_dtype=torch.float32``).

A post-accumulate-grad hook on every 16-bit trained param adds the grad backward just produced into the param's
fp32 master grad (``MasterStore.add_grad``: the buffer the 16-bit path copies into at the step, so no memory is
added) and releases the 16-bit ``.grad``: k micro-batches round once each in fp32 instead of in 16 bits. fp32
params are their own masters and accumulate in their ``.grad`` as usual.

Not with DDP: its reducer all-reduces the 16-bit ``.grad`` (in the grad dtype, in buckets it owns) before any
hook of ours could see the sum, and a comm hook receives that 16-bit bucket, not our fp32 buffer, so it cannot
keep the cross-rank sum in fp32. Data-parallel fp32 accumulation is the sharded optimizer's reducer
(``sharded/grads.py``: fp32 buffer, fp32 reduce-scatter); its stage 0 (every rank owning the whole layout, an
all-reduce instead of the reduce-scatter, no all-gather) is the planned ZeRO-0 form.
"""

from __future__ import annotations

import torch

from .layout import MasterStore
from .results import StepState, weak_hook

__all__ = ["GradAccumulator"]


class GradAccumulator:
    """The hooks that accumulate ``store``'s model grads into its fp32 master grads. ``state``: the optimizer's
    step record (its ``unscaled`` flag makes a backward between ``unscale_()`` and ``step()`` an error)."""

    def __init__(self, store: MasterStore, state: StepState) -> None:
        self.store = store
        self.state = state
        self.consumed = False  # a step read the master grads: the next grad starts a new accumulation
        self.hooked = 0  # chunks of the store whose params carry the hook (add_param_group adds chunks)
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
            raise RuntimeError(
                "a backward ran after unscale_() and before step(): its grads would be added, still loss-scaled, "
                "to unscaled ones. Call unscale_() after the last backward() of the step."
            )
        self.take(c, k, self.store.chunks[c].params[k])

    def collect(self) -> list[torch.Tensor]:
        """At the step: take the model grads assigned by hand (no hook ran for them), end the accumulation (the
        next grad starts a new one) and return the master grads that hold a grad (still scaled)."""
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
        self.store.add_grad(c, k, param.grad)
        param.grad = None
