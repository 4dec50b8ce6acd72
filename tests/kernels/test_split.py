"""The kernels' split-master helpers (kernels/split.py) against the torch reference (optim/split.py), in the
interpreter on CPU and on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from halfprec.kernels.split import join, split
from halfprec.optim.split import join_master, split_master

# the interpreter on CPU (tests/conftest.py), the compiled kernel where there is a GPU
_DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else ["cpu"]


@triton.jit
def _roundtrip(master_ptr, param_ptr, low_ptr, joined_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    param, low = split(tl.load(master_ptr + offs, mask=mask, other=0.0))
    tl.store(param_ptr + offs, param.to(tl.int16), mask=mask)
    tl.store(low_ptr + offs, low.to(tl.int16), mask=mask)
    p = tl.load(param_ptr + offs, mask=mask, other=0)
    lo = tl.load(low_ptr + offs, mask=mask, other=0)
    tl.store(joined_ptr + offs, join(p, lo), mask=mask)


def _sample(device: str) -> torch.Tensor:
    # every top half with the low halves around the rounding point, and random patterns
    tops = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    edge = ((tops[:, None] << 16) | lows[None, :]).flatten()
    rand = torch.randint(
        0, 1 << 32, (1 << 16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64
    )
    bits = torch.cat([edge, rand])
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32).to(device)


@pytest.mark.parametrize("device", _DEVICES)
def test_kernel_split_and_join_match_the_reference(device):
    master = _sample(device)
    n = master.numel()
    param = torch.empty(n, dtype=torch.int16, device=device)
    low = torch.empty_like(param)
    joined = torch.empty_like(master)
    _roundtrip[(triton.cdiv(n, 1024),)](master, param, low, joined, n, BLOCK=1024)
    ref_param, ref_low = split_master(master.cpu())
    assert torch.equal(param.cpu(), ref_param.view(torch.int16))
    assert torch.equal(low.cpu(), ref_low)
    assert torch.equal(joined.cpu().view(torch.int32), join_master(ref_param, ref_low).view(torch.int32))
