"""halfprec under HuggingFace Accelerate: halfprec owns the dtype and the loss scale, Accelerate the rest.

Build the ``MixedPrecisionOptimizer`` (:func:`wrap_optimizer`) before :func:`prepare`, under
``Accelerator(mixed_precision="no")``; the scaled entry point is ``accelerator.backward(mp.scale_loss(loss))``.
Clip with the optimizer's ``max_grad_norm``: ``accelerator.clip_grad_norm_`` would clip the params' grads, which
are loss-scaled and 16-bit on either path. Usage and checkpoints: docs/integrations.md.

Why the link (:func:`attach`): with ``mixed_precision="no"`` Accelerate's ``AcceleratedOptimizer.step_was_skipped``
is always False (it is set only around its own GradScaler), so ``AcceleratedScheduler.step`` and
``accelerator.optimizer_step_was_skipped`` (which the HF Trainer reads) would advance the LR schedule over
halfprec's overflow skips; a step post-hook copies ``step_was_skipped`` into the ``AcceleratedOptimizer``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..optim.base import MixedPrecisionOptimizer
from . import check_strategy, require, resolve_grad_accum_dtype

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
    if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(
            f"Accelerator with distributed_type={kind.value!r} brings its own master weights and loss scaling "
            "(FSDP: it shards the model after halfprec built its masters); halfprec and it are alternatives, not "
            "layers: use plain DDP (MULTI_GPU/MULTI_CPU) or no distribution with halfprec, or for FSDP2 shard the "
            "16-bit model yourself with fully_shard before building halfprec.MixedPrecisionOptimizer "
            "(docs/distributed.md, FSDP2)"
        )


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
    """``accelerator.prepare(*args, **kwargs)``, checked first and :func:`attach`-ed after."""
    check_accelerator(accelerator)
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
    process, ``"param"`` the params' 16-bit ``.grad``, ``"fp32"`` fp32. Call it before :func:`prepare`."""
    check_strategy(kwargs.get("impl", "auto"), grad_accum_dtype)
    steps = accelerator.gradient_accumulation_steps
    accum = resolve_grad_accum_dtype(grad_accum_dtype, optimizer, param_dtype, steps)
    return MixedPrecisionOptimizer(optimizer, param_dtype=param_dtype, grad_accum_dtype=accum, **kwargs)
