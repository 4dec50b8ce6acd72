"""FusedOptimizer: the shared machinery of the fused optimizers (buffers, the two passes, checkpoint state).

A step runs on the device with no host sync (so it can be captured in a CUDA graph): a norm pass over the 16-bit
grads of the params that got one (``grads.py``), unscaled by the loss scale read from device memory; one finalize
program (skip, clip coefficient, per-param step counters, grad marks cleared, a ``DynamicLossScaler``'s update in
``kernels/scaler.py``; any other scaler updates with its own torch ops after the update pass); the update pass
(master and state in fp32, the 16-bit params written): a norm and an update launch per chunk, one finalize program,
and one non-blocking copy of the skip report; a skipped step is mostly host time, so every launch saved counts.

The launches run as two replays (``kernels/launch.py``): the norm pass first, before the host's checks, when every
chunk has its grad buffer, no fresh grad waits for its copy and the device holds the host's grad marks (as after a
backward that reached its end and gave every dtype of params a grad), so the device reads the grads while the host
checks; then the finalize program and the update pass. Otherwise the norm pass runs after the checks, in the same
replay as those two. When a check changes a grad or a mark (a grad assigned by hand, a ``.grad`` set to
None) the norm pass runs again with them, in the second replay, and the next step runs it after the checks, until
a step's checks change nothing. A step the checks refuse launches no finalize program or update pass (the early
norm pass writes only its partial sums, which the next norm pass rewrites). A device left idle by a synchronize
thus waits for the host's checks only past the norm pass (at 268M params 0.54 GB of 16-bit grads, about 0.18 ms at
an H100's copy bandwidth); the results are the same kernels' on the same inputs, bit for bit. FSDP2's shards,
``process_group=`` and a step being captured keep the single replay.

Each algorithm is a subclass that keeps this protocol, which the sharded fused local step
(``sharded/fused_step.py``) reads too: ``KIND`` (the ``kernels.slots.Kind`` picking the finalize branch and the
update kernel), ``STATE_NAMES`` (its elementwise state, a flat fp32 buffer per chunk), ``hp_row(group)`` (the
group's hyper-parameter row), ``group_state(group)`` and ``initial_value(name, group)`` (the state a group's params
hold, and its value at a param's first update), ``step_count(state)`` (the kernels' count of a torch-format entry).

Checkpoints are in the exact path's format and hold fp32 masters (split ones joined), so they move between the
paths and master storages; ``load_state_dict()`` also takes a plain torch optimizer state dict. Every master read
or write goes through the chunk (``layout.Chunk``), which knows its storage.
"""

from __future__ import annotations

import weakref
from itertools import accumulate
from typing import Any

import torch

from ...kernels import interpreted, triton_status
from ...kernels.launch import together
from ...kernels.settings import settings
from ...kernels.slots import PSCAL_WIDTH, HyperTable, Kind
from ...precision import GRAD_ACCUM
from ...scaler import LossScaler
from ..accumulate import check_process_group
from ..base import MixedPrecisionOptimizer
from ..checks import check_dtypes, check_grad_accum_dtype, check_unfrozen, check_unwrapped, tell_schedulers
from ..chunk import Chunk, chunk_params, interpreter_reason
from ..masters import check_masters
from ..mesh import Mesh, check_sharded_options, local
from ..results import Delivered
from ..state import adopt_views
from .grads import GradViews, stream_capturing
from .results import DeviceResults, SkipReporter

__all__ = ["FusedOptimizer", "check_number"]

_NORM_SITE = "fused norm pass"  # the launch site of the norm pass run before the checks (kernels/launch.py)

# implementation flags torch's optimizers keep in every group; the fused step is none of them
_TORCH_FLAGS = {"foreach": None, "differentiable": False, "fused": None}


def check_number(name: str, value: Any, lo: float, hi: float | None, index: int) -> None:
    """ValueError unless ``lo <= value`` (and ``value < hi``), naming the group and the value."""
    v = float(value)
    if not (v >= lo and (hi is None or v < hi)):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"param group {index}: {name} must be {bound}, got {value!r}")


class FusedOptimizer(MixedPrecisionOptimizer):
    """The fused strategy of ``MixedPrecisionOptimizer``: it owns its param groups (``optimizer`` is None) and
    holds its state in flat buffers, allocated at the first update. Every subclass takes, after its
    hyper-parameters, the keyword-only options of ``MixedPrecisionOptimizer`` and ``masters``: ``"fp32"``
    (default) or ``"split"``, exact fp32 masters of bf16 params in 2 bytes per param (docs/split-masters.md;
    ValueError for fp16 params).

    Clipping is the finalize program's: ``max_grad_norm`` is read at every step, so a caller may set it for the
    coming step only (the integrations do, for ``gradient_clip_val`` and ``max_grad_norm``), and ``grad_norm``
    reads back that step's unscaled norm before clipping. The grads are never unscaled in place (``unscale_``
    refuses); ``unscaled_grads()`` returns unscaled fp32 copies for hooks that read them.
    """

    impl = "triton"
    unscales_in_place = False  # unscaling is folded into the update kernel (unscaled_grads() for reading)

    KIND: Kind
    STATE_NAMES: tuple[str, ...] = ()
    _EAGER_STATE = False  # torch creates the state in its constructor (Adagrad): exported before any step too
    _NONNEGATIVE: tuple[str, ...] = ()  # group values that must be >= 0
    _UNSUPPORTED: tuple[str, ...] = ("maximize",)  # torch flags the kernels lack
    _TORCH_NAME: str  # the torch optimizer with the same update, which has them

    def __init__(
        self,
        params,
        hyper: dict[str, Any],
        *,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
        grad_accum_dtype: str = "param",
        masters: str = "fp32",
        process_group: Any = None,
    ) -> None:
        ok, why = triton_status()
        if not ok:
            raise ValueError(
                f"{type(self).__name__} needs Triton: {why}; or use the torch path "
                "(halfprec.MixedPrecisionOptimizer over a torch optimizer)"
            )
        super().__init__(
            loss_scaler=loss_scaler, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
            param_dtype=param_dtype,
        )  # fmt: skip
        self._built = False
        self.process_group = process_group
        torch.optim.Optimizer.__init__(self, params, {**hyper, **_TORCH_FLAGS})  # owns its groups
        # FSDP2's shards (DTensors, mesh.py): the kernels write the 16-bit local shards in place (fp32 shards are
        # staged in the flat masters: chunk.py); FSDP2 reduces each grad before the fp32 sum, as ZeRO does
        self._mesh = Mesh.of([p for g in self.param_groups for p in g["params"] if p.requires_grad])
        self.grad_accum_dtype = check_grad_accum_dtype(
            grad_accum_dtype,
            strategy="fused" if self._mesh is None else "sharded",
            process_group=process_group,
        )
        check_process_group(process_group, self.grad_accum_dtype)
        trained = [p.dtype for g in self.param_groups for p in g["params"] if p.requires_grad]
        check_masters(masters, [param_dtype, *trained])  # before any param is cast
        self.masters = masters
        self._build()
        self._built = True
        self._init_scaler(loss_scaler, dtypes={c.dtype for c in self._chunks}, device=self._device)
        self._reporter = SkipReporter(self._skip_log, self.loss_scaler, self._scalars)
        self._state_ready = False  # state buffers exist (allocated at the first step, a load or an export)
        self._s = DeviceResults(self._scalars, self._reporter)
        self._replaced: weakref.ref | None = None  # the torch optimizer this one replaced (its schedulers)
        # the norm pass may run before the checks (_step): the last step's checks changed no grad
        self._early_norm = True

    # --- construction --------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._built:
            raise RuntimeError(
                f"{type(self).__name__} lays out its flat buffers at construction: pass every "
                "param group to the constructor"
            )
        torch.optim.Optimizer.add_param_group(self, param_group)  # the groups are this object's own
        self._validate_group(self.param_groups[-1], len(self.param_groups) - 1)

    def _build(self) -> None:
        cfg = settings()
        self._model_params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        if self._mesh is not None:
            check_sharded_options(
                self._model_params, param_dtype=self.param_dtype, process_group=self.process_group
            )
            if self.KIND == Kind.LAMB:
                raise ValueError(
                    f"{type(self).__name__}'s trust ratio needs each whole param's norm, and these params are FSDP2 "
                    "shards (DTensors): use an elementwise optimizer (FusedAdamW, FusedAdam, FusedSGD, "
                    "FusedAdagrad) over them"
                )
        check_unwrapped(
            self._model_params,
            type(self).__name__,
            "use MixedPrecisionOptimizer(torch optimizer, impl='torch')",
        )
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
        self._device = dev = devices.pop() if devices else torch.device("cpu")
        if dev.type != "cuda" and not interpreted():
            raise ValueError(
                f"the fused optimizers run on CUDA params, got params on {dev}; move the "
                "model to CUDA or use the torch path"
            )
        self._trainable = trainable
        self._dtypes = [p.dtype for p in trainable]  # when built: a later model.half() is refused at step()
        self._group_of = group_of
        self._index = {p: i for i, p in enumerate(trainable)}
        # frozen when built: never trained
        self._frozen = [p for p in self._model_params if p not in self._index]
        if (why := interpreter_reason(trainable)) is not None:
            raise ValueError(f"{why}: unset TRITON_INTERPRET (or train on the CPU)")
        sources = [originals.get(p, p.data) for p in trainable]
        placed = chunk_params(trainable, sources, flat_params=True, masters=self.masters)
        self._chunks: list[Chunk] = [chunk for chunk, _ in placed]
        # per chunk: the rows of the norm and update kernels (layout.build_table; shards written in place: their
        # own update rows, chunk.plan_updates)
        self._norm_tables = [chunk.table(idx, cfg.norm_block) for chunk, idx in placed]
        self._update_tables = [
            None if chunk.in_place else chunk.table(idx, cfg.update_block) for chunk, idx in placed
        ]
        for chunk, idx in placed:
            chunk.plan_updates(idx, cfg.update_block)
        where = {i: (chunk, local) for chunk, idx in placed for local, i in enumerate(idx)}
        self._where: list[tuple[Chunk, int]] = [where[i] for i in range(len(trainable))]
        self._n_partials = sum(t.shape[0] for t in self._norm_tables)  # one per norm program
        n_partials = max(self._n_partials, 1)
        n = max(len(trainable), 1)
        self._sq = torch.zeros(n_partials, dtype=torch.float32, device=dev)
        self._bad = torch.zeros(n_partials, dtype=torch.float32, device=dev)
        # the slices each step passes, made once (a slice is host time before the step's launch): each chunk's
        # norm launch's partial sums and non-finite counts, and the finalize program's (over FSDP2 shards at least
        # one: the mesh's reduction writes it)
        starts = [0, *accumulate(t.shape[0] for t in self._norm_tables)]
        self._norm_launches = [
            (table, self._sq[a:b], self._bad[a:b])
            for table, a, b in zip(self._norm_tables, starts[:-1], starts[1:], strict=True)
        ]
        k = self._n_partials if self._mesh is None else n_partials
        self._partials = (self._sq[:k], self._bad[:k])
        self._steps = torch.zeros(n, dtype=torch.float32, device=dev)
        self._pgroup = torch.tensor(group_of or [0], dtype=torch.int32).to(dev)
        self._pscal = torch.zeros(n, PSCAL_WIDTH, dtype=torch.float32, device=dev)
        self._hyper = HyperTable(len(self.param_groups), dev)
        self._scalars = torch.zeros(8, dtype=torch.float32, device=dev)
        accum = GRAD_ACCUM[self.grad_accum_dtype]
        # FSDP2 with fp32 sums: a no-sync backward delivers no sharded grad, which the step refuses
        delivered = Delivered(self._scale_guard) if self._mesh is not None and accum is not None else None
        self._grads = GradViews(trainable, self._where, dev, accum, delivered)

    # --- per-algorithm hooks (subclasses) --------------------------------------------------------------
    def _validate_group(self, group: dict[str, Any], index: int) -> None:
        for name in self._NONNEGATIVE:
            check_number(name, group[name], 0.0, None, index)
        for flag in self._UNSUPPORTED:
            if group.get(flag, False):
                raise ValueError(
                    f"param group {index}: {flag}=True is not supported by {type(self).__name__}; use the torch "
                    f"path (halfprec.MixedPrecisionOptimizer over {self._TORCH_NAME})"
                )

    @classmethod
    def hp_row(cls, group: dict[str, Any]) -> list[Any]:
        """The group's row of the finalize program's hyper-parameter table (``kernels/slots.py``)."""
        raise NotImplementedError

    @classmethod
    def group_state(cls, group: dict[str, Any]) -> tuple[str, ...]:
        """The state a param of ``group`` holds once stepped (SGD: its momentum buffer only with momentum)."""
        return cls.STATE_NAMES

    @classmethod
    def initial_value(cls, name: str, group: dict[str, Any]) -> float:
        """The value state ``name`` starts from at a param's first update, as torch creates it."""
        return 0.0

    @classmethod
    def step_count(cls, state: dict[str, Any] | None) -> float | None:
        """The step count the kernels take from a param's torch-format state (None: it has no state yet)."""
        return float(state["step"]) if state and "step" in state else None

    def _ensure_state(self, *, reset: bool = False) -> None:
        """Allocate the state buffers (at every step, and a load or export), as torch does at a param's first update;
        the first call or a ``reset`` (a load) starts them at zero, and eager state at its initial value."""
        for name in {name for group in self.param_groups for name in self.group_state(group)}:
            for chunk in self._chunks:
                chunk.add_state(name)
        if reset:
            for chunk in self._chunks:
                for buf in chunk.state.values():
                    buf.zero_()
        if self._EAGER_STATE and (reset or not self._state_ready):
            for i, gi in enumerate(self._group_of):
                group = self.param_groups[gi]
                for name in self.group_state(group):
                    self._state_view(name, i).fill_(self.initial_value(name, group))
        self._state_ready = True

    def _drop_state(self) -> None:
        """Back to before the first update: the state buffers come into being at the next step."""
        for chunk in self._chunks:
            chunk.state.clear()
        self._state_ready = False

    def _launch_update(self, k: int) -> None:
        from ...kernels.update import update

        chunk, table = self._chunks[k], self._update_tables[k]
        state = [chunk.state[name] for name in self.STATE_NAMES if name in chunk.state]
        param, master = chunk.kernel_buffers()
        for rows, aligned, shift in chunk.update_rows if chunk.in_place else [(table, True, None)]:
            update(
                self.KIND, param, chunk.grad, master, state, rows, self._pscal, self._scalars, aligned=aligned,
                shift=shift,
            )  # fmt: skip

    def _state_view(self, name: str, i: int) -> torch.Tensor:
        chunk, local = self._where[i]
        chunk.add_state(name)
        return chunk.view(chunk.state[name], local)

    def _export_state(self, i: int, step: float) -> dict[str, Any]:
        """Param ``i``'s torch-format state (``step`` and the state buffers; none before its first step)."""
        if step == 0 and not self._EAGER_STATE:
            return {}
        state: dict[str, Any] = {"step": torch.tensor(step, dtype=torch.float32)}
        return state | {name: self._state_view(name, i).clone() for name in self.STATE_NAMES}

    def _import_state(self, i: int, saved: dict[str, Any]) -> float:
        """Copy a torch-format state entry into the buffers (an FSDP2 shard's DTensor state: its local rows);
        return the step count to set."""
        step = self.step_count(saved)
        if not step:
            return 0.0  # no state yet (Adagrad's constructor-made one: keep ours, a 16-bit copy is not exact)
        adopt_views(
            {k: local(v) for k, v in saved.items()}, self.STATE_NAMES, lambda name: self._state_view(name, i)
        )
        return step

    # --- grads ---------------------------------------------------------------------------------------
    def _backward_params(self) -> list[torch.Tensor]:
        """The params whose ``.grad`` a backward fills; with fp32 accumulation the fp32 masters too (``grads.py``)."""
        held = self.grad_accum_dtype == "fp32" and self.masters == "fp32"
        return self._model_params + (self.master_params() if held else [])

    def mark_grads(self) -> None:
        """Count every trainable param's ``.grad`` as this step's (what backward's hooks do per param): for callers
        that write the flat grad buffers themselves, e.g. a benchmark replaying a captured step."""
        for i, p in enumerate(self._trainable):
            if p.grad is not None:
                self._grads.mark(i)
        if not stream_capturing():  # a captured mark writes the device's itself
            self._grads.write_marks()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's grads. ``set_to_none=False`` zeroes the flat buffers and keeps ``.grad`` as views
        (the next backward then needs no copy); params that get no grad are still not updated."""
        for p in self._frozen:
            p.grad = None  # as torch's zero_grad clears every param of the groups
        self._grads.clear(self._chunks, set_to_none)

    def unscale_(self) -> None:
        raise RuntimeError(
            f"{type(self).__name__} folds unscaling and clipping into its update kernel, so the grads are never "
            "unscaled in place: to clip, set max_grad_norm (read at every step, so it may change per step; the "
            "pre-clip norm is grad_norm after step()); to read unscaled grads, call unscaled_grads() (fp32 copies); "
            "to edit grads before the step, use the torch path (impl='torch')"
        )

    @torch.no_grad()
    def unscaled_grads(self) -> list[torch.Tensor | None]:
        """fp32 copies of the grads the params hold now, divided by the loss scale, in ``master_params()`` order
        (None where a param has no grad): the values the exact path's ``unscale_()`` puts in the master grads,
        bit for bit. For hooks that read unscaled grads (logging, norms): 4 bytes per element while the caller
        keeps them, nothing otherwise. The step does not read them: editing them changes nothing."""
        inv = self.loss_scaler.inv_scale()
        held = (self._grads.held(i) for i in range(len(self._trainable)))
        return [None if g is None else g.to(torch.float32, copy=True).mul_(inv) for g in held]

    # --- the step --------------------------------------------------------------------------------------
    def _upload_hyper(self, capturing: bool) -> None:
        self._hyper.upload([self.hp_row(g) for g in self.param_groups], capturing)

    def _launch_norm_pass(self) -> None:
        """Pass 1's first kernel: each chunk's partial sums of squares and non-finite counts."""
        from ...kernels import norm

        scale, flags = self.loss_scaler.scale, self._grads.flags
        for chunk, (table, sq, bad) in zip(self._chunks, self._norm_launches, strict=True):
            norm.sumsq(chunk.grad, table, flags, scale, sq, bad)

    @torch.no_grad()
    def _step(self) -> None:
        from ...kernels import norm
        from ...kernels import scaler as scaler_kernel

        capturing = stream_capturing()
        if capturing and self._mesh is not None:
            raise RuntimeError(
                f"{type(self).__name__} over FSDP2 shards cannot be captured in a CUDA graph (FSDP2 hands over new "
                "sharded grad tensors each backward, which a replay would not read, and their collectives are "
                "FSDP2's); step it eagerly"
            )
        if capturing and not self._state_ready:
            raise RuntimeError(
                f"{type(self).__name__} allocates its state at the first step, which cannot happen during CUDA "
                "graph capture: run one eager step before capturing"
            )
        # the norm pass first, on its own, when the buffers and the device's marks already hold the grads: the
        # device runs it while the host checks (module docstring); launched again below if the checks change a grad
        early = (
            self._early_norm
            and not capturing
            and self._mesh is None
            and self.process_group is None
            and self._grads.on_device(self._chunks)
        )
        if early:
            with together(_NORM_SITE):
                self._launch_norm_pass()
        if not capturing:
            check_unfrozen(self._frozen)
            check_dtypes(self._trainable, self._dtypes)
            changed = self._grads.adopt(type(self).__name__)
            # a change wastes the early pass: not tried again until a step's checks change nothing (DDP's
            # gradient_as_bucket_view hands over its buckets as new .grad tensors at every step)
            early, self._early_norm = early and not changed, not changed
            self._ensure_state()
            for chunk in self._chunks:
                chunk.take_own_masters()
        self._grads.ready(self._chunks, capturing=capturing)
        if self.process_group is not None:
            if capturing:
                raise RuntimeError(
                    f"{type(self).__name__} with process_group= cannot be captured in a CUDA graph (its all-reduce "
                    "zeroes, on the host's say, the grads of params that got none on this rank); step it eagerly"
                )
            self._grads.all_reduce(self._chunks, self.process_group)
        self._upload_hyper(capturing)
        scale, flags = self.loss_scaler.scale, self._grads.flags
        if self._mesh is not None:
            # every rank's norm and skip are the whole grads' (on every rank of the mesh): the partials all-reduced
            self._launch_norm_pass()
            self._mesh.reduce_partials(self._sq, self._bad, self._n_partials)
        fused_scaler = self.loss_scaler if scaler_kernel.fusable(self.loss_scaler, self._device) else None
        scaler_after = fused_scaler is None and type(self.loss_scaler).update is not LossScaler.update
        # the skip record is copied once the finalize program has run, while the update pass runs (results.py)
        events = None if capturing or scaler_after else self._reporter.events(self._device)
        # the finalize program and the update pass (and the norm pass, unless it ran before the checks with what
        # they left): one launch (a graph replay) once the host's checks are done, so the device runs them back to back
        with together() as launches:
            if self._mesh is None and not early:
                self._launch_norm_pass()
            if events is not None:
                launches.wait(events[0])  # the last record's copy, before the slots are overwritten
            norm.finalize(
                *self._partials, scale, self._scalars, self.max_grad_norm, flags, self._steps,
                self._pgroup, self._hyper.table, self._pscal, check=self._checks_grads, kind=self.KIND,
                scaler=fused_scaler,
            )  # fmt: skip
            if events is not None:
                launches.record(events[1])
            for k in range(len(self._chunks)):
                self._launch_update(k)
        for chunk in self._chunks:
            chunk.copy_out()
        self._grads.consumed()
        if capturing:
            self._reporter.captured()
        else:
            self._reporter.drain()  # the earlier steps' records that have landed: once the device has its work
            if not scaler_after:
                self._reporter.record(after=None if events is None else events[1])
        if scaler_after:
            self.loss_scaler.update(self._scalars[0])
            self._reporter.fence()  # a side-stream copy of an earlier record may still read the slots
            self._scalars[5].copy_(self.loss_scaler.scale)
            if not capturing:
                self._reporter.record()
        if not capturing and self._replaced is not None and (replaced := self._replaced()) is not None:
            tell_schedulers(replaced)
        self._s.stepped = True

    def adopt_scheduler_target(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember the torch optimizer this one replaced (``select.fused_from_torch``): LR schedulers built on it
        write into the shared group dicts, and check that its ``step()`` ran before theirs."""
        self._replaced = weakref.ref(optimizer)

    # --- results (reading one waits: results.py) ------------------------------------------------------
    @property
    def found_inf(self) -> torch.Tensor:
        """0-d device tensor: 1.0 when the last step was skipped (no sync)."""
        return self._scalars[0]

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, in param order (fp32 params are their own masters): views, or with
        ``masters="split"`` joined copies of the bf16 params' masters (writing to those changes nothing)."""
        for chunk in self._chunks:
            chunk.take_own_masters()
        return [chunk.master(local) for chunk, local in self._where]

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the model's current weights into the masters (after an external weights-only load; split
        masters: the low halves become zero). FSDP2's shards are taken where they live now."""
        for chunk in self._chunks:
            chunk.point_params()
            chunk.copy_in()
            chunk.reset_masters()

    def flush_reports(self) -> None:
        """Wait for and log the skip reports of all steps so far (syncs)."""
        self._reporter.drain(wait=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._trainable)} params, loss_scaler={self.loss_scaler!r})"

    # --- the state-dict payload (see the module docstring) ---------------------------------------------
    def _payload(self) -> dict[str, Any]:
        self._reporter.drain(wait=True)
        steps = self._steps.cpu().tolist()
        if self._EAGER_STATE or any(steps):  # before the first update there is nothing to export
            self._ensure_state()
        state: dict[int, dict[str, Any]] = {}
        masters: dict[int, torch.Tensor] = {}
        for k, p in enumerate(self._model_params):  # the state dict's param indices
            i = self._index.get(p)
            if i is not None and (exported := self._export_state(i, steps[i])):
                state[k] = exported
            if i is not None and p.dtype != torch.float32:
                chunk, local = self._where[i]
                masters[k] = chunk.master(local).clone()
        groups, k = [], 0
        for group in self.param_groups:
            saved = {key: v for key, v in group.items() if key != "params"}
            groups.append(saved | {"params": list(range(k, k + len(group["params"])))})
            k += len(group["params"])
        return self._model_space_payload({"state": state, "param_groups": groups}, masters)

    def _param_entries(self) -> list[dict[str, Any]]:
        held = {p for p in self._trainable if p.dtype != torch.float32}  # the params with an fp32 master
        return [
            {"shape": list(p.shape), "dtype": str(p.dtype), "master": p in held} for p in self._model_params
        ]

    @property
    def collective(self) -> bool:
        """FSDP2 shards' masters and state are spread over the mesh (ZeRO-0's are reduced over its group): the
        ranks save them together."""
        return self.process_group is not None or self._mesh is not None

    def _load_payload(self, state_dict: dict[str, Any]) -> None:
        self._load_torch_state(state_dict["optimizer"])
        with torch.no_grad():
            for chunk in self._chunks:
                chunk.point_params()  # FSDP2's shards, where they live now: the load writes them
                chunk.take_own_masters()
            for k, value in state_dict["masters"].items():
                chunk, j = self._where[self._index[self._model_params[int(k)]]]
                chunk.load_master(j, local(value))  # an FSDP2 shard's: its rows here
            for chunk in self._chunks:
                chunk.round_params()
                chunk.copy_out()

    def _load_torch_state(self, inner: dict[str, Any]) -> None:
        saved_groups = inner["param_groups"]
        updates = [{key: v for key, v in saved.items() if key != "params"} for saved in saved_groups]
        for gi, (group, new) in enumerate(zip(self.param_groups, updates, strict=True)):
            self._validate_group(group | new, gi)  # on a copy: a refused load changes nothing
        for group, new in zip(self.param_groups, updates, strict=True):
            group.update(new)
        steps = [0.0] * len(self._trainable)
        with torch.no_grad():
            saved_state = {int(k): v for k, v in inner["state"].items()}
            stepped = any(self.step_count(v) for v in saved_state.values())
            if stepped or self._EAGER_STATE or self._grads.pinned:  # pinned: a CUDA graph holds the buffers
                self._ensure_state(reset=True)
            else:  # a state dict from before the first update (Accelerate's prepare() round-trips one)
                self._drop_state()
            for k, p in enumerate(self._model_params):
                i = self._index.get(p)
                if i is not None and k in saved_state:
                    steps[i] = self._import_state(i, saved_state[k])
            self._steps.copy_(torch.tensor(steps or [0.0], dtype=torch.float32))
