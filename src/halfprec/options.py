"""Checks of the options every halfprec optimizer takes (the generic, fused and sharded ones alike)."""

from __future__ import annotations

import math
from typing import Any

import torch

from .masters import LOW_PRECISION
from .scaler import LossScaler

__all__ = ["check_options"]


def check_options(*, loss_scaler: Any, max_grad_norm: Any, param_dtype: torch.dtype | None) -> None:
    """Raise ValueError naming the value and the fix for a bad ``loss_scaler``, ``max_grad_norm`` or ``param_dtype``."""
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ValueError(
            f"loss_scaler must be a halfprec StaticLossScaler or DynamicLossScaler, got {type(loss_scaler).__name__}"
        )
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool)
        or not math.isfinite(float(max_grad_norm))
        or float(max_grad_norm) <= 0
    ):
        raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_grad_norm!r}")
    if param_dtype is not None and param_dtype not in LOW_PRECISION:
        raise ValueError(f"param_dtype must be torch.float16, torch.bfloat16 or None, got {param_dtype!r}")
