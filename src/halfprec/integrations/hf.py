"""halfprec under the HuggingFace ``Trainer``: the Trainer keeps its loop, halfprec owns the dtype and the scale.

``create_optimizer`` wraps the optimizer in a ``MixedPrecisionOptimizer``, which clips at ``max_grad_norm``
inside ``step()`` (the Trainer's ``accelerator.clip_grad_norm_`` would clip the scaled 16-bit grads) and reports
the logged ``grad_norm``. For fp16 a gradient hook on the loss ``compute_loss`` returns multiplies the incoming
gradient by the loss scale (exact), so the loss the Trainer logs stays unscaled. ``create_scheduler`` (called
right after ``accelerator.prepare``) links the skipped steps to ``accelerator.optimizer_step_was_skipped``, which
holds the LR schedule. Three overridden methods are private (``_clip_grad_norm``, ``_get_grad_norm``,
``_maybe_log_save_evaluate``); tested with transformers 5.24. Usage: docs/integrations.md.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..optim.base import MixedPrecisionOptimizer
from ..precision import LOW_PRECISION, check_low_precision
from ..scaler import LossScaler
from . import accelerate as _hp_accelerate
from . import check_strategy, require, resolve_grad_accum_dtype

__all__ = ["HalfprecCallback", "HalfprecTrainer", "HalfprecTrainerMixin", "check_training_args"]


transformers = require("transformers", "hf")


# The Trainer methods the mixin overrides (three of them private, and _maybe_log_save_evaluate): fail loudly, not
# silently, where a transformers version lays the loop out differently.
_HOOKS = ("compute_loss", "create_optimizer", "create_scheduler", "log", "_clip_grad_norm", "_get_grad_norm")


def _check_trainer_hooks() -> None:
    missing = [n for n in _HOOKS if not callable(getattr(transformers.Trainer, n, None))]
    log_step = getattr(transformers.Trainer, "_maybe_log_save_evaluate", None)
    if log_step is None or list(inspect.signature(log_step).parameters)[1:3] != ["tr_loss", "grad_norm"]:
        missing.append("_maybe_log_save_evaluate(tr_loss, grad_norm, ...)")
    if missing:
        raise ImportError(
            f"halfprec.integrations.hf does not support transformers {transformers.__version__}: its Trainer lacks "
            f"{', '.join(missing)} (tested with 5.24)"
        )


_check_trainer_hooks()


def check_training_args(args: Any) -> None:
    """Raise ``ValueError`` for ``TrainingArguments`` that would make the Trainer own precision or the optimizer."""
    for name in ("fp16", "bf16"):
        if getattr(args, name, False):
            raise ValueError(
                f"TrainingArguments({name}=True) turns on autocast (and for fp16 a GradScaler) on top of halfprec, "
                f"which owns the weight dtype and the loss scale: use TrainingArguments(fp16=False, bf16=False) "
                f"and HalfprecTrainer(..., param_dtype=torch.{'float16' if name == 'fp16' else 'bfloat16'})"
            )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            "TrainingArguments(deepspeed=...) brings DeepSpeed's own master weights and loss scaling; halfprec "
            "and DeepSpeed are alternatives: drop deepspeed= or use the plain Trainer"
        )
    if getattr(args, "fsdp", None):
        version = (getattr(args, "fsdp_config", None) or {}).get("version", 2)
        _refuse_fsdp(f"TrainingArguments(fsdp={args.fsdp!r})", version)


def _refuse_fsdp(setting: str, version: int) -> None:
    # transformers' Trainer._prepare_for_training: with FSDP2 it builds the optimizer before
    # accelerator.prepare(model, optimizer), and it refuses optimizers= under FSDP (Trainer.__init__)
    why = (
        "under FSDP2 the Trainer builds the optimizer over the whole model, then Accelerate's prepare() shards "
        "the model and swaps the optimizer's params for the shards, which halfprec's fp32 masters are not of; "
        "the Trainer has no step between the two where halfprec could build its optimizer over the shards"
        if int(version) == 2
        else "FSDP1 wraps the model in FullyShardedDataParallel, whose flat params halfprec does not train (it "
        "trains FSDP2's DTensor shards)"
    )
    raise ValueError(
        f"{setting}: {why}, and the Trainer's FSDP checkpoints save the optimizer through torch.distributed."
        "checkpoint's get_optimizer_state_dict, which reads torch's own optimizer format. Drop fsdp (DDP), or "
        "train FSDP2 with halfprec under Accelerate (halfprec.integrations.accelerate: prepare the 16-bit model, "
        "then the MixedPrecisionOptimizer over its shards) or in your own loop (docs/integrations.md)"
    )


def _unwrap(optimizer: Any) -> MixedPrecisionOptimizer | None:
    """The halfprec optimizer inside an AcceleratedOptimizer (or itself), or None."""
    while optimizer is not None and not isinstance(optimizer, MixedPrecisionOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


class HalfprecCallback(transformers.TrainerCallback):
    """Checks, when training starts, that the Trainer really trains through halfprec; frees the optimizer's grad
    buffers after each step.

    ``HalfprecTrainerMixin`` adds it; it catches a ``HalfprecTrainer`` whose ``create_optimizer`` was
    overridden to return a plain optimizer, and ``TrainingArguments`` changed after construction.
    """

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        # The Trainer clears grads with model.zero_grad(), which leaves the optimizer's flat grad buffer (2 B/param,
        # 4 with fp32 accumulation) alive through the next forward; zero_grad frees it, as the engine does.
        mp = _unwrap(optimizer)
        if mp is not None:
            mp.zero_grad(set_to_none=True)

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        check_training_args(args)
        if _unwrap(optimizer) is None:
            raise RuntimeError(
                f"the Trainer steps a {type(optimizer).__name__}, not a halfprec MixedPrecisionOptimizer: do not "
                "override create_optimizer() to return a plain optimizer in a HalfprecTrainer"
            )


class HalfprecTrainerMixin:
    """Put in front of ``transformers.Trainer`` (or a subclass of it) to train with halfprec.

    Args (keyword-only, besides the Trainer's own):
        param_dtype: ``torch.bfloat16`` or ``torch.float16``: the dtype the fp32 model is cast to when the
            optimizer is wrapped. ``None`` when the model is already 16-bit (masters then start from the 16-bit
            weights) or when a ``MixedPrecisionOptimizer`` is passed in ``optimizers=``.
        loss_scaler: a halfprec loss scaler; ``None`` = ``DynamicLossScaler()`` for fp16, no scaling for bf16.
        impl: ``"auto"`` (the fused optimizer on CUDA when it supports the optimizer, else the exact path),
            ``"torch"`` (the exact path) or ``"triton"``; for an optimizer passed in ``optimizers=``, only when it
            is a plain torch one.
        grad_accum_dtype: ``"fp32"`` accumulates ``gradient_accumulation_steps`` micro-batches in fp32
            (``MixedPrecisionOptimizer``'s argument); ``"param"`` in the 16-bit grads; ``"auto"``: fp32 for bf16
            with ``gradient_accumulation_steps > 1`` on one process.
    """

    def __init__(
        self,
        *args: Any,
        param_dtype: torch.dtype | None = None,
        loss_scaler: LossScaler | None = None,
        impl: str = "auto",
        grad_accum_dtype: str = "auto",
        **kwargs: Any,
    ) -> None:
        # refused before the Trainer builds anything on these arguments
        if "halfprec_dtype" in kwargs:
            raise ValueError(
                f"halfprec_dtype={kwargs['halfprec_dtype']!r}: the 16-bit dtype is spelled param_dtype= everywhere "
                "in halfprec; pass HalfprecTrainer(..., param_dtype=...)"
            )
        check_training_args(kwargs.get("args", args[1] if len(args) > 1 else None))
        self.halfprec_param_dtype = check_low_precision(param_dtype, "param_dtype")
        check_strategy(impl, grad_accum_dtype)
        self.halfprec_impl = impl
        self.halfprec_grad_accum_dtype = grad_accum_dtype
        self._halfprec_loss_scaler = loss_scaler
        self._halfprec_checked: MixedPrecisionOptimizer | None = None  # the optimizer the scale check hooks
        self._halfprec_loss_hooks: list = []  # this training_step's scaling hooks on compute_loss's loss
        self._halfprec_scaled = False  # since the last step: a backward was loss-scaled
        self._halfprec_flop_params: tuple[Any, int] | None = None  # (model, its non-embedding param count)
        super().__init__(*args, **kwargs)
        check_training_args(self.args)
        if getattr(self, "is_fsdp_enabled", False):  # FSDP from the Accelerate config (accelerate launch)
            _refuse_fsdp(
                "the Accelerate config turns FSDP on", self.accelerator.state.fsdp_plugin.fsdp_version
            )
        if not any(isinstance(cb, HalfprecCallback) for cb in self.callback_handler.callbacks):
            self.add_callback(HalfprecCallback())

    # --- optimizer and scheduler -------------------------------------------------------------------------
    @property
    def halfprec_optimizer(self) -> MixedPrecisionOptimizer | None:
        """The ``MixedPrecisionOptimizer`` the Trainer steps (``None`` before ``create_optimizer``)."""
        return _unwrap(self.optimizer)

    def _halfprec_max_grad_norm(self, mp: MixedPrecisionOptimizer | None) -> float | None:
        clip = self.args.max_grad_norm
        wanted = float(clip) if clip and clip > 0 else None
        have = None if mp is None else mp.max_grad_norm
        if have is not None and wanted is not None and have != wanted:
            raise ValueError(
                f"the MixedPrecisionOptimizer clips at max_grad_norm={have!r} but TrainingArguments has "
                f"max_grad_norm={wanted!r}; set one of them (TrainingArguments(max_grad_norm=0) leaves the "
                "optimizer's value in charge)"
            )
        return wanted if wanted is not None else have

    def create_optimizer(self, model=None):
        built = self.optimizer is None
        optimizer = super().create_optimizer(model) if built else self.optimizer
        mp = _unwrap(optimizer)
        if mp is None:
            low = {p.dtype for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
            if self.halfprec_param_dtype is None and not low & set(LOW_PRECISION):
                raise ValueError(
                    "the model's trainable params are fp32 and param_dtype is None: pass "
                    "HalfprecTrainer(..., param_dtype=torch.bfloat16) (or torch.float16) so halfprec casts them"
                )
            mp = MixedPrecisionOptimizer(
                optimizer,
                loss_scaler=self._halfprec_loss_scaler,
                max_grad_norm=self._halfprec_max_grad_norm(None),
                param_dtype=self.halfprec_param_dtype,
                impl=self.halfprec_impl,
                # the Trainer's default optim="adamw_torch_fused" sets fused=True, which asks for torch's kernel
                # when a user sets it; the Trainer chose it, and halfprec's step replaces torch's anyway
                tool_flags=built,
                grad_accum_dtype=resolve_grad_accum_dtype(
                    self.halfprec_grad_accum_dtype,
                    optimizer,
                    self.halfprec_param_dtype,
                    self.args.gradient_accumulation_steps,
                ),
            )
        else:
            mp.max_grad_norm = self._halfprec_max_grad_norm(mp)
        if self._halfprec_checked is not mp:
            mp.register_step_pre_hook(self._halfprec_check_scaled)
            self._halfprec_checked = mp
        self.optimizer = mp
        return mp

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # The Trainer calls this right after accelerator.prepare(model, optimizer).
        _hp_accelerate.attach(self.accelerator)
        return super().create_scheduler(num_training_steps, optimizer)

    # --- loss scaling ---------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        # The scaling hook goes on whatever loss compute_loss returns: a subclass that overrides compute_loss
        # (the usual way to customise the loss) need not call super(). For this one call, the instance's
        # compute_loss is a wrapper around the class's; nothing outside this Trainer is touched.
        compute_loss = self.compute_loss

        def scaled_compute_loss(*args: Any, **kwargs: Any) -> Any:
            result = compute_loss(*args, **kwargs)
            self._halfprec_scale(result[0] if isinstance(result, tuple) else result)
            return result

        self.compute_loss = scaled_compute_loss
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            del self.compute_loss
            self._halfprec_loss_hooks = []

    def _halfprec_scale(self, loss: Any) -> None:
        mp = self.halfprec_optimizer
        if mp is not None and torch.is_tensor(loss) and loss.requires_grad:
            # Scales every gradient below the loss (scale_loss returns the grad itself when scaling is off);
            # the loss the Trainer divides, logs and returns stays unscaled.
            self._halfprec_loss_hooks.append(loss.register_hook(mp.scale_loss))
            self._halfprec_scaled = True

    def halfprec_scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale, for a ``training_step`` override that calls ``self.accelerator.backward``
        itself. Removes this step's scaling hooks on ``compute_loss``'s loss, which would otherwise scale twice."""
        mp = self.halfprec_optimizer
        if mp is None:
            raise RuntimeError(
                "halfprec_scale_loss() before the optimizer exists: call it from training_step"
            )
        for handle in self._halfprec_loss_hooks:
            handle.remove()
        self._halfprec_loss_hooks = []
        self._halfprec_scaled = True
        return mp.scale_loss(loss)

    def _halfprec_check_scaled(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: a step whose backward was not loss-scaled would apply grads ``loss_scale`` too small."""
        scaled, self._halfprec_scaled = self._halfprec_scaled, False
        if not scaled and not optimizer.loss_scaler.is_unit:
            raise RuntimeError(
                "the optimizer stepped after a backward that halfprec did not loss-scale: a training_step "
                "override must call super().training_step(...), or scale the loss itself: "
                "self.accelerator.backward(self.halfprec_scale_loss(loss))"
            )

    # --- host time per step -----------------------------------------------------------------------------
    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's count (6 x input tokens x non-embedding params), the param count taken once per model:
        the Trainer's own walks every module twice at every step (about 1 ms of host time per step for a
        16-layer Llama on the H200's host, where the step is host-bound: benchmarks/RESULTS.md)."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._halfprec_flop_params is None or self._halfprec_flop_params[0] is not self.model:
            self._halfprec_flop_params = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main].numel() * self._halfprec_flop_params[1]

    # --- clipping and the logged norm (halfprec clips inside step(), on the fp32 master grads) -----------
    def _clip_grad_norm(self, model):
        return None

    def _get_grad_norm(self, model, grad_norm=None):
        return None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        mp = self.halfprec_optimizer
        if mp is not None and "loss" in logs:
            logs = {**logs, "loss_scale": mp.loss_scale, "skipped_steps": mp.skipped_steps}
        return super().log(logs, *args, **kwargs)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        mp = self.halfprec_optimizer
        if mp is not None:
            # unscaled, before clipping; None when neither clipping nor checking ran. On the fused path a device
            # tensor, which the Trainer reads (a host sync) only on the steps it logs.
            grad_norm = mp.step_results().grad_norm_deferred
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)


class HalfprecTrainer(HalfprecTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training with halfprec; see the module docstring."""
