"""The exact strategy: the wrapped torch optimizer's own step, run on FP32 masters.

``unscale_()`` copies the 16-bit grads into fp32 master grads (or, with ``grad_accum_dtype="fp32"``, takes
the fp32 sums ``accumulate.py`` kept) and divides them by the loss scale, exactly (scales are powers of two); the
step computes the global norm, updates the scaler, and unless the step is skipped clips, runs the inner torch step
on the masters and rounds them into the model (to nearest even). N steps equal N steps of the plain torch optimizer
on fp32 copies, bit for bit, state included (docs/guarantees.md).

Over params sharded by ``fully_shard`` (FSDP2's DTensors, ``mesh.py``) the same step runs on the local shards:
masters of this rank's rows, the global norm and overflow flag reduced over the mesh, the masters rounded back
into the shards; its ``state_dict()`` holds them as DTensors (``state.laid_out_like_params``), which
``torch.distributed.checkpoint`` reshards, as ``halfprec.distributed.checkpoint`` does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..precision import LOW_PRECISION
from ..scaler import LossScaler
from .accumulate import GradAccumulator, all_reduce_master_grads, check_process_group
from .base import MixedPrecisionOptimizer, check_wrappable
from .checks import (
    check_dtypes,
    check_elementwise,
    check_grad_accum_dtype,
    check_params,
    check_unfrozen,
    clear_grads,
)
from .chunk import MasterStore
from .clip import clip_coefficient
from .mesh import Mesh, check_sharded_options, local, local_grad
from .results import GradMarks
from .state import Target, local_state, move_state, restore_state_dtypes

__all__ = ["ExactMixedPrecisionOptimizer"]


class ExactMixedPrecisionOptimizer(MixedPrecisionOptimizer):
    """``optimizer``'s step on fp32 masters of its 16-bit params (``MixedPrecisionOptimizer(..., impl="torch")``).

    Args beyond the contract's (``MixedPrecisionOptimizer``):
        grad_accum_dtype: ``"param"`` accumulates micro-batch grads in the params' 16-bit ``.grad``; ``"fp32"``
            adds each 16-bit grad, as backward produces it, into its fp32 master grad and releases it
            (``accumulate.py``: one fp32 rounding per micro-batch, no extra memory).
        process_group: ``None``: no data parallelism (or DDP, with ``grad_accum_dtype="param"``); a process group
            with ``grad_accum_dtype="fp32"``: ZeRO-0 instead of DDP (do not wrap the model): ``step()``
            takes the mean of the ranks' fp32 sums (``accumulate.py``).
    """

    _accumulator: GradAccumulator | None = None  # the fp32 accumulation's hooks
    _mesh: Mesh | None = None  # the mesh of FSDP2-sharded (DTensor) params: masters of local shards (mesh.py)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
        grad_accum_dtype: str = "param",
        process_group: Any = None,
    ) -> None:
        check_wrappable(optimizer)
        super().__init__(
            loss_scaler=loss_scaler, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
            param_dtype=param_dtype, wrapped=optimizer,
        )  # fmt: skip
        trained = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._mesh = Mesh.of(trained)
        if self._mesh is not None:
            check_elementwise(optimizer, "each rank's FSDP2 shards of the params")
            check_sharded_options(trained, param_dtype=param_dtype, process_group=process_group)
        self.grad_accum_dtype = check_grad_accum_dtype(
            grad_accum_dtype,
            strategy="torch" if self._mesh is None else "sharded",
            process_group=process_group,
        )
        check_process_group(process_group, grad_accum_dtype)
        self.process_group = process_group
        self._store = MasterStore()
        self._own: list[torch.nn.Parameter] = []  # trainable params that are their own masters (fp32/fp64)
        self._trained: list[torch.nn.Parameter] = []  # those trainable when wrapped: a master or their own
        self._trained_dtypes: list[torch.dtype] = []  # their dtypes when wrapped (after the param_dtype cast)
        self._frozen: list[torch.nn.Parameter] = []  # those frozen when wrapped: no master, never trained
        mapping = self._build_masters(optimizer.param_groups)
        move_state(optimizer, {p: Target(m, 0, m.numel()) for p, m in mapping.items()})
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(p, p) for p in group["params"]]

        devices = {p.device for p in self._trained}
        if len(devices) > 1:
            raise ValueError(
                f"trainable params span several devices {sorted(map(str, devices))}; halfprec keeps one loss "
                "scale per optimizer: build one MixedPrecisionOptimizer per device"
            )
        device = devices.pop() if devices else torch.device("cpu")
        self._init_scaler(loss_scaler, dtypes={p.dtype for p in self._trained}, device=device)
        if grad_accum_dtype == "fp32":
            guard = None if self._mesh is None else self._scale_guard
            self._accumulator = GradAccumulator(self._store, self._s, backwards=guard)

    @property
    def collective(self) -> bool:
        """FSDP2-sharded params' masters and state are spread over the mesh: its ranks save them together."""
        return self.process_group is not None or self._mesh is not None

    # --- params --------------------------------------------------------------------------------------
    def _build_masters(self, groups: list[dict[str, Any]]) -> dict:
        originals: dict[torch.Tensor, torch.Tensor] = {}
        low: list[torch.nn.Parameter] = []
        for group in groups:
            for p in group["params"]:
                self._model_params.append(p)
                if not p.requires_grad:
                    self._frozen.append(p)
                    continue
                self._trained.append(p)
                self._cast_to_param_dtype(p, originals)
                self._trained_dtypes.append(p.dtype)
                if p.dtype in LOW_PRECISION:
                    low.append(p)
                else:
                    self._own.append(p)
        return self._store.add(low, originals)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = [group["params"]] if torch.is_tensor(group["params"]) else list(group["params"])
        check_params(params, known=set(self._model_params))
        if group.get("differentiable", False):
            raise ValueError(
                "add_param_group got differentiable=True; halfprec's step runs under no_grad: leave it False"
            )
        if self.loss_scaler.is_unit and not self._has_fp16:
            new_fp16 = [p for p in params if p.requires_grad and p.dtype == torch.float16]
            if new_fp16:
                raise ValueError(
                    f"add_param_group adds fp16 params (first of shape {tuple(new_fp16[0].shape)}) to an optimizer "
                    "built without loss scaling; pass loss_scaler=halfprec.DynamicLossScaler() when building it"
                )
        devices = {p.device for p in params if p.requires_grad} | {self.loss_scaler.device}
        if len(devices) > 1:
            raise ValueError(
                f"add_param_group adds params on {sorted(map(str, devices))}; one MixedPrecisionOptimizer keeps "
                "one device: build another optimizer for the other device"
            )
        self._mesh = Mesh.of(self._trained + [p for p in params if p.requires_grad])
        mapping = self._build_masters([{"params": params}])
        if self._accumulator is not None:
            self._accumulator.hook_new_chunks()
        group["params"] = [mapping.get(p, p) for p in params]
        self.optimizer.add_param_group(group)
        self._has_fp16 = self._has_fp16 or any(p.dtype == torch.float16 for p in self._trained)

    def master_params(self) -> list[torch.Tensor]:
        updated = set(self._own) | set(self._store.master_params())
        return [p for g in self.param_groups for p in g["params"] if p in updated]

    def refresh_masters(self) -> None:
        self._store.refresh_from_params()

    def _backward_params(self) -> list[torch.nn.Parameter]:
        return self._model_params + self._accumulated()

    def _grad_holders(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` a step consumes (``GradMarks`` of a step)."""
        return self._trained + self._accumulated()

    def _accumulated(self) -> list[torch.nn.Parameter]:
        """The masters when fp32 accumulation's hooks move the 16-bit grads into theirs, else none."""
        return [] if self._accumulator is None else self._store.master_params()

    # --- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def unscale_(self) -> None:
        """Fill the fp32 master grads from the model grads and divide by the loss scale. Idempotent."""
        if self._s.unscaled:
            return
        check_unfrozen(self._frozen)
        check_dtypes(self._trained, self._trained_dtypes)
        self._store.check_devices()
        stepped = self._s.stepped_grads
        if stepped is not None and stepped.marks and stepped.same(self._grad_holders()):
            raise RuntimeError(
                "step() called again without a new backward(): these grads were already applied (and fp32 grads "
                "unscaled in place); call zero_grad() and backward() before the next step()"
            )
        filled = self._store.copy_grads_in() if self._accumulator is None else self._accumulator.collect()
        if self.process_group is not None:
            filled = all_reduce_master_grads(self._store, self._own, self.process_group)
        own = [local_grad(p) for p in self._own if p.grad is not None]
        if filled + own and not self.loss_scaler.is_unit:
            torch._foreach_mul_(filled + own, self.loss_scaler.inv_scale())
        # param-group order, as clip_grad_norm_(mp.master_params()) sums them: the norm's bits depend on it
        self._s.grads = [local_grad(m) for m in self.master_params() if m.grad is not None]
        self._s.unscaled_grads = GradMarks(self._store.model_params())
        self._s.unscaled = True

    @torch.no_grad()
    def _step(self) -> None:
        if self._s.unscaled and not self._s.unscaled_grads.same(self._store.model_params()):
            self._s.unscaled = False
            raise RuntimeError(
                "the model's gradients changed after unscale_() (another backward() or zero_grad() ran); "
                "call unscale_() after the last backward() of the step, right before step()"
            )
        self.unscale_()
        grads, self._s.unscaled = self._s.grads, False
        check = self._checks_grads
        norm = None
        device = self.loss_scaler.device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if self._mesh is not None and (check or self.max_grad_norm is not None):
            norm, found_inf = self._mesh.norm_and_flag(grads, check=check, device=device)  # on every rank
        elif grads and (check or self.max_grad_norm is not None):
            norm = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
            if check:
                found_inf = (~torch.isfinite(norm)).to(device=device, dtype=torch.float32)
        values = self.loss_scaler.step_update(found_inf)
        if norm is not None:
            values = torch.cat([values, norm.to(device=device, dtype=torch.float32).reshape(1)])
        values = values.tolist()  # the one host sync of the step
        self._record_step(values, values[4] if norm is not None else None)
        if not self._s.step_was_skipped:
            if self.max_grad_norm is not None:
                grads = [local_grad(m) for m in self.master_params() if m.grad is not None]
                torch._foreach_mul_(grads, clip_coefficient(self.max_grad_norm, norm).to(grads[0].device))
            self.optimizer.step()
            self._store.copy_params_out()
        self._s.stepped_grads = GradMarks(self._grad_holders())  # after clipping, which bumps grad versions

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of every param of the groups, frozen ones included (as torch does)."""
        clear_grads(self._model_params, set_to_none)
        self._store.clear_grads(set_to_none)
        if self._accumulator is not None:
            self._accumulator.cleared()
        self._s.unscaled = False
        self._s.stepped_grads = None

    # --- the state-dict payload ----------------------------------------------------------------------
    def _param_entries(self) -> list[dict[str, Any]]:
        masters = set(self._store.master_params())
        params = self._index_params()
        return [
            {"shape": list(m.shape), "dtype": str(m.dtype), "master": p in masters}
            for p, m in zip(params, self._model_params, strict=True)
        ]

    def _payload(self) -> dict[str, Any]:
        masters = set(self._store.master_params())
        params = self._index_params()
        held = {i: p.detach() for i, p in enumerate(params) if p in masters}
        return self._model_space_payload(self.optimizer.state_dict(), held)

    def _load_payload(self, state_dict: dict[str, Any]) -> None:
        self._load_torch_state(state_dict["optimizer"])
        params = self._index_params()
        with torch.no_grad():
            for index, value in state_dict["masters"].items():
                params[int(index)].copy_(local(value))  # an FSDP2 shard's: its rows here
        self._store.copy_params_out()

    def _load_torch_state(self, state_dict: dict[str, Any]) -> None:
        params = self._index_params()
        state_dict = state_dict | {"state": local_state(state_dict["state"], params)}
        self.optimizer.load_state_dict(state_dict)
        restore_state_dtypes(self.optimizer, state_dict["state"], params)

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r})"
