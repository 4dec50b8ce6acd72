"""Tolerances of the fused (Triton) path against the exact torch path (MixedPrecisionOptimizer over the torch
optimizer, same grads, same scaler and clipping), after the few steps the tests run.

Why not bit-exact: the global norm is summed in another order (per-block partials vs per-tensor norms), so
the clip coefficient can differ in its last bit; the GPU contracts multiply-adds into FMAs; addcdiv is
evaluated as p - s * (m / d). Step counters, skip decisions and loss-scale updates are exact (compared with
``==``). The 16-bit params are always exactly the masters rounded to nearest even (checked bitwise).
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "tol"]

# (what, dtype of the model params) -> dict(rtol, atol) for torch.testing.assert_close
TOLERANCES = {
    # fp32 masters: a few fp32 ulps per step, relative to |p| ~ 1 (measured max diff 1.2e-7 after 3 steps)
    ("master", torch.float16): dict(rtol=1e-5, atol=2e-6),
    ("master", torch.bfloat16): dict(rtol=1e-5, atol=2e-6),
    ("master", torch.float32): dict(rtol=1e-5, atol=2e-6),
    # fp32 optimizer state (moments, momentum buffers, Adagrad sums): same formulas, clip coefficient rounding
    ("state", torch.float16): dict(rtol=1e-5, atol=1e-7),
    ("state", torch.bfloat16): dict(rtol=1e-5, atol=1e-7),
    ("state", torch.float32): dict(rtol=1e-5, atol=1e-7),
    # grad norm as reported (fp32 sum in another order)
    ("grad_norm", None): dict(rtol=1e-5, atol=0.0),
}


def tol(what: str, dtype: torch.dtype | None = None) -> dict[str, float]:
    return TOLERANCES[(what, dtype)]
