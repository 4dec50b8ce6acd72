"""Training configuration: one frozen dataclass, and a reader for DeepSpeed JSON configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = ["Config"]


@dataclass(frozen=True, kw_only=True)
class Config:
    """What ``halfprec.initialize`` needs to know. Every field has a working default."""

    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """dtype the model's weights are held in; the masters are always fp32."""

    static_loss_scale: float | None = None
    """A fixed loss scale (a power of two; 1.0 = no scaling). ``None``: dynamic scaling for fp16, none otherwise."""

    initial_scale: float = 2.0**16
    """Dynamic scaling: the starting scale (power of two)."""

    growth_factor: float = 2.0
    """Dynamic scaling: factor applied after ``growth_interval`` clean steps (power of two, > 1)."""

    backoff_factor: float = 0.5
    """Dynamic scaling: factor applied on backoff (power of two, < 1)."""

    growth_interval: int = 1000
    """Dynamic scaling: clean steps before the scale grows."""

    hysteresis: int = 2
    """Dynamic scaling: overflows (since the last growth or backoff) before the scale backs off."""

    min_scale: float = 1.0
    """Dynamic scaling: the scale never goes below this (power of two)."""

    max_grad_norm: float | None = None
    """Clip the global L2 norm of the unscaled grads to this; ``None`` = no clipping."""

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; ``Engine.backward`` divides the loss by it."""

    skip_nonfinite: bool = True
    """Skip steps with non-finite bf16/fp32 grads (fp16 grads are always checked)."""

    zero_stage: Literal[0, 1, 2] = 0
    """0: one process or DDP; 1/2: sharded optimizer state (and gradients) across data-parallel ranks."""

    reduce_dtype: Literal["fp32", "param"] = "fp32"
    """Sharded stages: dtype of the gradient reduce-scatter (fp32, or the params' 16-bit dtype)."""

    impl: Literal["auto", "torch", "triton"] = "auto"
    """Optimizer step implementation: the exact torch path, the fused Triton kernels, or pick automatically."""

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)
