"""What the FSDP2 tests of the integrations share (beside conftest.py's ``world_of_one``): sharding the oracle's
model, an overflow in the data, and bit-for-bit comparisons of shards."""

from __future__ import annotations

import math

import torch
from torch.distributed.fsdp import fully_shard

from halfprec.integrations.fsdp import trains_shards
from halfprec.optim.mesh import local

__all__ = ["assert_same_shards", "same_floats", "shard", "with_inf"]


def shard(model: torch.nn.Module, mesh=None, blocks=(0, 2)) -> torch.nn.Module:
    """fully_shard each of ``blocks``, then the root, as torchtitan does."""
    for i in blocks:
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def with_inf(batches, at: int):
    """``batches`` with an inf in the input of batch ``at``: non-finite grads, a skipped step. (A grad hook on a
    sharded param never fires: FSDP2's autograd runs on the unsharded params.)"""
    out = list(batches)
    x, y = out[at]
    x = x.clone()
    x[0, 0] = float("inf")
    out[at] = (x, y)
    return out


def same_floats(a: list, b: list) -> bool:
    """Equal, NaN included (a skipped step's norm)."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def assert_same_shards(model_a, mp_a, model_b, mp_b) -> None:
    """Local shards of the 16-bit params, masters and optimizer state identical (bit for bit)."""
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert a.dtype == b.dtype and trains_shards([a]) and trains_shards([b])
        torch.testing.assert_close(local(a), local(b), rtol=0, atol=0)
    for a, b in zip(mp_a.master_params(), mp_b.master_params(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key, value in mp_a.state[a].items():
            torch.testing.assert_close(value, mp_b.state[b][key], rtol=0, atol=0)
    assert (mp_a.loss_scale, mp_a.skipped_steps) == (mp_b.loss_scale, mp_b.skipped_steps)
