"""Split masters in registers: the ``@triton.jit`` twins of ``optim/split.py`` (read there why they are exact).

``join`` rebuilds the fp32 master from the bf16 param's and the low half's 16-bit patterns (int16 loads);
``split`` rounds an fp32 master back into the two patterns (uint32 values the caller stores as int16).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["join", "split"]


@triton.jit
def join(param_bits, low_bits):
    p = param_bits.to(tl.uint16, bitcast=True).to(tl.uint32)
    lo = low_bits.to(tl.uint16, bitcast=True).to(tl.uint32)
    high = (p - (lo >> 15)) & 0xFFFF
    return ((high << 16) | lo).to(tl.float32, bitcast=True)


@triton.jit
def split(master):
    b = master.to(tl.uint32, bitcast=True)
    high = b >> 16
    lo = b & 0xFFFF
    nan = master != master
    param = tl.where(nan, high | 0x40, high + (lo >> 15))
    lo = tl.where(nan, lo & 0x7FFF, lo)
    return param, lo
