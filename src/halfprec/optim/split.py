"""Split masters: an exact fp32 master held as the model's bf16 param ``P`` plus its low 16 bits ``L``
(docs/split-masters.md).

``P`` is the master rounded to bf16 to nearest, ties away from zero: on the bit pattern, the top half ``U`` plus 1
when ``L >= 0x8000`` (the carry runs into the exponent, up to inf, by itself), so ``U`` is recovered exactly from
``P`` and ``L``; with ties to even nothing would tell which way a tie went. A NaN's ``P`` is its top half made quiet
(``| 0x40``, as the fused kernels round NaN: ``U + 1`` could carry out of the pattern) and its ``L`` loses bit 15, so
only its payload may change; every other fp32 value is kept bit for bit.

The fused kernels do the same arithmetic in registers (``kernels/update.py``); these torch functions are the
reference and serve checkpoints, which save a split master as the fp32 value it represents.
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master", "store_split"]

_LOW = 0xFFFF
_HALF = 0x8000
_QUIET = 0x40


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, L)`` of an fp32 tensor: ``P`` bf16 (rounded to nearest, ties away from zero), ``L`` int16 (the low 16
    bits of each value's pattern)."""
    if master.dtype != torch.float32:
        raise ValueError(f"split_master takes an fp32 tensor, got {master.dtype}")
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high, low = bits >> 16, bits & _LOW
    nan = master.isnan()
    param = torch.where(nan, high | _QUIET, high + (low >= _HALF).to(torch.int64))
    low = torch.where(nan, low & (_HALF - 1), low)
    return _signed(param, 16).view(torch.bfloat16), _signed(low, 16)


def store_split(master: torch.Tensor, param: torch.Tensor, low: torch.Tensor) -> None:
    """Write the split of ``master`` (any float tensor of their size) into ``param`` and ``low``."""
    high, bits = split_master(master.detach().to(low.device, torch.float32).reshape(low.shape))
    param.copy_(high)
    low.copy_(bits)


def join_master(param: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The fp32 master that ``split_master`` split into ``param`` (bf16) and ``low`` (int16)."""
    if param.dtype != torch.bfloat16 or low.dtype != torch.int16 or param.shape != low.shape:
        raise ValueError(
            f"join_master takes a bf16 param and an int16 low half of the same shape, got {param.dtype} "
            f"{tuple(param.shape)} and {low.dtype} {tuple(low.shape)}"
        )
    p = param.view(torch.int16).to(torch.int64) & _LOW
    lo = low.to(torch.int64) & _LOW
    high = (p - (lo >= _HALF).to(torch.int64)) & _LOW
    bits = (high << 16) | lo
    return _signed(bits, 32).view(torch.float32)


def _signed(values: torch.Tensor, width: int) -> torch.Tensor:
    # int64 values in [0, 2**width) to the int16 or int32 with the same bits
    wrapped = values - ((values >> (width - 1)) << width)
    return wrapped.to(torch.int16 if width == 16 else torch.int32)
