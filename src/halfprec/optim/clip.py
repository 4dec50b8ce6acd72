"""The clip coefficient of global-norm clipping, in one place for the strategies that clip in torch ops (the fused
finalize program, ``kernels/norm.py``, computes the same expression on the device)."""

from __future__ import annotations

import torch

__all__ = ["clip_coefficient"]


def clip_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """``min(max_norm / (norm + 1e-6), 1)``: ``torch.nn.utils.clip_grads_with_norm_``'s arithmetic, so that grads
    multiplied by it are bit for bit what torch's clipping leaves."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
