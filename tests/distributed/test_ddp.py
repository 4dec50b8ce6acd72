"""ZeRO-0: MixedPrecisionOptimizer over DistributedDataParallel, on 2 real gloo processes.

The oracle computes each rank's 16-bit grads in one process and averages them as DDP does (each divided by
the world size in the param dtype, then summed in rank order), so the comparison is bit-exact.
"""

from __future__ import annotations

import torch
from _compare import assert_same

from conftest import DDP2, STEPS


def test_ddp_matches_oracle_bit_exact_with_clipping_accumulation_and_overflow(runs):
    ranks = runs.two()
    for i, cfg in enumerate(DDP2):
        oracle = ranks[0]["ddp"][i]["oracle"]
        for rank in ranks:
            got = rank["ddp"][i]
            assert_same(got["masters"], got["state"], oracle)
            for name, ref in oracle["params"].items():
                assert torch.equal(got["params"][name], ref), (cfg, name)
            assert got["trace"]["skipped"] == oracle["skipped"], cfg
            assert got["trace"]["scales"] == oracle["scales"], cfg
            # DDP's averaged grads reach the same MixedPrecisionOptimizer arithmetic: the norms are equal too
            assert _nan_equal(got["trace"]["norms"], oracle["norms"]), cfg


def test_ddp_overflow_on_one_rank_skips_on_every_rank(runs):
    ranks = runs.two()
    i = next(i for i, c in enumerate(DDP2) if c.get("poison"))
    poisoned_step = DDP2[i]["poison"][0][0]
    expected = [s == poisoned_step for s in range(STEPS)]
    for rank in ranks:
        assert rank["ddp"][i]["trace"]["skipped"] == expected
        assert rank["ddp"][i]["skipped_steps"] == 1
    # the skip changed the scale identically everywhere (hysteresis=1: one backoff)
    assert ranks[0]["ddp"][i]["trace"]["scales"] == ranks[1]["ddp"][i]["trace"]["scales"]


def test_ddp_unused_param_gets_no_state(runs):
    # DDP (find_unused_parameters=True) leaves grads of params unused on every rank as None: no update
    for rank in runs.two():
        for i in range(len(DDP2)):
            assert "unused" not in rank["ddp"][i]["state"]


def _nan_equal(a: list, b: list) -> bool:
    return torch.equal(torch.tensor(a).nan_to_num(1e30), torch.tensor(b).nan_to_num(1e30))
