"""Split masters (optim/split.py): the bf16 param and the low 16 bits give back the fp32 master bit for bit.

Exhaustive over the low half for a sample of top halves (every exponent, both signs, the edges), and over every
top half for the low halves around the rounding point.
"""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.split import join_master, split_master

# top halves: the edges (signed zeros, the smallest and largest subnormals and normals, the largest finite,
# infinities, NaNs, all-ones patterns) and every exponent of both signs with a mantissa that varies
_EDGES = [0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x7F7E, 0x7F7F, 0x7F80, 0x7F81, 0x7FBF, 0x7FC0, 0x7FFF]
_TOPS = sorted(
    {
        *_EDGES,
        *(t | 0x8000 for t in _EDGES),
        *((e << 7) | (e * 37 % 128) | ((e & 1) << 15) for e in range(256)),
    }
)
_LOWS_AT_ROUNDING = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF]


def _floats(tops: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    bits = (tops[:, None].to(torch.int64) << 16) | lows[None, :].to(torch.int64)
    bits = bits - ((bits >> 31) << 32)
    return bits.flatten().to(torch.int32).view(torch.float32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)


@pytest.mark.parametrize(
    "tops, lows",
    [
        (torch.tensor(_TOPS), torch.arange(1 << 16)),
        (torch.arange(1 << 16), torch.tensor(_LOWS_AT_ROUNDING)),
    ],
    ids=["every-low-half", "every-top-half"],
)
def test_join_gives_back_the_master(tops, lows):
    master = _floats(tops, lows)
    param, low = split_master(master)
    assert param.dtype == torch.bfloat16 and low.dtype == torch.int16
    back = join_master(param, low)
    nan = master.isnan()
    assert torch.equal(_bits(back)[~nan], _bits(master)[~nan])
    # a NaN stays a NaN of the same sign (its payload may change)
    assert back[nan].isnan().all()
    assert torch.equal(back[nan].signbit(), master[nan].signbit())


@pytest.mark.parametrize(
    "tops, lows",
    [(torch.tensor(_TOPS), torch.arange(1 << 16)), (torch.arange(1 << 16), torch.tensor(_LOWS_AT_ROUNDING))],
    ids=["every-low-half", "every-top-half"],
)
def test_param_is_round_to_nearest_ties_away(tops, lows):
    master = _floats(tops, lows)
    finite = ~master.isnan()
    param, _ = split_master(master)
    nearest_even = master.to(torch.bfloat16)
    bits = master.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    top_even_tie = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)
    same = finite & ~top_even_tie
    assert torch.equal(_bits(param)[same], _bits(nearest_even)[same])
    # on a tie with an even top half, ties away from zero rounds one ulp further from zero than ties to even
    tie = finite & top_even_tie
    assert tie.any()
    assert torch.equal(_bits(param)[tie].to(torch.int32), _bits(nearest_even)[tie].to(torch.int32) + 1)
    assert torch.equal(
        param[tie].float().abs() > master[tie].abs(), torch.ones_like(param[tie], dtype=torch.bool)
    )


def test_nan_param_is_quiet():
    master = torch.tensor([0x7F808000, 0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32)  # NaNs
    param, low = split_master(master)
    assert param.isnan().all()
    assert join_master(param, low).isnan().all()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: split_master(torch.zeros(3, dtype=torch.float16)), "split_master takes an fp32 tensor"),
        (lambda: join_master(torch.zeros(3), torch.zeros(3, dtype=torch.int16)), "takes a bf16 param"),
        (
            lambda: join_master(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16)),
            "of the same shape",
        ),
    ],
)
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
