"""halfprec as a Lightning precision plugin: ``Trainer(plugins=[HalfprecPrecision(torch.bfloat16)])`` and Fabric.

The plugin takes ``param_dtype=`` with a torch dtype, as the optimizers and ``HalfprecTrainer`` do; a precision
string (``"bf16"``, Lightning's ``"bf16-true"``/``"16-mixed"``) is refused, naming the dtype to pass.

The model is built in fp32. ``convert_module`` casts it to the 16-bit dtype (params in place, as Lightning's
``"bf16-true"`` does; buffers outside the state dict keep their dtype, ``prepare.derived_buffers``) and keeps each
param's fp32 tensor; ``connect`` (Trainer) or :func:`setup_fabric`
(Fabric, which has no ``connect``) swaps the fp32 tensors back in just long enough for
``MixedPrecisionOptimizer(optimizer, param_dtype=...)`` to wrap the plain optimizer, so the masters start from
the fp32 weights, not from their 16-bit roundings.

Under ``HalfprecModelParallelStrategy`` (FSDP2, ``lightning_strategy.py``) ``convert_module`` recasts the shards
with ``prepare.cast_module`` and keeps this rank's fp32 rows of each, which the masters start from.

Lightning calls ``lr_scheduler_step`` on every step and gives the plugin no hook there, so ``connect``
replaces each ``interval="step"`` scheduler with a proxy that does not step after a skipped optimizer step.
``gradient_clip_val`` (norm) becomes the ``MixedPrecisionOptimizer``'s ``max_grad_norm`` for that one step: it
clips inside ``step()`` after the overflow check, on the fused path in the kernel's own norm pass.

``impl="auto"`` wraps in the fused optimizer on CUDA (``optim/select.py``). Its grads are never unscaled in
place, so what needs them there is refused with the fix: clipping by value, and ``fabric.clip_gradients``,
which clips ``main_params`` with torch itself. Usage and caveats: docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Generator
from typing import Any

import torch

from ..optim.base import MixedPrecisionOptimizer
from ..optim.checks import set_data
from ..precision import check_low_precision, spelled_dtype
from ..prepare import cast_module, fp32_rows, start_masters_from
from ..scaler import LossScaler
from . import check_strategy, require, resolve_grad_accum_dtype
from .fsdp import trains_shards
from .lightning_strategy import HalfprecModelParallelStrategy, check_fabric_strategy, check_trainer_strategy

_FabricPrecision = require("lightning.fabric.plugins", "lightning").Precision
_TrainerPrecision = require("lightning.pytorch.plugins.precision", "lightning").Precision
_LightningModule = require("lightning.pytorch", "lightning").LightningModule
apply_to_collection = require("lightning_utilities", "lightning").apply_to_collection

__all__ = [
    "HalfprecFabricPrecision",
    "HalfprecModelParallelStrategy",
    "HalfprecPrecision",
    "check_trainer_strategy",
    "setup_fabric",
]

# self.precision: Lightning's own name for 16-bit weights
_LIGHTNING_NAME = {torch.bfloat16: "bf16-true", torch.float16: "16-true"}

# Lightning's autocast over fp32 weights: its own precision=, no plugin
_AUTOCAST = ("bf16-mixed", "16-mixed")


def _check_param_dtype(value: object, owner: str) -> torch.dtype:
    """``value`` when it is a 16-bit dtype halfprec keeps masters for; else a ValueError naming it and the fix
    (``precision.check_low_precision``), which for Lightning's autocast and fp32 is no plugin at all."""
    name = f"{owner} param_dtype"
    if value in _AUTOCAST:
        raise ValueError(
            f"{name} must be torch.float16 or torch.bfloat16, got {value!r}; Lightning's own {value!r} is autocast "
            f"over fp32 weights: pass precision={value!r} to the Trainer instead of this plugin, or "
            f"param_dtype={spelled_dtype(value)} for 16-bit weights"
        )
    if value is torch.float32 or spelled_dtype(value) is torch.float32:
        raise ValueError(
            f"{name} must be torch.float16 or torch.bfloat16, got {value!r}; fp32 weights need no plugin, leave "
            "it out (Lightning's precision='32-true')"
        )
    return check_low_precision(value, name, allow_none=False)  # type: ignore[return-value]


def _unwrap(optimizer: Any) -> Any:
    """The object under Lightning's/Fabric's optimizer wrappers (they keep it in ``_optimizer``)."""
    while hasattr(optimizer, "_optimizer"):
        optimizer = optimizer._optimizer
    return optimizer


class _Common:
    """Dtype handling, wrapping and clipping shared by the Trainer and the Fabric flavours."""

    def __init__(
        self,
        param_dtype: torch.dtype,
        *,
        loss_scaler: LossScaler | None = None,
        skip_nonfinite: bool = True,
        impl: str = "auto",
        grad_accum_dtype: str = "auto",
    ) -> None:
        dtype = _check_param_dtype(param_dtype, type(self).__name__)  # the 16-bit ones: fp32 needs no plugin
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise ValueError(f"loss_scaler must be a halfprec loss scaler, got {type(loss_scaler).__name__}")
        check_strategy(impl, grad_accum_dtype)
        self.impl = impl
        self.grad_accum_dtype = grad_accum_dtype
        self.precision = _LIGHTNING_NAME[dtype]
        self.dtype = dtype
        self.loss_scaler = loss_scaler
        self.skip_nonfinite = skip_nonfinite
        self._fp32: dict[torch.Tensor, torch.Tensor] = {}  # param -> its fp32 tensor, until connect/setup
        self._rows: dict[torch.Tensor, torch.Tensor] = {}  # FSDP2 shard -> its fp32 rows, likewise
        self._optimizers: list[MixedPrecisionOptimizer] = []
        self._base_clip: dict[int, float | None] = {}  # Trainer: max_grad_norm outside a clipped step

    # --- dtypes -----------------------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # FSDP2's shards (fully_shard in configure_model, which runs before this) are recast by module.to(), whose
        # fully_shard-ed modules lay their shards out anew; a new .data would leave FSDP2's own buffers behind
        self._rows.update(fp32_rows(module))
        with torch.no_grad():
            for p in module.parameters():
                if p.dtype == torch.float32 and p not in self._rows:
                    self._fp32[p] = p.data
                    set_data(p, p.data.to(self.dtype))
        return cast_module(module, self.dtype)  # the state's floating buffers, and the shards

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_to_dtype, dtype=torch.Tensor, dst_type=self.dtype)

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # As Lightning's "bf16-true": tensors created inside forward default to the 16-bit dtype.
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(default)

    # --- wrapping ---------------------------------------------------------------------------------------
    def wrap_optimizer(
        self, optimizer: torch.optim.Optimizer, max_grad_norm: float | None = None, micro_batches: int = 1
    ) -> MixedPrecisionOptimizer:
        """``optimizer`` as a ``MixedPrecisionOptimizer`` over the params this plugin cast (their fp32 values
        become the masters), accumulating ``micro_batches`` as ``grad_accum_dtype`` says; an already-built
        halfprec optimizer is used as it is."""
        optimizer = _unwrap(optimizer)
        if isinstance(optimizer, MixedPrecisionOptimizer):
            mp = optimizer  # already owns masters and a loss scale (MixedPrecisionOptimizer, FusedAdamW, ...)
            if any(p in self._fp32 or p in self._rows for p in mp.model_params()):
                warnings.warn(
                    f"the {type(mp).__name__} was built over params that the halfprec plugin had already cast to "
                    f"{self.dtype}, so its fp32 masters start from their 16-bit roundings, not from the fp32 "
                    "weights; return the plain torch optimizer from configure_optimizers and let the plugin wrap it",
                    RuntimeWarning,
                    stacklevel=3,
                )
        else:
            with torch.no_grad():
                for p in (p for group in optimizer.param_groups for p in group["params"] if p in self._fp32):
                    # back to fp32 so that param_dtype keeps it as the master; on the param's device now (the
                    # Trainer moves the module after convert_module, the fp32 copy stayed)
                    set_data(p, self._fp32[p].to(p.device))
            # FSDP2 reduce-scatters every micro-batch under the Trainer (it has no no_sync for fully_shard)
            shards = trains_shards(p for group in optimizer.param_groups for p in group["params"])
            accum = resolve_grad_accum_dtype(
                self.grad_accum_dtype,
                optimizer,
                self.dtype,
                micro_batches,
                fp32_sums=True if shards else None,
            )
            mp = MixedPrecisionOptimizer(
                optimizer,
                loss_scaler=copy.deepcopy(self.loss_scaler),  # one per optimizer
                max_grad_norm=max_grad_norm,
                skip_nonfinite=self.skip_nonfinite,
                param_dtype=self.dtype,
                impl=self.impl,
                grad_accum_dtype=accum,
            )
            start_masters_from(mp, self._rows)  # FSDP2 shards: from this rank's fp32 rows
        if mp not in self._optimizers:
            self._optimizers.append(mp)
        return mp

    def release_fp32(self) -> None:
        """Drop the fp32 copies kept for wrapping: params outside every optimizer stay 16-bit."""
        self._fp32.clear()
        self._rows.clear()

    def _mp(self, optimizer: Any = None) -> MixedPrecisionOptimizer:
        if optimizer is not None:
            mp = _unwrap(optimizer)
            if not isinstance(mp, MixedPrecisionOptimizer):
                raise RuntimeError(
                    f"the halfprec plugin got a {type(mp).__name__}; it steps halfprec MixedPrecisionOptimizers "
                    "only (in Fabric, set up the optimizers with halfprec.integrations.lightning.setup_fabric)"
                )
            return mp
        if len(self._optimizers) == 1:
            return self._optimizers[0]
        if not self._optimizers:
            raise RuntimeError(
                "no halfprec optimizer is set up yet: with Fabric call halfprec.integrations.lightning."
                "setup_fabric(fabric, model, optimizer) instead of fabric.setup(model, optimizer)"
            )
        raise RuntimeError(
            f"{len(self._optimizers)} halfprec optimizers share this plugin and backward() was not told which "
            "one's loss scale to use; use one optimizer, or bf16 (no loss scale)"
        )

    def _scaled(self, tensor: torch.Tensor, optimizer: Any = None) -> torch.Tensor:
        if self.dtype == torch.bfloat16 and optimizer is None and len(self._optimizers) != 1:
            return tensor  # bf16 without a configured scaler: nothing to scale
        return self._mp(optimizer).scale_loss(tensor)

    # --- gradients ----------------------------------------------------------------------------------------
    def main_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return self._mp(optimizer).master_params()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        mp = self._mp(optimizer)
        if not mp.unscales_in_place:
            raise RuntimeError(
                f"the {type(mp).__name__} (the fused path) never unscales its grads in place, so Lightning cannot "
                "clip or read them through main_params (fabric.clip_gradients does): clip with "
                "setup_fabric(..., max_grad_norm=x), or opt.max_grad_norm = x before opt.step() (in the kernel; "
                "opt.grad_norm is the pre-clip norm after the step); read them with opt.unscaled_grads(); or build "
                "the plugin with impl='torch' (the exact path)"
            )
        mp.unscale_()


def _to_dtype(tensor: torch.Tensor, dst_type: torch.dtype) -> torch.Tensor:
    return tensor.to(dst_type) if torch.is_floating_point(tensor) else tensor


def _trainer(model: Any) -> Any:
    """The Trainer ``connect`` runs under: ``model`` is the LightningModule, or (DDP) the module around it."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return module.trainer if isinstance(module, _LightningModule) else None


class _HoldOnSkipScheduler(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler that forwards to ``scheduler`` but does not step after a skipped optimizer step.

    ``LRScheduler.__init__`` is not called: every attribute and all state live in the wrapped scheduler, so
    its ``state_dict`` is what the checkpoint stores and loads.
    """

    def __init__(self, scheduler: Any, optimizer: MixedPrecisionOptimizer) -> None:
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_mp"] = optimizer

    def __getattr__(self, name: str) -> Any:
        if "_scheduler" not in self.__dict__:  # copy/pickle look attributes up before __init__ ran
            raise AttributeError(name)
        return getattr(self.__dict__["_scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._mp.step_was_skipped:
            self._scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self._scheduler.get_last_lr()

    def get_lr(self) -> list[float]:
        return self._scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self._scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scheduler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"HoldOnSkip({self._scheduler!r})"


def _check_value_clipping(mp: MixedPrecisionOptimizer) -> None:
    if not mp.unscales_in_place:
        raise ValueError(
            f"gradient_clip_algorithm='value' clamps unscaled grads in place, which the {type(mp).__name__} (the "
            "fused path) never materialises: clip by norm (gradient_clip_algorithm='norm', done in the kernel), "
            "or build HalfprecPrecision(..., impl='torch') for the exact path"
        )


class HalfprecPrecision(_Common, _TrainerPrecision):
    """``lightning.pytorch.Trainer(plugins=[HalfprecPrecision(torch.bfloat16 | torch.float16)])``: 16-bit weights,
    fp32 masters.

    Args:
        param_dtype: ``torch.bfloat16`` or ``torch.float16``, the dtype of the model's weights (positional or
            keyword); a precision string such as ``"bf16"`` is refused, naming the dtype.
        loss_scaler: a halfprec loss scaler (copied per optimizer); ``None`` = ``DynamicLossScaler()`` for
            fp16, no scaling for bf16.
        skip_nonfinite: skip steps with non-finite bf16 grads too (fp16 is always checked).
        impl: ``"auto"`` (the fused optimizer on CUDA when it supports the optimizer, else the exact path),
            ``"torch"`` (the exact path: fp32 master grads that hooks and value clipping can edit) or ``"triton"``.
        grad_accum_dtype: ``"fp32"`` accumulates ``accumulate_grad_batches`` micro-batches in fp32
            (``MixedPrecisionOptimizer``'s argument); ``"param"`` in the 16-bit grads; ``"auto"``: fp32 for bf16
            with ``accumulate_grad_batches > 1`` on one process (Fabric: only when told).
    """

    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple[Any, list, list]:
        trainer = _trainer(model)
        check_trainer_strategy(getattr(trainer, "strategy", None))
        micro_batches = getattr(trainer, "accumulate_grad_batches", 1)
        clip_val = getattr(trainer, "gradient_clip_val", None)
        by_value = clip_val and getattr(trainer, "gradient_clip_algorithm", None) == "value"
        by_id: dict[int, MixedPrecisionOptimizer] = {}
        wrapped = []
        # every fit (and Tuner.lr_find) connects its optimizers anew: only this fit's are the plugin's
        self._optimizers = []
        for optimizer in optimizers:
            mp = self.wrap_optimizer(optimizer, micro_batches=micro_batches)
            if mp.max_grad_norm is not None and clip_val:
                raise ValueError(
                    f"the MixedPrecisionOptimizer clips at max_grad_norm={mp.max_grad_norm!r} and the Trainer has "
                    f"gradient_clip_val={clip_val!r}; set one of them (returning plain optimizers from "
                    "configure_optimizers lets gradient_clip_val decide)"
                )
            if by_value:
                _check_value_clipping(mp)
            self._base_clip[id(mp)] = mp.max_grad_norm
            by_id[id(_unwrap(optimizer))] = by_id[id(mp)] = by_id[id(mp.optimizer or mp)] = mp
            wrapped.append(mp)
        self.release_fp32()
        for config in lr_schedulers:
            scheduler = config.scheduler
            mp = by_id.get(id(getattr(scheduler, "optimizer", None)))
            proxied = isinstance(scheduler, _HoldOnSkipScheduler)
            if mp is not None and config.interval == "step" and not proxied:
                config.scheduler = _HoldOnSkipScheduler(scheduler, mp)
        return model, wrapped, lr_schedulers

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        model.backward(self._scaled(tensor, optimizer), *args, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        mp = self._mp(optimizer)
        try:
            closure_result = closure()
            if closure_result is None and getattr(model, "automatic_optimization", False):
                return closure_result  # training_step returned None: no backward ran, nothing to step
            if mp.unscales_in_place:
                mp.unscale_()  # on_before_optimizer_step sees the unscaled master grads (fused: unscaled_grads())
            self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then gradient clipping
            mp.step(**kwargs)
            return closure_result
        finally:
            # clip_grad_by_norm (in _after_closure, or the user's before a manual opt.step()) sets the norm for
            # this one step.
            mp.max_grad_norm = self._base_clip.get(id(mp))

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        # Deferred into step(): the overflow check runs first and grad_norm stays the pre-clip norm (the fused
        # path clips in its finalize program).
        self._mp(optimizer).max_grad_norm = float(clip_val)

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_val = float(clip_val)
        mp = self._mp(optimizer)
        _check_value_clipping(mp)
        mp.unscale_()
        with torch.no_grad():
            for m in mp.master_params():
                if m.grad is not None:
                    # Non-finite entries are left alone so that step() still sees the overflow and skips.
                    m.grad.copy_(torch.where(m.grad.isfinite(), m.grad.clamp(-clip_val, clip_val), m.grad))


class HalfprecFabricPrecision(_Common, _FabricPrecision):
    """``Fabric(plugins=[HalfprecFabricPrecision(torch.bfloat16 | torch.float16)])``; set up with
    :func:`setup_fabric`.

    Args are those of :class:`HalfprecPrecision`.
    """

    def convert_output(self, data: Any) -> Any:
        # As Fabric's "bf16-true": outputs come back in the default dtype (an exact upcast).
        return apply_to_collection(
            data, function=_to_dtype, dtype=torch.Tensor, dst_type=torch.get_default_dtype()
        )

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        self._scaled(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self._mp(optimizer).step(**kwargs)


def setup_fabric(
    fabric: Any,
    module: torch.nn.Module,
    *optimizers: torch.optim.Optimizer,
    max_grad_norm: float | None = None,
    **setup_kwargs: Any,
) -> Any:
    """``fabric.setup(module, *optimizers)`` with each plain optimizer wrapped in a ``MixedPrecisionOptimizer``.

    Call it instead of ``fabric.setup`` on the fp32 module and the optimizers built over it; ``fabric`` must
    have a ``HalfprecFabricPrecision`` plugin. ``max_grad_norm`` clips the unscaled master grads inside each
    step (why rather than ``fabric.clip_gradients``: docs/integrations.md).
    """
    check_fabric_strategy(fabric.strategy)
    plugin = fabric.strategy.precision
    if not isinstance(plugin, HalfprecFabricPrecision):
        raise ValueError(
            f"fabric has the precision plugin {type(plugin).__name__}; build it with "
            "Fabric(plugins=[HalfprecFabricPrecision(torch.bfloat16 | torch.float16)]) and no precision= argument"
        )
    if setup_kwargs.get("move_to_device", True):
        # Masters are made where the params are when the optimizer is wrapped: on the device, not on the host
        # that fabric.setup would move the module away from.
        module.to(fabric.device)
    plugin.convert_module(module)  # the fp32 tensors are remembered, the params cast
    if not optimizers:
        raise ValueError("setup_fabric needs at least one optimizer; without one use fabric.setup(module)")
    wrapped = [plugin.wrap_optimizer(opt, max_grad_norm) for opt in optimizers]
    plugin.release_fp32()
    return fabric.setup(module, *wrapped, **setup_kwargs)
