"""MixedPrecisionOptimizer: FP32 master weights and loss scaling around any ``torch.optim.Optimizer``.

A step, in order:

1. ``unscale_()`` (implicit if not called): copy the 16-bit model grads into fp32 master grads and multiply by
   the reciprocal of the loss scale (a power of two, so exact); fp32 params are their own masters and are
   unscaled in place.
2. The global L2 norm of the unscaled grads, as ``torch.nn.utils.get_total_norm`` computes it. It is needed
   for clipping and is the non-finite check: the norm is finite iff every grad is finite (a finite fp32 norm
   that overflows is not usable for clipping either). fp16 is always checked; bf16/fp32 when
   ``skip_nonfinite``.
3. The scaler updates on the device; then one host sync reads the overflow flag.
4. Overflow: the inner step is skipped, nothing but the scaler and ``skipped_steps`` changes, and one log
   record says so. Otherwise: clip with ``torch.nn.utils.clip_grads_with_norm_`` (bit-identical to
   ``clip_grad_norm_``), run the inner optimizer on the masters, round the masters into the model params.

The wrapped optimizer is never stepped on construction and its math is never changed.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .masters import LOW_PRECISION, MasterStore
from .migrate import migrate_state, restore_state_dtypes
from .options import check_options, check_saved_groups, check_unfrozen, clear_grads, min_scale_message
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .wrapper import WrappingOptimizer

__all__ = ["MixedPrecisionOptimizer"]

logger = logging.getLogger("halfprec")

_FORMAT = "halfprec.MixedPrecisionOptimizer/1"
_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype)


class MixedPrecisionOptimizer(WrappingOptimizer):
    """Give ``optimizer`` FP32 master weights for a model held in FP16/BF16.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's params (16-bit, or fp32 with ``param_dtype``).
        loss_scaler: a ``StaticLossScaler`` or ``DynamicLossScaler``. ``None`` means ``DynamicLossScaler()``
            when any trainable param is fp16, else no scaling (``StaticLossScaler(1.0)``).
        max_grad_norm: clip the global L2 norm of the unscaled grads to this value; ``None`` = no clipping.
        skip_nonfinite: skip steps with non-finite bf16/fp32 grads. With any fp16 param every grad is
            loss-scaled, so every grad is checked (an overflow anywhere is the scale's), whatever this says.
        param_dtype: ``torch.bfloat16`` or ``torch.float16`` to cast the optimizer's trainable params to that
            dtype in place (same ``Parameter`` objects), keeping their fp32 values as the masters.
        impl: ``"torch"`` (this exact path), ``"triton"`` (the fused optimizer of ``halfprec.optim`` with the same
            hyper-parameters; ValueError naming the fix when it cannot run) or ``"auto"`` (fused when the inner
            optimizer is torch Adam/AdamW/SGD/Adagrad on CUDA with its ``foreach``/``fused`` left at their
            defaults and Triton importable; see ``halfprec.optim.bridge.select_impl``). A fused result is a
            ``halfprec.optim.Fused*`` optimizer with the same surface, not an instance of this class.
    """

    def __new__(cls, optimizer=None, *args: Any, impl: str = "auto", **kwargs: Any):
        # copy.deepcopy and pickle call __new__(cls) with no arguments, then restore __dict__
        if cls is MixedPrecisionOptimizer and impl != "torch" and optimizer is not None:
            _validate(
                optimizer,
                kwargs.get("loss_scaler"),
                kwargs.get("max_grad_norm"),
                kwargs.get("param_dtype"),
                kwargs.get("skip_nonfinite", True),
            )
            from .optim.bridge import fused_from_torch, select_impl

            if select_impl(optimizer, impl) == "triton":
                return fused_from_torch(optimizer, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
        impl: str = "auto",
    ) -> None:
        _validate(optimizer, loss_scaler, max_grad_norm, param_dtype, skip_nonfinite)
        self._init_wrapper(optimizer)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.param_dtype = param_dtype

        self._store = MasterStore()
        self._own: list[torch.nn.Parameter] = []  # trainable params that are their own masters (fp32/fp64)
        self._model_params: list[torch.nn.Parameter] = []  # what the caller's model holds, group order
        self._trained: list[torch.nn.Parameter] = []  # those trainable when wrapped: a master or their own
        self._frozen: list[torch.nn.Parameter] = []  # those frozen when wrapped: no master, never trained
        mapping = self._build_masters(optimizer.param_groups)
        migrate_state(optimizer, mapping)
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(p, p) for p in group["params"]]

        devices = {p.device for p in self._trained}
        if len(devices) > 1:
            raise ValueError(
                f"trainable params span several devices {sorted(map(str, devices))}; halfprec keeps one loss "
                "scale per optimizer: build one MixedPrecisionOptimizer per device"
            )
        has_fp16 = any(p.dtype == torch.float16 for p in self._trained)
        if loss_scaler is None:
            loss_scaler = DynamicLossScaler() if has_fp16 else StaticLossScaler(1.0)
        self._has_fp16 = has_fp16
        self.loss_scaler = loss_scaler.to(devices.pop() if devices else torch.device("cpu"))

        self._s = _StepState()

    # --- construction --------------------------------------------------------------------------------
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
                if self.param_dtype is not None and p.dtype == torch.float32:
                    originals[p] = p.data
                    p.data = p.data.to(self.param_dtype)
                if p.dtype in LOW_PRECISION:
                    low.append(p)
                else:
                    self._own.append(p)
        return self._store.add(low, originals)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if torch.is_tensor(params) else list(params)
        _check_params(params, known=set(self._model_params))
        if group.get("differentiable", False):
            raise ValueError(
                "add_param_group got differentiable=True; halfprec's step runs under no_grad: leave it False"
            )
        if self._scaling_is_off() and not self._has_fp16:
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
        mapping = self._build_masters([{"params": params}])
        group["params"] = [mapping.get(p, p) for p in params]
        self.optimizer.add_param_group(group)
        self._has_fp16 = self._has_fp16 or any(p.dtype == torch.float16 for p in self._trained)

    # --- read-only results ----------------------------------------------------------------------------
    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step()`` skipped the update (non-finite grads)."""
        return self._s.step_was_skipped

    @property
    def skipped_steps(self) -> int:
        return self._s.skipped_steps

    @property
    def grad_norm(self) -> float | None:
        """Global L2 norm of the unscaled grads of the last step, before clipping (None: neither checked nor
        clipped). Read in the step's one host sync, so reading it costs nothing."""
        return self._s.grad_norm_value

    @property
    def step_loss_scale(self) -> float | None:
        """The loss scale the last step's gradients were scaled with (before the scaler's update)."""
        return self._s.step_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer updates (masters, and fp32 params that are their own)."""
        own = set(self._own)
        masters = set(self._store.master_params())
        return [p for g in self.param_groups for p in g["params"] if p in masters or p in own]

    def refresh_masters(self) -> None:
        """Copy the model's current weights into the masters (after an external weights-only load)."""
        self._store.refresh_from_params()

    # --- the step --------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the current loss scale (the same tensor when no scaling is configured)."""
        if self._scaling_is_off():
            return loss
        return loss * self.loss_scaler.scale.to(loss.device)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale ``loss`` and run autograd backward; ``kwargs`` go to ``Tensor.backward``."""
        if self._s.unscaled:
            raise RuntimeError(
                "backward() called after unscale_() and before step(): the new grads would be mixed with "
                "unscaled ones. Call unscale_() after the last backward() of the step."
            )
        self.scale_loss(loss).backward(**kwargs)

    def _scaling_is_off(self) -> bool:
        return self.loss_scaler.is_unit

    @torch.no_grad()
    def unscale_(self) -> None:
        """Fill the fp32 master grads from the model grads and divide by the loss scale. Idempotent."""
        if self._s.unscaled:
            return
        check_unfrozen(self._frozen)
        self._store.check_devices()
        stepped = self._s.stepped_grads
        if stepped is not None and stepped.marks and stepped.same(self._trained):
            raise RuntimeError(
                "step() called again without a new backward(): these grads were already applied (and fp32 grads "
                "unscaled in place); call zero_grad() and backward() before the next step()"
            )
        filled = self._store.copy_grads_in()
        own = [p.grad for p in self._own if p.grad is not None]
        if filled + own and not self._scaling_is_off():
            torch._foreach_mul_(filled + own, self.loss_scaler.inv_scale())
        # param-group order, as clip_grad_norm_(mp.master_params()) sums them: the norm's bits depend on it
        self._s.grads = [m.grad for m in self.master_params() if m.grad is not None]
        self._s.unscaled_grads = _GradMarks(self._store.model_params())
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
        check = self._has_fp16 or self.skip_nonfinite
        norm = None
        if grads and (check or self.max_grad_norm is not None):
            norm = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
        device = self.loss_scaler.device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if check and norm is not None:
            found_inf = (~torch.isfinite(norm)).to(device=device, dtype=torch.float32)
        values = self.loss_scaler.step_update(found_inf)
        if norm is not None:
            values = torch.cat([values, norm.to(device=device, dtype=torch.float32).reshape(1)])
        skipped, was_at_min, before, after, *norm_value = values.tolist()  # the one host sync of the step
        self._s.grad_norm_value = norm_value[0] if norm_value else None
        self._s.step_scale = before
        self._s.step_was_skipped = bool(skipped)
        self._s.stepped_grads = _GradMarks(self._trained)
        if skipped:
            self._s.skipped_steps += 1
            self._report_skip(before, after, bool(was_at_min))
            return
        if self.max_grad_norm is not None:
            params = [m for m in self.master_params() if m.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm, None)
        self.optimizer.step()
        self._store.copy_params_out()
        self._s.stepped_grads = _GradMarks(self._trained)  # fp32 own grads changed in place

    def _report_skip(self, scale_before: float, after: float, was_at_min: bool) -> None:
        logger.warning(
            "halfprec: step skipped, non-finite gradients or gradient norm (loss scale %g -> %g, %d skipped so far)",
            scale_before,
            after,
            self._s.skipped_steps,
        )
        if was_at_min and self.loss_scaler.is_dynamic and not self._s.warned_min_scale:
            self._s.warned_min_scale = True
            warnings.warn(min_scale_message(scale_before), RuntimeWarning, stacklevel=3)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of every param of the groups, frozen ones included (as torch does)."""
        clear_grads(self._model_params, set_to_none)
        self._store.clear_grads()
        self._s.unscaled = False
        self._s.stepped_grads = None

    # --- checkpoint state ------------------------------------------------------------------------------
    def _index_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        self._run_hooks("_optimizer_state_dict_pre_hooks")
        masters = set(self._store.master_params())
        params = self._index_params()
        model = self._model_params
        out = {
            "format": _FORMAT,
            "optimizer": self.optimizer.state_dict(),
            "masters": {i: p.detach() for i, p in enumerate(params) if p in masters},
            "params": [
                {"shape": list(p.shape), "dtype": _dtype_name(m.dtype), "master": p in masters}
                for i, (p, m) in enumerate(zip(params, model, strict=True))
            ],
            "scaler": self.loss_scaler.state_dict(),
            "skipped_steps": self._s.skipped_steps,
        }
        return self._run_hooks("_optimizer_state_dict_post_hooks", out)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = self._run_hooks("_optimizer_load_state_dict_pre_hooks", state_dict)
        self.check_state_dict(state_dict)
        inner = state_dict["optimizer"]
        self.optimizer.load_state_dict(inner)
        params = self._index_params()
        restore_state_dtypes(self.optimizer, inner["state"], params)
        with torch.no_grad():
            for index, value in state_dict["masters"].items():
                params[int(index)].copy_(value)
        self._store.copy_params_out()
        self.loss_scaler.load_state_dict(state_dict["scaler"])
        self._s.skipped_steps = int(state_dict["skipped_steps"])
        self._s.unscaled = False
        self._run_hooks("_optimizer_load_state_dict_post_hooks")

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ValueError unless ``state_dict`` is this optimizer's kind and of this model (changes nothing)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a MixedPrecisionOptimizer state dict (format {found!r}); a plain torch optimizer state "
                "dict goes to mp.optimizer.load_state_dict(...), followed by mp.refresh_masters()"
            )
        self._check_compatible(state_dict["params"])
        check_saved_groups(state_dict, self.param_groups, self.loss_scaler)

    def _check_compatible(self, saved: list[dict[str, Any]]) -> None:
        params, model = self._index_params(), self._model_params
        masters = set(self._store.master_params())
        mine = [
            {"shape": list(p.shape), "dtype": _dtype_name(m.dtype), "master": p in masters}
            for p, m in zip(params, model, strict=True)
        ]
        for i, (entry, here) in enumerate(zip(saved, mine, strict=False)):
            if entry != here:
                raise ValueError(
                    f"state dict does not match this model at param {i}: saved shape {entry['shape']} dtype "
                    f"{entry['dtype']} {_role(entry)}, this model shape {here['shape']} dtype {here['dtype']} "
                    f"{_role(here)}"
                )
        if len(saved) != len(mine):
            i = min(len(saved), len(mine))
            extra = saved[i] if len(saved) > len(mine) else mine[i]
            where = "the state dict" if len(saved) > len(mine) else "this model"
            raise ValueError(
                f"state dict holds {len(saved)} params, this optimizer {len(mine)}: param {i} (shape "
                f"{extra['shape']} dtype {extra['dtype']}) is only in {where}"
            )

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r})"


@dataclass
class _StepState:
    """Everything a step changes, in one object: wrappers that copy the optimizer's ``__dict__`` (Lightning's
    and Fabric's) share it, so a call made through such a wrapper updates the real optimizer."""

    unscaled: bool = False
    grads: list[torch.Tensor] = field(default_factory=list)
    unscaled_grads: _GradMarks | None = None
    stepped_grads: _GradMarks | None = None
    grad_norm_value: float | None = None
    step_scale: float | None = None
    step_was_skipped: bool = False
    skipped_steps: int = 0
    warned_min_scale: bool = False


def _role(entry: dict[str, Any]) -> str:
    return "(trained, fp32 master)" if entry["master"] else "(own master or frozen)"


class _GradMarks:
    """Which grad tensors a step saw, and their in-place versions: what tells a new backward from grads already
    consumed. Weak references: a grad freed by ``zero_grad``/``model.zero_grad()`` is not kept alive, and a new
    grad allocated at the freed one's address is not mistaken for it (``id()`` would be)."""

    def __init__(self, params) -> None:
        self.marks = [(weakref.ref(p.grad), p.grad._version) for p in params if p.grad is not None]

    def same(self, params) -> bool:
        grads = [p.grad for p in params if p.grad is not None]
        return len(grads) == len(self.marks) and all(
            ref() is g and g._version == version for (ref, version), g in zip(self.marks, grads, strict=True)
        )


def _check_params(params: list, known: set) -> None:
    seen: set = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"optimizer params must be tensors, got {type(p).__name__}")
        if not (p.is_floating_point()):
            raise ValueError(
                f"param of shape {tuple(p.shape)} has dtype {p.dtype}; halfprec trains floating-point params "
                "only: remove it from the optimizer or make it a buffer"
            )
        if p in seen or p in known:
            raise ValueError(
                f"param of shape {tuple(p.shape)} appears twice in the optimizer's groups; list each param "
                "in exactly one group"
            )
        seen.add(p)


def _validate(optimizer, loss_scaler, max_grad_norm, param_dtype, skip_nonfinite) -> None:
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise ValueError(
            "optimizer is already a MixedPrecisionOptimizer; wrap the plain torch optimizer once"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}; build one over the model's "
            "params, e.g. torch.optim.AdamW(model.parameters())"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS re-evaluates the closure inside step(), which a master-weight wrapper cannot unscale or "
            "check; use it in fp32 without halfprec"
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"param group {i} has differentiable=True; halfprec's step runs under no_grad: build the "
                "optimizer with differentiable=False"
            )
    _check_params([p for g in optimizer.param_groups for p in g["params"]], known=set())
    check_options(
        loss_scaler=loss_scaler,
        max_grad_norm=max_grad_norm,
        param_dtype=param_dtype,
        skip_nonfinite=skip_nonfinite,
    )
