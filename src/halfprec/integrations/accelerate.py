"""halfprec under HuggingFace Accelerate: halfprec owns the dtype and the loss scale, Accelerate the rest.

Build the ``MixedPrecisionOptimizer`` (:func:`wrap_optimizer`) before :func:`prepare`, under
``Accelerator(mixed_precision="no")``; the scaled entry point is ``accelerator.backward(mp.scale_loss(loss))``.
Clip with the optimizer's ``max_grad_norm``: ``accelerator.clip_grad_norm_`` would clip the params' grads, which
are loss-scaled and 16-bit on either path. Usage and checkpoints: docs/integrations.md.

Why the link (:func:`attach`): with ``mixed_precision="no"`` Accelerate's ``AcceleratedOptimizer.step_was_skipped``
is always False (it is set only around its own GradScaler), so ``AcceleratedScheduler.step`` and
``accelerator.optimizer_step_was_skipped`` (which the HF Trainer reads) would advance the LR schedule over
halfprec's overflow skips; a step post-hook copies ``step_was_skipped`` into the ``AcceleratedOptimizer``.

FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): ``accelerator.prepare(model, optimizer)`` shards the
model and then swaps the optimizer's params for the shards (``Accelerator._prepare_fsdp2``:
``fsdp2_switch_optimizer_parameters``), which a halfprec optimizer, whose param groups hold its fp32 masters,
cannot take. So the 16-bit model is prepared first, the ``MixedPrecisionOptimizer`` is built over its shards,
and :func:`prepare` hands that one to ``accelerator.prepare_optimizer`` (no swap) and the rest to
``accelerator.prepare``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..optim.base import MixedPrecisionOptimizer
from . import check_strategy, require, resolve_grad_accum_dtype
from .fsdp import trains_shards

__all__ = ["attach", "check_accelerator", "prepare", "wrap_optimizer"]

_HOOK_ATTR = "_halfprec_skip_hook"


def check_accelerator(accelerator: Any) -> None:
    """Raise ``ValueError`` when ``accelerator`` is configured to own precision or the optimizer itself."""
    DistributedType = require("accelerate.utils", "accelerate").DistributedType

    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={mixed!r}) adds autocast (and for fp16 a GradScaler) on top of halfprec, "
            "which already owns the weight dtype and the loss scale: build Accelerator(mixed_precision='no') and "
            "pass param_dtype= to halfprec.MixedPrecisionOptimizer"
        )
    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"Accelerator with distributed_type={kind.value!r} brings its own master weights and loss scaling; "
            "halfprec and it are alternatives, not layers: use plain DDP (MULTI_GPU/MULTI_CPU), FSDP2 "
            "(FullyShardedDataParallelPlugin(fsdp_version=2)) or no distribution with halfprec"
        )
    if kind == DistributedType.FSDP and not _fsdp2(accelerator):
        raise ValueError(
            "Accelerator with FSDP1 (fsdp_version=1) wraps the model in FullyShardedDataParallel, whose flat "
            "params replace the ones halfprec's masters were built of; halfprec trains FSDP2's shards: use "
            "FullyShardedDataParallelPlugin(fsdp_version=2), prepare the 16-bit model, then build the "
            "MixedPrecisionOptimizer over its params (docs/integrations.md)"
        )


def _fsdp2(accelerator: Any) -> bool:
    return bool(getattr(accelerator, "is_fsdp2", False))


def _halfprec(obj: Any) -> MixedPrecisionOptimizer | None:
    """The halfprec optimizer ``obj`` is, or that an ``AcceleratedOptimizer`` ``obj`` wraps; else None."""
    while isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, MixedPrecisionOptimizer):
        obj = getattr(obj, "optimizer", None)  # a scheduler has one too: only optimizers are unwrapped
    return obj if isinstance(obj, MixedPrecisionOptimizer) else None


def _check_accumulation(accelerator: Any, grad_accum_dtype: str) -> None:
    """FSDP2 and fp32 sums need every micro-batch reduce-scattered, which ``accumulate()`` turns off by default."""
    steps = accelerator.gradient_accumulation_steps
    if grad_accum_dtype == "fp32" and steps > 1 and not _syncs_each_batch(accelerator):
        raise ValueError(
            "grad_accum_dtype='fp32' sums each micro-batch's reduce-scattered FSDP2 shards, and "
            f"accelerator.accumulate() turns FSDP2's gradient sync off for all but the last of its {steps} "
            "micro-batches (model.set_requires_gradient_sync(False)), whose grads FSDP2 would sum in its "
            "unsharded buffer, not in fp32: "
            f"on several processes, build the Accelerator with gradient_accumulation_plugin="
            f"GradientAccumulationPlugin(num_steps={steps}, sync_each_batch=True); else use grad_accum_dtype='param'"
        )


def _syncs_each_batch(accelerator: Any) -> bool:
    """Whether ``accumulate()`` keeps gradient sync on for every micro-batch (it honours ``sync_each_batch`` only
    on several processes: ``Accelerator.accumulate``, ``use_distributed``)."""
    plugin = accelerator.gradient_state.plugin_kwargs
    return bool(accelerator.use_distributed and plugin.get("sync_each_batch", False))


def _prepare_fsdp2(accelerator: Any, args: tuple, kwargs: dict) -> Any:
    """``accelerator.prepare`` for FSDP2, the halfprec optimizers given to ``prepare_optimizer`` first (so that the
    schedulers prepared after find them), everything else to ``prepare``, in one call (module docstring)."""
    ours = {i: mp for i, a in enumerate(args) if (mp := _halfprec(a)) is not None}
    for mp in ours.values():
        if not trains_shards(mp.model_params()):
            raise ValueError(
                f"the {type(mp).__name__} was built over params that are not FSDP2 shards, and Accelerate's "
                "FSDP2 prepare() shards the model and then swaps the optimizer's params for the shards, which "
                "halfprec's masters are not of: cast the model to 16 bits, prepare it alone first (model = "
                "hp_accelerate.prepare(accelerator, model)), then build the MixedPrecisionOptimizer over "
                "model.parameters() and prepare it with the rest (docs/integrations.md)"
            )
        _check_accumulation(accelerator, mp.grad_accum_dtype)
    placement = kwargs.pop("device_placement", None) or [None] * len(args)
    # an AcceleratedOptimizer around one of them was prepared already
    out = {
        i: accelerator.prepare_optimizer(mp, device_placement=placement[i]) if args[i] is mp else args[i]
        for i, mp in ours.items()
    }
    rest = [i for i in range(len(args)) if i not in ours]
    if rest:
        done = accelerator.prepare(*(args[i] for i in rest), device_placement=[placement[i] for i in rest])
        out.update(zip(rest, done if len(rest) > 1 else (done,), strict=True))
    result = tuple(out[i] for i in range(len(args)))
    return result if len(result) > 1 else result[0]


def _link(prepared: Any, mp: MixedPrecisionOptimizer) -> None:
    if getattr(prepared, _HOOK_ATTR, None) is not None:
        return
    if getattr(prepared, "scaler", None) is not None:
        raise ValueError(
            "this AcceleratedOptimizer carries Accelerate's GradScaler; halfprec does its own loss scaling: "
            "build Accelerator(mixed_precision='no')"
        )

    def _after_step(optimizer: MixedPrecisionOptimizer, args: Any, kwargs: Any) -> None:
        # AcceleratedOptimizer.step_was_skipped reads _is_overflow, which Accelerate sets only with its scaler.
        prepared._is_overflow = optimizer.step_was_skipped

    setattr(prepared, _HOOK_ATTR, mp.register_step_post_hook(_after_step))


def attach(accelerator: Any) -> None:
    """Check ``accelerator`` and make every prepared ``MixedPrecisionOptimizer``'s skips visible to it.

    Works for ``MixedPrecisionOptimizer`` and the fused optimizers (``halfprec.optim.FusedAdamW``, ...).
    Idempotent: safe to call after every ``accelerator.prepare``.
    """
    check_accelerator(accelerator)
    for prepared in accelerator._optimizers:
        inner = getattr(prepared, "optimizer", None)
        if isinstance(inner, MixedPrecisionOptimizer):
            _link(prepared, inner)


def prepare(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
    """``accelerator.prepare(*args, **kwargs)``, checked first and :func:`attach`-ed after; with FSDP2, each
    halfprec optimizer goes through ``accelerator.prepare_optimizer`` (module docstring)."""
    check_accelerator(accelerator)
    if _fsdp2(accelerator):
        out = _prepare_fsdp2(accelerator, args, dict(kwargs))
    else:
        out = accelerator.prepare(*args, **kwargs)
    attach(accelerator)
    return out


def wrap_optimizer(
    accelerator: Any,
    optimizer: torch.optim.Optimizer,
    *,
    param_dtype: torch.dtype | None = None,
    grad_accum_dtype: str = "auto",
    **kwargs: Any,
) -> MixedPrecisionOptimizer:
    """``MixedPrecisionOptimizer(optimizer, param_dtype=..., **kwargs)`` accumulating as ``grad_accum_dtype``
    says: ``"auto"`` (the default) is fp32 for bf16 with ``accelerator.gradient_accumulation_steps > 1`` on one
    process, ``"param"`` the params' 16-bit ``.grad``, ``"fp32"`` fp32. Call it before :func:`prepare`; with
    FSDP2, over the prepared model's shards, where ``"auto"`` is fp32 only when ``accumulate()`` keeps every
    micro-batch reduce-scattered (``GradientAccumulationPlugin(sync_each_batch=True)``, several processes)."""
    check_strategy(kwargs.get("impl", "auto"), grad_accum_dtype)
    steps = accelerator.gradient_accumulation_steps
    params = [p for group in optimizer.param_groups for p in group["params"]]
    shards = _fsdp2(accelerator) and trains_shards(params)
    # FSDP2: fp32 sums where accumulate() keeps FSDP2 reduce-scattering every micro-batch
    fp32_sums = _syncs_each_batch(accelerator) if shards else None
    accum = resolve_grad_accum_dtype(grad_accum_dtype, optimizer, param_dtype, steps, fp32_sums=fp32_sums)
    if shards:
        _check_accumulation(accelerator, accum)
    return MixedPrecisionOptimizer(optimizer, param_dtype=param_dtype, grad_accum_dtype=accum, **kwargs)
