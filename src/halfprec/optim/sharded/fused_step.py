"""The sharded optimizer's local step on the fused Triton kernels (``impl="triton"``, or ``"auto"`` on CUDA).

The torch optimizer (Adam, AdamW, SGD or Adagrad) keeps its param groups and torch-format state; only its
``step()`` is replaced. Its elementwise state tensors become views of flat fp32 buffers in the rank's local
coordinates, like the masters and the grad shard, so one launch of the fused update kernel steps every piece.
Per-piece scalars (bias corrections, Adagrad's decayed lr, SGD's first-step flag) come from the fused path's
finalize program. Step counters stay torch's 0-d fp32 CPU tensors, advanced on the host (the sharded step has
already read which params got a grad anywhere). State replaced from outside (``load_state_dict``, a checkpoint
load) is copied into the buffers and re-viewed at the next step.

Update rows cover a piece's 16-aligned interior with vectorised programs; the (at most 15 element) head and tail
that a shard boundary or a neighbour left unaligned run in a second launch with ``ALIGNED=False``. The kernel
writes the 16-bit params itself, into this rank's shard of the global flat param buffer (rounded to nearest even,
as a copy rounds): each row carries the shift from local coordinates to its bucket's shard there, a multiple of
``ALIGN`` (0 for every row at world size 1). Only fp32 params, which the kernel takes as their own masters, are
left for the optimizer to copy.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.settings import settings
from ...kernels.slots import PSCAL_WIDTH, HyperTable
from ..checks import tell_schedulers
from ..layout import ALIGN, Layout
from ..policy import fused_class, unsupported_flag
from ..state import adopt_views

__all__ = ["FusedLocalStep"]


def _rows(pieces: list, block: int) -> tuple[list[tuple], list[tuple]]:
    """(aligned rows, unaligned rows) ``(start, end, k)`` covering the local range of each piece ``k``."""
    aligned, loose = [], []
    for k, pc in enumerate(pieces):
        lo, hi = pc.local, pc.local + pc.numel
        a0, a1 = -(-lo // ALIGN) * ALIGN, hi // ALIGN * ALIGN
        if a0 >= a1:
            loose.append((lo, hi, k))
            continue
        aligned += [(s, min(s + block, a1), k) for s in range(a0, a1, block)]
        loose += [(lo, a0, k)] if lo < a0 else []
        loose += [(a1, hi, k)] if a1 < hi else []
    return aligned, loose


class FusedLocalStep:
    """Flat state buffers, update tables and device scratch for one sharded optimizer's fused local step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        piece_params: dict[int, torch.nn.Parameter],
        *,
        param: torch.Tensor,
        master: torch.Tensor,
    ) -> None:
        """``param``: the global flat param buffer; ``master``: the local fp32 masters."""
        self.fused = fused_class(optimizer)  # the fused optimizers' per-algorithm protocol (fused/base.py)
        self.optimizer = optimizer
        self.param = param
        self.master = master
        self.sgd = isinstance(optimizer, torch.optim.SGD)  # no step counter
        # the pieces in local order; k indexes every per-piece device array
        self.pieces = sorted(layout.pieces, key=lambda pc: pc.local)
        self.params = [piece_params[pc.param] for pc in self.pieces]
        group_of = {id(p): gi for gi, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.group_of = [group_of[id(p)] for p in self.params]
        aligned, loose = _rows(self.pieces, settings().update_block)
        dev = master.device
        self.aligned = torch.tensor(aligned, dtype=torch.int64).reshape(-1, 3).to(dev)
        self.loose = torch.tensor(loose, dtype=torch.int64).reshape(-1, 3).to(dev)
        # per row: global offset of its bucket's shard on this rank minus the bucket's local offset
        bucket_shift = [b.shard_range(layout.rank)[0] - b.local for b in layout.buckets]
        shifts = [bucket_shift[self.pieces[k].bucket] for rows in (aligned, loose) for _, _, k in rows]
        shift = torch.tensor(shifts, dtype=torch.int64).to(dev)
        self.shifts = shift[: len(aligned)], shift[len(aligned) :]
        if param.dtype == torch.float32:  # the kernel takes fp32 params as their own masters: copied after
            self.shifts = None, None
        n = max(len(self.pieces), 1)
        self.steps = torch.zeros(n, dtype=torch.float32, device=dev)
        self.flags = torch.zeros(n, dtype=torch.int32, device=dev)
        self.pgroup = torch.tensor(self.group_of or [0], dtype=torch.int32).to(dev)
        self.pscal = torch.zeros(n, PSCAL_WIDTH, dtype=torch.float32, device=dev)
        self.hyper = HyperTable(len(optimizer.param_groups), dev)
        self.scalars = torch.zeros(8, dtype=torch.float32, device=dev)
        self.zero = torch.zeros(1, dtype=torch.float32, device=dev)
        self.one = torch.ones((), dtype=torch.float32, device=dev)  # the grad shard is already unscaled
        self.buffers: dict[str, torch.Tensor] = {}  # allocated at the first step: construction stays inert

    # --- state ---------------------------------------------------------------------------------------------
    def _view(self, name: str, k: int) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.zeros(len(self.master), dtype=torch.float32, device=self.master.device)
        pc = self.pieces[k]
        return self.buffers[name][pc.local : pc.local + pc.numel]

    def _adopt(self, k: int, group: dict[str, Any]) -> dict[str, Any] | None:
        """The piece's state with every elementwise tensor a view of the flat buffers (None: no state yet)."""
        state = self.optimizer.state.get(self.params[k])
        if not state:
            return None
        adopt_views(state, self.fused.group_state(group), lambda name: self._view(name, k))
        step = state.get("step")
        if torch.is_tensor(step) and step.device.type != "cpu":
            state["step"] = step.detach().to("cpu", torch.float32)  # torch's non-capturable format
        return state

    def _begin(self, k: int, group: dict[str, Any]) -> dict[str, Any]:
        """State of a piece's first update, as torch creates it (zeros; Adagrad: its initial value)."""
        state = self.optimizer.state[self.params[k]]
        if not self.sgd:
            state["step"] = torch.tensor(0.0)
        for name in self.fused.group_state(group):
            state[name] = self._view(name, k).fill_(self.fused.initial_value(name, group))
        return state

    # --- the step ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grad_shard: torch.Tensor, used_anywhere: list[float], coef: torch.Tensor | None) -> None:
        """Update every piece whose param got a grad on some rank (``used_anywhere[layout index] > 0``);
        ``coef``: the clip coefficient as a device scalar, or None."""
        from ...kernels.norm import finalize
        from ...kernels.update import update

        inner = self.optimizer
        if inner._optimizer_step_pre_hooks or inner._optimizer_step_post_hooks:
            raise RuntimeError(
                f"the {type(inner).__name__} wrapped with impl='triton' has step hooks, which would not run: the "
                "fused kernel replaces its step(). Register them on the ShardedMixedPrecisionOptimizer (they run "
                "once per step) or pass impl='torch'"
            )
        groups = inner.param_groups
        reason = unsupported_flag(groups)  # a flag may be turned on after construction
        if reason is not None:
            raise ValueError(f"the fused local step cannot run: {reason} when building the sharded optimizer")
        tell_schedulers(self.optimizer)
        counts, flags = [0.0] * len(self.params), [0.0] * len(self.params)
        for k in range(len(self.params)):
            group = groups[self.group_of[k]]
            state = self._adopt(k, group)
            if used_anywhere[self.pieces[k].param] <= 0:
                continue
            flags[k] = 1.0
            count = self.fused.step_count(state)
            if count is None and self.fused.group_state(group):  # SGD without momentum keeps no state
                state = self._begin(k, group)
            counts[k] = count or 0.0
            if not self.sgd:
                state["step"] += 1  # as torch advances it: a 0-d fp32 CPU tensor
        if not any(flags):  # no piece here got a grad (or this rank holds none): nothing to update
            return
        dev = torch.tensor([counts, flags], dtype=torch.float32).to(self.master.device, non_blocking=True)
        self.steps.copy_(dev[0])
        self.flags.copy_(dev[1])
        self.hyper.upload([self.fused.hp_row(g) for g in groups])
        finalize(
            self.zero, self.zero, self.one, self.scalars, None, self.flags, self.steps, self.pgroup, self.hyper.table,
            self.pscal, check=False, kind=self.fused.KIND,
        )  # fmt: skip
        self.scalars[2].copy_(self.one if coef is None else coef)
        state = [self.buffers[name] for name in self.fused.STATE_NAMES if name in self.buffers]
        kind, param, master, grad = self.fused.KIND, self.param, self.master, grad_shard
        pscal, scalars = self.pscal, self.scalars
        for table, aligned, shift in zip((self.aligned, self.loose), (True, False), self.shifts, strict=True):
            update(kind, param, grad, master, state, table, pscal, scalars, aligned=aligned, shift=shift)
