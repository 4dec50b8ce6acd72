"""Every numeric tolerance of the test suite, one commented row each: what is compared, and what rounding the
value covers. Bit-exact comparisons (``torch.equal``, ``==``) are not here: they stay exact.

Rows are ``(name, dtype)``; ``dtype`` is the model's param dtype where the bound depends on it, else ``None``.
``tol(name, dtype)`` gives the ``dict(rtol=..., atol=...)`` for ``torch.testing.assert_close``; ``approx`` wraps
the same row for ``pytest.approx``.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["TOLERANCES", "approx", "tol"]

_LOW_AND_FP32 = (torch.float16, torch.bfloat16, torch.float32)

TOLERANCES: dict[tuple[str, torch.dtype | None], dict[str, float]] = {
    # --- the fused (Triton) path against the exact torch path, same grads, scaler and clipping, a few steps.
    # Not bit-exact: the global norm is summed in another order (per-block partials vs per-tensor norms), so the
    # clip coefficient can differ in its last bit; the GPU contracts multiply-adds into FMAs; addcdiv is
    # evaluated as p - s * (m / d). Step counters, skips and scales are exact (``==``); the 16-bit params are the
    # masters rounded to nearest even (checked bitwise).
    # fp32 masters: a few fp32 ulps per step, relative to |p| ~ 1 (measured max diff 1.2e-7 after 3 steps)
    **{("fused_master", d): dict(rtol=1e-5, atol=2e-6) for d in _LOW_AND_FP32},
    # fp32 optimizer state (moments, momentum buffers, Adagrad sums): same formulas, clip coefficient rounding
    **{("fused_state", d): dict(rtol=1e-5, atol=1e-7) for d in _LOW_AND_FP32},
    # the fused sharded step on CUDA against the exact unsharded run: max abs diff over all masters / moments
    # (tests/distributed/test_gpu.py); the fused_master / fused_state rows at |p| <= ~2 and |m| <= ~0.1
    ("fused_cuda_master_max_abs", None): dict(rtol=0.0, atol=2e-5),
    ("fused_cuda_state_max_abs", None): dict(rtol=0.0, atol=1e-6),
    # a 16-bit param rounded from masters that differ within fused_master lands at most one 16-bit ulp away:
    # fp16's ulp is 2^-10 ~ 9.8e-4 relative; atol for values near zero
    ("fused_param_neighbour", torch.float16): dict(rtol=1e-3, atol=1e-5),
    # engine losses, fused vs torch: the forward runs on such 16-bit params (one ulp apart), so an fp16 loss
    # moves by about one fp16 ulp (~1e-3 relative) after the first step
    ("fused_engine_loss", torch.float16): dict(rtol=1e-3, atol=1e-4),
    # --- grad norms
    # the global grad norm in fp32, summed in another order (blocks vs per-tensor norms, shards vs params)
    ("grad_norm", None): dict(rtol=1e-5, atol=0.0),
    # the norm after torch's clip_grad_norm_(max_norm): it multiplies by max_norm / (n + 1e-6), so the result is
    # below max_norm by max_norm * 1e-6 / n < 1e-6 (n > max_norm), plus a few fp32 ulps
    ("clipped_norm", None): dict(rtol=0.0, atol=1e-6),
    # --- ZeRO (tests/distributed/test_sharded.py): sharded run against the one-process oracle
    # 2 ranks with clipping: the norm (per-shard squares in fp64 vs torch's norm of per-param norms) differs in
    # its last fp32 bits, so does the clip coefficient and every clipped update (lr 1e-2)
    ("sharded_clipped_master", None): dict(rtol=1e-4, atol=1e-5),
    # 2 ranks: the sum of two numbers does not depend on order; only the norm's own summation order differs
    ("sharded_norm", None): dict(rtol=1e-6, atol=0.0),
    # 3-4 ranks: gloo sums in its own order. Measured (torch 2.13 CPU gloo, 4 steps): fp32 communication came out
    # bit-exact; fp16 communication at 3 ranks (each grad divided by 3 in fp16, summed in fp16) differed by at
    # most 1.3e-5 absolute, 1.2e-3 relative. The bound is ~10x that, still far below one update (lr 1e-2).
    ("sharded_reordered", None): dict(rtol=1e-2, atol=1e-4),
    # the norm of those reordered fp16 sums: fp16 rounding of the summands (~1e-3 relative)
    ("sharded_reordered_norm", None): dict(rtol=1e-3, atol=0.0),
    # --- FSDP2 against one process on the same global batch (tests/distributed/test_fsdp_global.py)
    # bf16 grads reduced in another order. Elementwise, atol in units of sum_r |P_r|, P_r being rank r's share of
    # the grad (the backward over its slice, divided by W; the oracle computes them). One process sums all rows'
    # products at once (fp32 accumulation, one rounding to bf16: at most 2^-8 of |grad| <= sum_r |P_r|); each of W
    # ranks rounds its P_r to bf16 (2^-8 |P_r|), and FSDP2's reduce-scatter averages the W partials in bf16 (W - 1
    # more roundings of running sums, each at most 2^-8 sum_r |P_r|; the division by W is exact). So the two
    # differ by at most (W + 1) * 2^-8 sum_r |P_r|: 3 * 2^-8 at 2 ranks, 5 * 2^-8 at 4. Measured (4-6 steps of a
    # 5-7-9-1 MLP, 3 rows per rank, 2 and 4 ranks): at most 2.0 * 2^-8. The bound, 2^-5 = 8 * 2^-8, leaves room
    # for per-row products computed by matmuls of another batch size (fp32 accumulation in another order). A grad
    # summed instead of averaged, or a rank's rows missing, is off by ~2^-1 or more. Relative to |grad| there is no
    # bound: a grad whose partials cancel keeps their rounding error (seen: 0.09 |grad| on a one-element bias).
    ("fsdp_reduced_grad", torch.bfloat16): dict(rtol=0.0, atol=2.0**-5),
    # --- low precision against fp32
    # an fp16 forward (demo GPT, fp16 weights and activations) against the fp32 one: ~1e-3 relative rounding
    # per op, a few ops deep
    ("fp16_forward", torch.float16): dict(rtol=2e-2, atol=2e-2),
    # fp16 grads of a loss scaled by 16 against 16 x the unscaled grads: the power-of-two scale is exact except
    # where unscaled intermediates fall into fp16 subnormals (< 6.1e-5, losing bits): a few fp16 ulps relative,
    # the subnormal spacing x 16 absolute
    ("fp16_scaled_backward", torch.float16): dict(rtol=1e-2, atol=1e-3),
    # --- schedules
    # learning rates from a float64 schedule (0.01 * 0.9 * 0.9): a few float64 ulps
    ("lr_schedule", None): dict(rtol=1e-12, atol=0.0),
}


def tol(name: str, dtype: torch.dtype | None = None) -> dict[str, float]:
    """The ``dict(rtol=..., atol=...)`` row ``(name, dtype)`` for ``torch.testing.assert_close``."""
    try:
        return TOLERANCES[(name, dtype)]
    except KeyError:
        known = sorted({f"{n}/{d}" for n, d in TOLERANCES})
        raise KeyError(f"no tolerance row ({name!r}, {dtype}); tests/tolerances.py has {known}") from None


def approx(expected, name: str, dtype: torch.dtype | None = None):
    """``pytest.approx(expected)`` with the row's bounds."""
    row = tol(name, dtype)
    return pytest.approx(expected, rel=row["rtol"], abs=row["atol"])
