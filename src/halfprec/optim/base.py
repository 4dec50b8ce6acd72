"""MixedPrecisionOptimizer: the contract every halfprec optimizer keeps, and its default (exact) strategy.

The fused and sharded strategies are subclasses (docs/architecture.md), not a dispatch inside one object as
torch's ``foreach``/``fused`` flags are: they hold different buffers and take different constructor arguments.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from .._checks import is_int
from ..scaler import DynamicLossScaler, LossScaler, StaticLossScaler
from .accumulate import GradAccumulator, all_reduce_master_grads, check_process_group
from .checks import (
    check_dtypes,
    check_grad_accum_dtype,
    check_options,
    check_params,
    check_torch_optimizer,
    check_unfrozen,
    clear_grads,
)
from .layout import LOW_PRECISION, MasterStore
from .results import GradMarks, ScaleGuard, SkipLog, StepState, warn_caller
from .state import Target, move_state, restore_state_dtypes

__all__ = ["FORMAT", "MixedPrecisionOptimizer"]

FORMAT = "halfprec.MixedPrecisionOptimizer/1"

# torch's hook registries (``_optimizer_step_pre_hooks``, ...), which ``Optimizer.__init__`` would create
_HOOK_REGISTRIES = tuple(
    f"_optimizer_{kind}_{when}_hooks"
    for kind in ("step", "state_dict", "load_state_dict")
    for when in ("pre", "post")
)
_OPTIONS = ("loss_scaler", "max_grad_norm", "skip_nonfinite", "param_dtype")


class _Delegated:
    """``param_groups``/``state``/``defaults``: the wrapped torch optimizer's (exact, sharded), so LR schedulers
    write where the inner step reads; or this object's own (fused, ``optimizer`` is None)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return self
        return obj.__dict__["_" + self.name] if obj.optimizer is None else getattr(obj.optimizer, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        if obj.optimizer is None:
            obj.__dict__["_" + self.name] = value
        else:
            setattr(obj.optimizer, self.name, value)


class _SelectImpl(type(torch.optim.Optimizer)):
    """``MixedPrecisionOptimizer(optimizer, impl=...)`` returns the strategy ``select_impl`` picks for it (the
    class itself for the exact path, a fused optimizer for the Triton one); a subclass builds itself."""

    def __call__(cls, *args: Any, **kwargs: Any):
        if cls is MixedPrecisionOptimizer and kwargs.get("impl", "auto") != "torch" and args:
            options = {k: v for k, v in kwargs.items() if k != "impl"}
            _check_wrappable(args[0], {k: v for k, v in options.items() if k in _OPTIONS})
            from .select import fused_from_torch, select_impl

            if select_impl(args[0], kwargs.get("impl", "auto")) == "triton":
                return fused_from_torch(args[0], **options)
        return super().__call__(*args, **kwargs)


class MixedPrecisionOptimizer(torch.optim.Optimizer, metaclass=_SelectImpl):
    """Give ``optimizer`` FP32 master weights for a model held in FP16/BF16.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the model's params (16-bit, or fp32 with ``param_dtype``).
        loss_scaler: a ``StaticLossScaler`` or ``DynamicLossScaler``. ``None`` means ``DynamicLossScaler()``
            when any trainable param is fp16, else no scaling (``StaticLossScaler(1.0)``).
        max_grad_norm: clip the global L2 norm of the unscaled grads to this value; ``None`` = no clipping.
        skip_nonfinite: skip steps with non-finite bf16/fp32 grads. With any fp16 param every grad is
            loss-scaled, so every grad is checked (an overflow anywhere is the scale's), whatever this says.
        param_dtype: ``torch.bfloat16`` or ``torch.float16`` to cast the optimizer's trainable params to that
            dtype in place (same ``Parameter`` objects), keeping their fp32 values as the masters;
            ``torch.float32`` casts nothing and says an all-fp32 model is meant (``None`` warns then).
        impl: ``"torch"`` (this exact path), ``"triton"`` (the ``halfprec.optim.Fused*`` optimizer with the same
            hyper-parameters, a subclass of this one; ValueError naming the fix when it cannot run) or ``"auto"``
            (fused when it can run: the policy of ``halfprec.optim.select``).
        grad_accum_dtype: ``None`` accumulates micro-batch grads in the params' 16-bit ``.grad``; ``torch.float32``
            adds each 16-bit grad, as backward produces it, into its fp32 master grad and releases it
            (``accumulate.py``: one fp32 rounding per micro-batch, no extra memory).
        process_group: ``None``: no data parallelism (or DDP, with ``grad_accum_dtype=None``); a process group
            with ``grad_accum_dtype=torch.float32``: ZeRO-0 instead of DDP (do not wrap the model): ``step()``
            takes the mean of the ranks' fp32 sums (``accumulate.py``).
    """

    optimizer: torch.optim.Optimizer | None = None  # wrapped (exact, sharded); None: fused owns its groups
    impl = "torch"  # the strategy: "torch" (exact, inner torch step) or "triton" (fused kernels)
    grad_accum_dtype: torch.dtype | None = None  # None: 16-bit .grad; torch.float32: the master grads
    _accumulator: GradAccumulator | None = None  # the fp32 accumulation's hooks (exact strategy)
    process_group: Any = None  # ZeRO-0: all-reduce the fp32 grad sums over it at the step; None: no reduction
    _FORMAT = FORMAT

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
        impl: str = "auto",
        grad_accum_dtype: torch.dtype | None = None,
        process_group: Any = None,
    ) -> None:
        _check_wrappable(optimizer, dict(loss_scaler=loss_scaler, max_grad_norm=max_grad_norm, param_dtype=param_dtype,
                                         skip_nonfinite=skip_nonfinite))  # fmt: skip
        check_grad_accum_dtype(grad_accum_dtype, process_group=process_group)
        check_process_group(process_group, grad_accum_dtype)
        self.process_group = process_group
        self._init_wrapping(optimizer)
        self._init_options(
            max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite, param_dtype=param_dtype
        )
        self._store = MasterStore()
        self._own: list[torch.nn.Parameter] = []  # trainable params that are their own masters (fp32/fp64)
        self._model_params: list[torch.nn.Parameter] = []  # what the caller's model holds, group order
        self._trained: list[torch.nn.Parameter] = []  # those trainable when wrapped: a master or their own
        self._trained_dtypes: list[torch.dtype] = []  # their dtypes when wrapped (after the param_dtype cast)
        self._frozen: list[torch.nn.Parameter] = []  # those frozen when wrapped: no master, never trained
        mapping = self._build_masters(optimizer.param_groups)
        move_state(optimizer, {p: Target(m, 0, p.numel()) for p, m in mapping.items()})
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
        if grad_accum_dtype is not None:
            self.grad_accum_dtype = grad_accum_dtype
            self._accumulator = GradAccumulator(self._store, self._s)

    # --- the contract: construction pieces every strategy uses -------------------------------------------
    def _init_wrapping(self, optimizer: torch.optim.Optimizer) -> None:
        """``Optimizer.__init__`` would make new groups: its hook registries and ``step`` patch are made here."""
        self.optimizer = optimizer
        for name in _HOOK_REGISTRIES:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    def _init_options(
        self, *, max_grad_norm: float | None, skip_nonfinite: bool, param_dtype: torch.dtype | None
    ) -> None:
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.skip_nonfinite = bool(skip_nonfinite)
        self.param_dtype = param_dtype
        self._s = StepState()
        self._skip_log = SkipLog()
        self._scale_guard = ScaleGuard()

    def _init_scaler(self, loss_scaler: LossScaler | None, *, dtypes: set, device: torch.device) -> None:
        """The default scaler: dynamic when any trained param (of ``dtypes``) is fp16, else none."""
        self._has_fp16 = torch.float16 in dtypes
        if dtypes and not dtypes & set(LOW_PRECISION) and self.param_dtype is None:
            warn_caller(
                f"halfprec: every trained param is {'/'.join(sorted(map(str, dtypes)))} and param_dtype is None, so "
                "this trains in full precision. Pass param_dtype=torch.bfloat16 (or torch.float16) to train the "
                "model in 16 bits with fp32 masters, or param_dtype=torch.float32 to say fp32 is meant.",
                UserWarning,
            )
        if loss_scaler is None:
            loss_scaler = DynamicLossScaler() if self._has_fp16 else StaticLossScaler(1.0)
        self.loss_scaler = loss_scaler.to(device)

    def _cast_to_param_dtype(self, p: torch.nn.Parameter, originals: dict) -> None:
        """``param_dtype``: cast an fp32 param in place (same ``Parameter``), keeping its fp32 value as the master."""
        if self.param_dtype in LOW_PRECISION and p.dtype == torch.float64:
            raise ValueError(
                f"param of shape {tuple(p.shape)} is torch.float64 and param_dtype={self.param_dtype}: halfprec's "
                "masters are fp32, so an fp64 model would lose precision silently; cast the model to fp32 first "
                "(model.float())"
            )
        if self.param_dtype in LOW_PRECISION and p.dtype == torch.float32:
            originals[p] = p.data
            p.data = p.data.to(self.param_dtype)

    @property
    def _checks_grads(self) -> bool:
        """Whether a step checks its grads for non-finite values: always with fp16 (all grads are loss-scaled)."""
        return self._has_fp16 or self.skip_nonfinite

    # --- the contract: where groups, state and defaults live ----------------------------------------------
    param_groups = _Delegated("param_groups")
    state = _Delegated("state")
    defaults = _Delegated("defaults")

    def model_params(self) -> list[torch.nn.Parameter]:
        """The model's params in param-group order, frozen ones included (what state dicts index)."""
        return list(self._model_params)

    def _backward_params(self) -> list[torch.nn.Parameter]:
        """The params whose ``.grad`` a backward fills (the scale guard's view)."""
        return self._model_params + self._accumulated()

    def _grad_holders(self) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` a step consumes (``GradMarks`` of a step)."""
        return self._trained + self._accumulated()

    def _accumulated(self) -> list[torch.nn.Parameter]:
        """The masters when fp32 accumulation's hooks move the 16-bit grads into theirs, else none."""
        return [] if self._accumulator is None else self._store.master_params()

    # --- the contract: read-only results ----------------------------------------------------------------
    @property
    def step_was_skipped(self) -> bool:
        """True when the last ``step()`` skipped the update (non-finite grads)."""
        return self._s.step_was_skipped

    @property
    def skipped_steps(self) -> int:
        return self._s.skipped_steps

    @property
    def grad_norm(self) -> float | None:
        """Global L2 norm of the last step's unscaled grads, before clipping (None: neither checked nor clipped)."""
        return self._s.grad_norm

    @property
    def step_loss_scale(self) -> float | None:
        """The loss scale the last step's gradients were scaled with (before the scaler's update)."""
        return self._s.step_loss_scale

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def step_results(self):
        """The last step's ``step_was_skipped``, ``grad_norm`` and ``step_loss_scale``, kept for reading later:
        taking them does not wait for the step (on the fused strategy they stay on the device until read)."""
        return self._s.snapshot()

    def _record_step(
        self, values: list[float], norm: float | None, *, where: str = "", log: bool = True
    ) -> None:
        """Keep a step's results; ``values`` is ``LossScaler.step_update``'s (skipped, at min, before, after)."""
        skipped, at_min, before, after = values[:4]
        self._s.grad_norm = norm
        self._s.step_loss_scale = before
        self._s.step_was_skipped = bool(skipped)
        if skipped:
            self._s.skipped_steps += 1
            if log:
                self._skip_log.report(
                    before=before,
                    after=after,
                    skipped_so_far=self._s.skipped_steps,
                    at_min_scale=bool(at_min) and self.loss_scaler.is_dynamic,
                    where=where,
                )

    # --- the contract: loss scaling and the step ---------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` multiplied by the current loss scale (the same tensor when no scaling is configured)."""
        self._scale_guard.mark()
        if self.loss_scaler.is_unit:
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

    def step(self, closure=None):
        """Run ``closure`` (with grad enabled) if given, then the strategy's ``_step()``; return the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._scale_guard.check(self._backward_params, self.loss_scaler)
        self._step()
        return loss

    def _run_hooks(self, registry: str, state_dict: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Run one of torch's state-dict hook registries; hooks given a state dict may return a new one."""
        for hook in getattr(self, registry).values():
            if state_dict is None:
                hook(self)
            else:
                state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- the contract: the state-dict envelope ------------------------------------------------------------
    def _param_entries(self) -> list[dict[str, Any]]:
        """Per model param, in group order: shape, model dtype and whether it has an fp32 master."""
        masters = set(self._store.master_params())
        params = self._index_params()
        return [
            {"shape": list(p.shape), "dtype": str(m.dtype), "master": p in masters}
            for p, m in zip(params, self._model_params, strict=True)
        ]

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ValueError unless ``state_dict`` is this optimizer's kind and of this model (changes nothing)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != self._FORMAT:
            found = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a MixedPrecisionOptimizer state dict (format {found!r}); if it is not a halfprec optimizer "
                "state dict but a plain torch one, it goes to mp.optimizer.load_state_dict(...) of a "
                "MixedPrecisionOptimizer(..., impl='torch'), followed by mp.refresh_masters()"
            )
        self._check_compatible(state_dict["params"])
        saved_groups = [len(g["params"]) for g in state_dict["optimizer"]["param_groups"]]
        groups = [len(g["params"]) for g in self.param_groups]
        if saved_groups != groups:
            raise ValueError(
                f"state dict has param groups of sizes {saved_groups}, this optimizer {groups}: build the "
                "optimizer with the same param groups as the one that was saved"
            )
        self.loss_scaler.check_state_dict(state_dict.get("scaler"))
        self.check_algorithm(state_dict.get("algorithm"), state_dict["optimizer"]["param_groups"])
        self._check_state_values(state_dict)

    def _check_compatible(self, saved: list[dict[str, Any]]) -> None:
        mine = self._param_entries()
        for i, (entry, here) in enumerate(zip(saved, mine, strict=False)):
            if entry != here:
                raise ValueError(
                    f"state dict does not match this model at param {i}: saved {_describe(entry)}, "
                    f"this model {_describe(here)}"
                )
        if len(saved) != len(mine):
            i = min(len(saved), len(mine))
            extra = saved[i] if len(saved) > len(mine) else mine[i]
            where = "the state dict" if len(saved) > len(mine) else "this model"
            raise ValueError(
                f"state dict holds {len(saved)} params, this optimizer {len(mine)}: param {i} (shape "
                f"{extra['shape']} dtype {extra['dtype']}) is only in {where}"
            )

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
        mapping = self._build_masters([{"params": params}])
        if self._accumulator is not None:
            self._accumulator.hook_new_chunks()
        group["params"] = [mapping.get(p, p) for p in params]
        self.optimizer.add_param_group(group)
        self._has_fp16 = self._has_fp16 or any(p.dtype == torch.float16 for p in self._trained)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 tensors the inner optimizer updates (masters, and fp32 params that are their own)."""
        updated = set(self._own) | set(self._store.master_params())
        return [p for g in self.param_groups for p in g["params"] if p in updated]

    def refresh_masters(self) -> None:
        """Copy the model's current weights into the masters (after an external weights-only load)."""
        self._store.refresh_from_params()

    # --- the exact strategy's step ---------------------------------------------------------------------
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
        own = [p.grad for p in self._own if p.grad is not None]
        if filled + own and not self.loss_scaler.is_unit:
            torch._foreach_mul_(filled + own, self.loss_scaler.inv_scale())
        # param-group order, as clip_grad_norm_(mp.master_params()) sums them: the norm's bits depend on it
        self._s.grads = [m.grad for m in self.master_params() if m.grad is not None]
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
        if grads and (check or self.max_grad_norm is not None):
            norm = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
        device = self.loss_scaler.device
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if check and norm is not None:
            found_inf = (~torch.isfinite(norm)).to(device=device, dtype=torch.float32)
        values = self.loss_scaler.step_update(found_inf)
        if norm is not None:
            values = torch.cat([values, norm.to(device=device, dtype=torch.float32).reshape(1)])
        values = values.tolist()  # the one host sync of the step
        self._record_step(values, values[4] if norm is not None else None)
        if not self._s.step_was_skipped:
            if self.max_grad_norm is not None:
                params = [m for m in self.master_params() if m.grad is not None]
                torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm, None)
            self.optimizer.step()
            self._store.copy_params_out()
        self._s.stepped_grads = GradMarks(self._grad_holders())  # after clipping, which bumps grad versions

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
        out = {
            "format": self._FORMAT,
            "algorithm": self.algorithm(),
            "optimizer": self.optimizer.state_dict(),
            "masters": {i: p.detach() for i, p in enumerate(params) if p in masters},
            "params": self._param_entries(),
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

    def __repr__(self) -> str:
        return f"MixedPrecisionOptimizer({self.optimizer!r}, loss_scaler={self.loss_scaler!r})"

    # --- checkpoint checks: which optimizer a state belongs to -------------------------------------------
    def algorithm(self) -> str:
        """The torch optimizer whose update this one runs (``"AdamW"``, ``"SGD"``; ``FusedAdamW`` runs
        ``"AdamW"``): what checkpoints record, so that a load refuses another optimizer's state."""
        return type(self if self.optimizer is None else self.optimizer).__name__.removeprefix("Fused")

    def check_algorithm(
        self, saved: str | None, groups: list[dict[str, Any]], where: str = "state dict"
    ) -> None:
        """Raise ValueError when a checkpoint's state is another optimizer's: ``saved`` is the algorithm it
        recorded (None in checkpoints that predate the record: then its param groups must hold every
        hyper-parameter of this optimizer's ``defaults``, which another algorithm's groups do not)."""
        mine = self.algorithm()
        if saved is None:
            # flags torch added over its versions (its __setstate__ fills them in): not an algorithm's own
            keys = set(self.defaults) - {"foreach", "fused", "capturable", "differentiable", "maximize",
                                         "decoupled_weight_decay"}  # fmt: skip
            missing = sorted({k for g in groups for k in keys if k not in g})
            if not missing:
                return
            saved = f"an optimizer without {missing}"
        if saved != mine:
            raise ValueError(
                f"the {where} was saved by {saved}, this optimizer is {mine}: another optimizer's state cannot be "
                "loaded (its moments would be misread); build the optimizer it was saved with, or load only the "
                "weights"
            )

    def _check_state_values(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError unless the values a load writes fit (a floating master of its param's shape for each
        param that has one, the counters, the scaler state on a copy): a failed load changes nothing."""
        entries = self._param_entries()
        want = [i for i, entry in enumerate(entries) if entry["master"]]
        masters = state_dict.get("masters")
        found = sorted(int(k) for k in masters) if isinstance(masters, dict) else type(masters).__name__
        if found != want:
            raise ValueError(
                f"state dict holds masters of params {found}, this optimizer has masters of {want}"
            )
        for k, value in masters.items():
            expected = entries[int(k)]["shape"]
            if not (torch.is_tensor(value) and value.is_floating_point() and list(value.shape) == expected):
                shape = list(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(
                    f"state dict's master of param {k} is {shape}, expected a floating tensor of shape {expected}"
                )
        skipped_steps = state_dict.get("skipped_steps")
        if not is_int(skipped_steps) or skipped_steps < 0:
            raise ValueError(f"state dict's skipped_steps must be a non-negative int, got {skipped_steps!r}")
        try:
            copy.deepcopy(self.loss_scaler).load_state_dict(state_dict["scaler"])
        except ValueError as e:
            raise ValueError(f"state dict's loss-scaler state: {e}") from e


def _describe(entry: dict[str, Any]) -> str:
    role = " (trained, fp32 master)" if entry["master"] else ""
    return f"shape {entry['shape']} dtype {entry['dtype']}{role}"


def _check_wrappable(optimizer: Any, options: dict[str, Any]) -> None:
    """What every strategy that wraps a torch optimizer refuses: a halfprec optimizer (wrapping one again would
    scale its grads twice and hand its step fp32 masters of masters), a non-optimizer, LBFGS, bad options."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise ValueError(
            f"optimizer is already a MixedPrecisionOptimizer ({type(optimizer).__name__}); use it as it is, or "
            "wrap the plain torch optimizer once"
        )
    check_torch_optimizer(optimizer)
    check_options(**options)
