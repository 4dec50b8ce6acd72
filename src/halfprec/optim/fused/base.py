"""FusedOptimizer: the shared machinery of the fused optimizers (buffers, grad marking, the two passes).

A step, all on the device (no host sync, so it can be captured in a CUDA graph):

1. norm pass: one kernel per chunk over the 16-bit grads of the params that got a grad, unscaled by the loss
   scale read from device memory: partial sums of squares and non-finite counts;
2. finalize: one program decides the skip, the clip coefficient, advances per-param step counters, clears the
   grad marks and, for a ``DynamicLossScaler``, runs the scaler's update (``kernels/scaler.py``; any other
   scaler updates with its own torch ops after the update pass);
3. update pass: one kernel per chunk updates master and state in fp32 and writes the 16-bit params.

An eager step is three Triton launches per chunk at most and one non-blocking copy of the skip report: on a
skipped step, which is mostly host time, every launch saved counts.

Which params got a grad: a post-accumulate-grad hook marks the param and, when ``.grad`` is not the param's
view of the flat grad buffer (after ``zero_grad(set_to_none=True)`` or ``model.zero_grad()`` detached it, or
on the first backward), copies the fresh grad into the view and re-attaches it. Outside graph capture,
``step()`` also adopts a ``.grad`` assigned by hand and unmarks params whose ``.grad`` was set to None. A view
is never mistaken for a gradient: an unmarked param is not updated and its counter does not advance.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from ...scaler import LossScaler
from ..base import MixedPrecisionOptimizer
from ..checks import check_options, check_unfrozen, tell_schedulers
from ._skip_report import SkipReporter
from .buffers import Chunk
from .checkpoint import CheckpointMixin

__all__ = ["FusedOptimizer"]


def _value(v: Any) -> Any:
    return v if torch.is_tensor(v) else float(v)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FusedOptimizer(CheckpointMixin, MixedPrecisionOptimizer):
    """The fused strategy of ``MixedPrecisionOptimizer``; subclasses set ``_KIND``, ``_STATE_NAMES`` and the
    per-algorithm hooks below. It owns its param groups (``optimizer`` is None) and holds its state in flat
    buffers, allocated at the first real update: construction allocates only the masters and the flat 16-bit
    param buffer the params become views of."""

    impl = "triton"

    _KIND: int = -1
    _STATE_NAMES: tuple[str, ...] = ()

    def __init__(
        self,
        params,
        defaults: dict[str, Any],
        *,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        from ...kernels import triton_status

        ok, why = triton_status()
        if not ok:
            raise ValueError(
                f"{type(self).__name__} needs Triton: {why}; or use the torch path "
                "(halfprec.MixedPrecisionOptimizer over a torch optimizer)"
            )
        check_options(
            loss_scaler=loss_scaler,
            max_grad_norm=max_grad_norm,
            param_dtype=param_dtype,
            skip_nonfinite=skip_nonfinite,
        )
        self._built = False
        self._init_options(
            max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, param_dtype=param_dtype
        )
        torch.optim.Optimizer.__init__(self, params, defaults)  # owns its groups: not a wrapper's __init__
        self._build()
        self._built = True
        self._init_scaler(
            loss_scaler, has_fp16=any(c.dtype == torch.float16 for c in self._chunks), device=self._device
        )
        self._reporter = SkipReporter(
            self._skip_log,
            dynamic=self.loss_scaler.is_dynamic,
            min_scale=getattr(self.loss_scaler, "min_scale", 1.0),
        )
        self._stepped = False
        self._state_ready = False  # state buffers exist (allocated at the first step, a load or an export)
        self._s = _DeviceResults(self)
        self._replaced: weakref.ref | None = None  # the torch optimizer this one replaced, if any

    # --- construction --------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise RuntimeError(
                f"{type(self).__name__} lays out its flat buffers at construction: pass every "
                "param group to the constructor"
            )
        torch.optim.Optimizer.add_param_group(self, param_group)  # the groups are this object's own
        self._validate_group(self.param_groups[-1], len(self.param_groups) - 1)

    def _build(self) -> None:
        from ...kernels.norm import HP_WIDTH, PSCAL_WIDTH
        from ...kernels.settings import settings

        cfg = settings()
        self._all: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        trainable, group_of, originals = [], [], {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if not p.is_floating_point() or p.dtype == torch.float64:
                    raise ValueError(
                        f"param of shape {tuple(p.shape)} has dtype {p.dtype}; the fused "
                        "optimizers train fp16, bf16 and fp32 params"
                    )
                if not p.requires_grad:
                    continue
                self._cast_to_param_dtype(p, originals)
                trainable.append(p)
                group_of.append(gi)
        devices = {p.device for p in trainable}
        if len(devices) > 1:
            raise ValueError(
                f"trainable params span several devices {sorted(map(str, devices))}; build one "
                "fused optimizer per device"
            )
        self._device = devices.pop() if devices else torch.device("cpu")
        if self._device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"the fused optimizers run on CUDA params, got params on {self._device}; move the "
                "model to CUDA or use the torch path"
            )
        self._trainable = trainable
        self._index = {p: i for i, p in enumerate(trainable)}
        self._frozen = [p for p in self._all if p not in self._index]  # frozen when built: never trained
        dev = self._device
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(trainable):
            by_dtype.setdefault(p.dtype, []).append(i)
        self._chunks: list[Chunk] = []
        self._where: list[tuple[Chunk, int]] = [None] * len(trainable)  # type: ignore[list-item]
        partial_offset = 0
        self._partial_slices: list[tuple[int, int]] = []
        for idx in by_dtype.values():
            chunk = Chunk(
                [trainable[i] for i in idx],
                idx,
                originals,
                norm_block=cfg.norm_block,
                update_block=cfg.update_block,
            )
            self._chunks.append(chunk)
            for local, i in enumerate(idx):
                self._where[i] = (chunk, local)
            n = chunk.norm_table.shape[0]
            self._partial_slices.append((partial_offset, n))
            partial_offset += n
        n_params = len(trainable)
        self._sq = torch.zeros(max(partial_offset, 1), dtype=torch.float32, device=dev)
        self._bad = torch.zeros(max(partial_offset, 1), dtype=torch.float32, device=dev)
        self._flags = torch.zeros(max(n_params, 1), dtype=torch.int32, device=dev)
        self._steps = torch.zeros(max(n_params, 1), dtype=torch.float32, device=dev)
        self._pgroup = torch.tensor(group_of or [0], dtype=torch.int32).to(dev)
        self._pscal = torch.zeros(max(n_params, 1), PSCAL_WIDTH, dtype=torch.float32, device=dev)
        self._hp = torch.zeros(len(self.param_groups), HP_WIDTH, dtype=torch.float64, device=dev)
        self._hp_key: Any = None
        self._scalars = torch.zeros(8, dtype=torch.float32, device=dev)
        self._marked = [False] * n_params
        # where each param's grad view starts (the views live as long as the optimizer): one int compare per
        # param in step(), which is host time on a skipped step
        self._view_ptrs: list[int | None] = [None] * n_params  # filled when a chunk's grad buffer is made
        self._param_ptrs = [p.data_ptr() for p in trainable]  # the params are views of the flat buffers
        ref = weakref.ref(self)
        self._hooks = [
            p.register_post_accumulate_grad_hook(_make_hook(ref, i)) for i, p in enumerate(trainable)
        ]

    def _state_names_for_build(self) -> tuple[str, ...]:
        return self._STATE_NAMES

    # --- per-algorithm hooks (subclasses) --------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], index: int) -> None:
        raise NotImplementedError

    @classmethod
    def _hp_row(cls, group: dict[str, Any]) -> list[Any]:
        raise NotImplementedError

    def _launch_update(self, chunk: Chunk) -> None:
        from ...kernels.update import update

        state = [chunk.state[name] for name in self._state_names_for_build() if name in chunk.state]
        param = chunk.master if chunk.param is None else chunk.param
        update(
            self._KIND, param, chunk.grad, chunk.master, state, chunk.update_table, self._pscal, self._scalars
        )

    def _init_state(self) -> None:
        """Eager state that the torch optimizer creates in its constructor (Adagrad's ``sum``)."""

    def _export_state(self, i: int, step: float) -> dict[str, Any]:
        raise NotImplementedError

    def _import_state(self, i: int, saved: dict[str, Any]) -> float:
        """Copy a torch-format state entry into the buffers; return the step count to set."""
        raise NotImplementedError

    def _prepare_step(self) -> None:
        """Lazy allocations before a step (never during capture)."""

    def _ensure_state(self) -> None:
        """Allocate the state buffers, as torch does at a param's first update (Adagrad's ``sum`` filled with its
        initial value, as its constructor would): at the first step, or a load or export that needs them."""
        if self._state_ready:
            return
        for chunk in self._chunks:
            for name in self._state_names_for_build():
                chunk.add_state(name)
        self._init_state()
        self._state_ready = True

    def _grad_views(self, chunk: Chunk) -> list[torch.Tensor]:
        """The chunk's grad views, its flat grad buffer made at the first grad it gets (not at construction)."""
        if chunk.grad is None:
            chunk.make_grad()
            for local, i in enumerate(chunk.indices):
                self._view_ptrs[i] = chunk.grad_views[local].data_ptr()
        return chunk.grad_views

    # --- grads ---------------------------------------------------------------------------------------
    def _mark(self, i: int) -> None:
        p = self._trainable[i]
        chunk, local = self._where[i]
        view = self._grad_views(chunk)[local]
        g = p.grad
        if g is not None and g.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(g)
            p.grad = view
        self._flags[i].fill_(1)
        self._marked[i] = True

    def _adopt_grads(self) -> None:
        for i, p in enumerate(self._trainable):
            if p.data_ptr() != self._param_ptrs[i]:
                raise RuntimeError(
                    f"the param of shape {tuple(p.shape)} no longer lives in {type(self).__name__}'s flat buffer "
                    "(replaced by model.to(), .half()/.float(), load_state_dict(assign=True) or a .data "
                    "assignment after the optimizer was built), so its updates would not reach the model; "
                    "build the optimizer after the model is in its final dtype and device"
                )
            g = p.grad
            if g is None:
                if self._marked[i]:
                    self._flags[i].fill_(0)
                    self._marked[i] = False
                continue
            if g.data_ptr() != self._view_ptrs[i]:
                self._mark(i)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's grads. ``set_to_none=False`` zeroes the flat buffers and keeps ``.grad`` as views
        (the next backward then needs no copy); params that get no grad are still not updated."""
        for p in self._frozen:
            p.grad = None  # as torch's zero_grad clears every param of the groups
        if set_to_none:
            for p in self._trainable:
                p.grad = None
        else:
            for chunk in self._chunks:
                views = self._grad_views(chunk)
                chunk.grad.zero_()
                for p, view in zip(chunk.params, views, strict=True):
                    p.grad = view
        self._flags.zero_()
        self._marked = [False] * len(self._trainable)

    def unscale_(self) -> None:
        raise RuntimeError(
            f"{type(self).__name__} folds unscaling and clipping into its update kernel, so the "
            "grads are never unscaled in place; use max_grad_norm for clipping, or the torch path "
            "(impl='torch') to inspect unscaled grads"
        )

    # --- the step --------------------------------------------------------------------------------------
    def _upload_hyper(self, capturing: bool) -> None:
        rows = [[_value(v) for v in self._hp_row(g)] for g in self.param_groups]
        key = tuple(tuple(None if torch.is_tensor(v) else v for v in row) for row in rows)
        if key != self._hp_key:
            if capturing:
                raise RuntimeError(
                    "a param group's hyper-parameters changed while a CUDA graph was being "
                    "captured; run one eager step first, and use 0-d device tensors for values "
                    "that change between replays (group['lr'] = torch.tensor(lr, device='cuda'))"
                )
            cpu = torch.tensor([[0.0 if v is None else v for v in row] for row in key], dtype=torch.float64)
            self._hp.copy_(cpu, non_blocking=True)
            self._hp_key = key
        for gi, row in enumerate(rows):
            for k, v in enumerate(row):
                if torch.is_tensor(v):
                    self._hp[gi, k].copy_(v, non_blocking=True)

    @torch.no_grad()
    def step(self, closure=None):
        """One fused step (see the module docstring); no host sync."""
        from ...kernels import norm
        from ...kernels import scaler as scaler_kernel

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        capturing = _capturing()
        if capturing and not self._state_ready:
            raise RuntimeError(
                f"{type(self).__name__} allocates its state at the first step, which cannot happen during CUDA "
                "graph capture: run one eager step before capturing"
            )
        if not capturing:
            check_unfrozen(self._frozen)
            self._reporter.drain()
            self._adopt_grads()
            for chunk in self._chunks:
                self._grad_views(chunk)
            self._ensure_state()
            self._prepare_step()
        self._upload_hyper(capturing)
        scale = self.loss_scaler.scale
        for chunk, (off, n) in zip(self._chunks, self._partial_slices, strict=True):
            norm.sumsq(
                chunk.grad,
                chunk.norm_table,
                self._flags,
                scale,
                self._sq[off : off + n],
                self._bad[off : off + n],
            )
        sq_n = sum(n for _, n in self._partial_slices)
        fused_scaler = self.loss_scaler if scaler_kernel.fusable(self.loss_scaler, self._device) else None
        norm.finalize(
            self._sq[:sq_n],
            self._bad[:sq_n],
            scale,
            self._scalars,
            self.max_grad_norm,
            self._flags,
            self._steps,
            self._pgroup,
            self._hp,
            self._pscal,
            check=self._checks_grads,
            kind=self._KIND,
            scaler=fused_scaler,
        )
        for chunk in self._chunks:
            self._launch_update(chunk)
        if fused_scaler is None and type(self.loss_scaler).update is not LossScaler.update:
            self.loss_scaler.update(self._scalars[0])
            self._scalars[5].copy_(self.loss_scaler.scale)
        self._marked = [False] * len(self._trainable)
        if not capturing:
            self._reporter.record(self._scalars)
            self._tell_schedulers()
        self._stepped = True
        return loss

    def adopt_scheduler_target(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember the torch optimizer this one replaced (``bridge.fused_from_torch``): LR schedulers built on it
        write into the shared group dicts, and check that its ``step()`` ran before theirs."""
        self._replaced = weakref.ref(optimizer)

    def _tell_schedulers(self) -> None:
        replaced = self._replaced() if self._replaced is not None else None
        if replaced is not None:
            tell_schedulers(replaced)

    # --- results (reading one syncs) --------------------------------------------------------------------
    @property
    def found_inf(self) -> torch.Tensor:
        """0-d device tensor: 1.0 when the last step was skipped (no sync)."""
        return self._scalars[0]

    @property
    def _model_params(self) -> list[torch.nn.Parameter]:
        """The model's params in group order, frozen ones included (what the state dict indexes)."""
        return self._all

    def master_params(self) -> list[torch.Tensor]:
        """Views of the fp32 masters, in param order (fp32 params are their own masters)."""
        return [self._where[i][0].master_views[self._where[i][1]] for i in range(len(self._trainable))]

    def refresh_masters(self) -> None:
        """Copy the model's current weights into the masters (after an external weights-only load)."""
        with torch.no_grad():
            for chunk in self._chunks:
                if chunk.param is not None:
                    chunk.master.copy_(chunk.param)

    def flush_reports(self) -> None:
        """Wait for and log the skip reports of all steps so far (syncs)."""
        self._reporter.drain(wait=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._trainable)} params, loss_scaler={self.loss_scaler!r})"


class _DeviceResults:
    """The fused step's record (``results.StepState``'s attribute names): its values live in device memory, written
    by the finalize program without a host sync, and reading one syncs."""

    unscaled = False  # the fused step never unscales grads in place

    def __init__(self, opt: FusedOptimizer) -> None:
        self._opt = opt

    def _read(self, slot: int) -> float | None:
        return float(self._opt._scalars[slot].item()) if self._opt._stepped else None

    @property
    def step_was_skipped(self) -> bool:
        value = bool(self._read(0))
        self._opt._reporter.drain()
        return value

    @property
    def grad_norm(self) -> float | None:
        return self._read(1)

    @property
    def step_loss_scale(self) -> float | None:
        return self._read(4)

    @property
    def skipped_steps(self) -> int:
        return int(self._opt._scalars[3].item())


def _make_hook(ref: weakref.ref, i: int):
    def hook(param: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._mark(i)

    return hook
