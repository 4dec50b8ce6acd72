"""Split masters: an exact fp32 master held as the model's bf16 param ``P`` plus its low 16 bits ``L``.

An fp32 bit pattern is a top half ``U`` (a bf16 bit pattern) and a low half ``L``. ``P`` is the master rounded to
bf16 to nearest with ties away from zero, which on the bit pattern is ``U + 1`` when ``L >= 0x8000`` and ``U``
otherwise (sign-magnitude: adding 1 to the pattern grows the magnitude, and the carry runs from the mantissa into
the exponent, up to inf, by itself). So ``U`` is recovered exactly: ``P - 1`` when ``L >= 0x8000``, else ``P``.
Ties to even cannot be used: with ``L == 0x8000`` an even ``P`` is either ``U`` kept (``U`` even) or ``U + 1``
(``U`` odd), and nothing in ``P`` and ``L`` tells which; a 17th bit would. ``P`` differs from the usual
round-to-nearest-even cast only on those ties with an even ``U`` (one ulp up instead of down).

NaN masters: ``P + 1`` could carry out of the pattern (``0x7FFF`` becomes ``-0.0``), so a NaN's ``P`` is its top
half made quiet (``| 0x40``, as the fused kernels round NaN today) and its ``L`` loses bit 15; the master stays
a NaN with the same sign, only its payload may change. Every other fp32 value, infinities, signed zeros and
subnormals included, is kept bit for bit.

The fused kernels do the same arithmetic in registers (``kernels/update.py``); these torch functions are the
reference and serve checkpoints, which save a split master as the fp32 value it represents.
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master"]

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
