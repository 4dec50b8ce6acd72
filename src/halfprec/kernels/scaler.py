"""The dynamic loss scaler's update in Triton: the schedule of ``halfprec.scaler.DynamicLossScaler.update`` in one
program, instead of ~20 small torch ops (each a kernel launch and ~15 us of host time).

The fused step runs it inside its finalize program (``norm.finalize(..., scaler=...)``); ``dynamic_update`` is
the same update as a launch of its own. Both update the scaler's own state tensors in place; ``_dynamic_step``
is ``DynamicLossScaler.update`` op by op (which stays the reference).

Products are fp32, as torch computes a 0-d fp32 tensor times a Python float. ``fusable`` takes only
configurations in which no fp32 subnormal can decide a result (``min_scale`` a normal fp32, the factors within
2**64 of 1), so the result does not depend on whether a GPU flushes subnormals (the sm_90 code does not: plain
``mul.f32``). A state loaded by hand with a scale below 2**-126 is outside that promise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scaler import DynamicLossScaler, LossScaler
from .launch import launch

__all__ = ["fusable", "scaler_args", "dynamic_update"]

_FP32_TINY = 2.0**-126  # smallest normal fp32
_FACTOR_RANGE = 2.0**64


@triton.jit
def _dynamic_step(
    found, scale, tracker, left, scale_ptr, tracker_ptr, left_ptr,
    growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
):  # fmt: skip
    # Stores the state after one step (``scale``, ``tracker``, ``left``: the state loaded before it) and returns
    # the new scale. Triton makes a scalar store from one thread, which computed it from its own loads, so
    # warps that load after that store cannot race it.
    overflow = found > 0.0
    tracker_next = tl.where(overflow, 0, tracker + 1)
    grow = tracker_next >= growth_interval
    left_after_overflow = left - 1
    backoff = overflow & (left_after_overflow <= 0)
    grown = scale * growth_factor
    grown = tl.where((grown - grown) == 0.0, grown, scale)  # not finite: keep the scale
    backed_off = scale * backoff_factor
    # clamp(min=), NaN passes as in torch
    backed_off = tl.where(backed_off < min_scale, min_scale, backed_off)
    new_scale = tl.where(backoff, backed_off, tl.where(grow, grown, scale))
    refill = backoff | grow
    new_left = tl.where(refill, hysteresis, tl.where(overflow, left_after_overflow, left))
    new_tracker = tl.where(grow, 0, tracker_next)
    tl.store(scale_ptr, new_scale.to(tl.float32))
    tl.store(tracker_ptr, new_tracker.to(tl.int64))
    tl.store(left_ptr, new_left.to(tl.int64))
    return new_scale


@triton.jit
def _dynamic_update_kernel(
    found_ptr, scale_ptr, tracker_ptr, left_ptr,
    growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
):  # fmt: skip
    found = tl.load(found_ptr).to(tl.float32)
    scale = tl.load(scale_ptr)
    tracker = tl.load(tracker_ptr)
    left = tl.load(left_ptr)
    _dynamic_step(
        found, scale, tracker, left, scale_ptr, tracker_ptr, left_ptr,
        growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
    )  # fmt: skip


def fusable(scaler: LossScaler, device: torch.device | str) -> bool:
    """True when ``scaler``'s update can run in Triton on ``device``: a ``DynamicLossScaler`` whose ``update`` is
    not overridden, with its state in the expected dtypes on ``device`` and a configuration free of fp32
    subnormals and overflowing factors (anything else keeps ``scaler.update``, the torch ops)."""
    if not isinstance(scaler, DynamicLossScaler) or type(scaler).update is not DynamicLossScaler.update:
        return False
    state = scaler.state_tensors
    try:
        scale, tracker, left = state["scale"], state["growth_tracker"], state["hysteresis_left"]
    except KeyError:
        return False
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" is the current device, as for tensors
        device = torch.device("cuda", torch.cuda.current_device())
    for t, dtype in ((scale, torch.float32), (tracker, torch.int64), (left, torch.int64)):
        if t.dtype != dtype or t.device != device or t.dim() != 0:
            return False
    gf, bf, ms = float(scaler.growth_factor), float(scaler.backoff_factor), float(scaler.min_scale)
    return (
        1.0 < gf <= _FACTOR_RANGE
        and 1.0 / _FACTOR_RANGE <= bf < 1.0
        and _FP32_TINY <= ms <= 2.0**127
        and abs(int(scaler.growth_interval)) < 2**62
        and abs(int(scaler.hysteresis)) < 2**62
    )


def scaler_args(scaler: DynamicLossScaler) -> tuple:
    """``(tracker, left, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale)`` kernel args,
    read from the scaler at every step (``load_state_dict`` may change the configuration)."""
    state = scaler.state_tensors
    return (
        state["growth_tracker"], state["hysteresis_left"],
        float(scaler.growth_factor), float(scaler.backoff_factor), int(scaler.growth_interval),
        int(scaler.hysteresis), float(scaler.min_scale),
    )  # fmt: skip


def dynamic_update(scaler: DynamicLossScaler, found_inf: torch.Tensor) -> None:
    """``scaler.update(found_inf)`` in one launch (no host sync); ``found_inf`` a 0-d float tensor on the
    state's device. Raises ValueError when ``fusable`` is false (call ``scaler.update`` then)."""
    scale = scaler.scale
    if not fusable(scaler, scale.device):
        raise ValueError(
            f"{scaler!r} cannot be updated by the Triton kernel (see halfprec.kernels.scaler.fusable); "
            "call scaler.update(found_inf)"
        )
    if found_inf.device != scale.device or found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must be a one-element tensor on {scale.device}, got shape {tuple(found_inf.shape)} "
            f"on {found_inf.device}"
        )
    launch(_dynamic_update_kernel, (1,), found_inf, scale, *scaler_args(scaler), num_warps=1)
