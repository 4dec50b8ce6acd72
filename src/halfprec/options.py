"""Checks of the options every halfprec optimizer takes (the generic, fused and sharded ones alike)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch

from .masters import LOW_PRECISION
from .scaler import LossScaler

__all__ = ["check_options", "check_unfrozen", "min_scale_message"]


def check_options(
    *, loss_scaler: Any, max_grad_norm: Any, param_dtype: torch.dtype | None, skip_nonfinite: Any = True
) -> None:
    """Raise ValueError naming the value and the fix for a bad ``loss_scaler``, ``max_grad_norm`` or ``param_dtype``."""
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ValueError(
            f"loss_scaler must be a halfprec StaticLossScaler or DynamicLossScaler, got {type(loss_scaler).__name__}"
        )
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not isinstance(max_grad_norm, numbers.Real)
        or not math.isfinite(float(max_grad_norm))
        or float(max_grad_norm) <= 0
    ):
        raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
    if not isinstance(skip_nonfinite, bool):
        raise ValueError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    if param_dtype is not None and param_dtype not in LOW_PRECISION:
        raise ValueError(f"param_dtype must be torch.float16, torch.bfloat16 or None, got {param_dtype!r}")


def check_unfrozen(frozen: Iterable[torch.Tensor]) -> None:
    """Raise when a param that was frozen when the optimizer was built has been unfrozen and got a grad.

    halfprec made no FP32 master (nor shard, nor fused slot) for it, so it cannot be trained; applying its
    16-bit, still loss-scaled grad directly, or dropping it, would both be silent. A frozen param that keeps a
    stale ``.grad`` while still frozen is left alone, as the user froze it.
    """
    for p in frozen:
        if p.requires_grad and p.grad is not None:
            raise RuntimeError(
                f"a param of shape {tuple(p.shape)} and dtype {p.dtype} was frozen (requires_grad=False) when the "
                "optimizer was wrapped and has a gradient now: halfprec made no FP32 master for it, so it cannot "
                "be trained. Set requires_grad=True on every param you will train before wrapping (freeze them "
                "afterwards: params without a grad are not updated), or wrap a new optimizer after unfreezing."
            )


def min_scale_message(scale: float) -> str:
    """The one warning given when gradients overflow at the dynamic scaler's minimum scale."""
    return (
        f"halfprec: gradients overflowed at the minimum loss scale {scale:g}; the scale cannot go lower, so every "
        "such step is skipped. Lower min_scale, lower the learning rate, or train in bf16."
    )
