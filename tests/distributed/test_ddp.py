"""ZeRO-0: MixedPrecisionOptimizer over DistributedDataParallel, on 2 real gloo processes.

The oracle computes each rank's 16-bit grads in one process and averages them as DDP does (each divided by
the world size in the param dtype, then summed in rank order), so the comparison is bit-exact.
"""

from __future__ import annotations

import pytest
import torch
from _compare import assert_equal, assert_same, assert_steps, describe

from conftest import DDP2, STEPS


@pytest.mark.slow
def test_ddp_matches_oracle_bit_exact_with_clipping_accumulation_and_overflow(runs):
    ranks = runs.two()
    for i, cfg in enumerate(DDP2):
        oracle = ranks[0]["ddp"][i]["oracle"]
        for r, rank in enumerate(ranks):
            got, where = rank["ddp"][i], f"rank {r}, {cfg}"
            assert_same(got["masters"], got["state"], oracle, where=where)
            assert_equal(got["params"], oracle["params"], f"{where}: 16-bit params")
            assert_steps(got["trace"]["skipped"], oracle["skipped"], "skipped", where)
            assert_steps(got["trace"]["scales"], oracle["scales"], "loss scale", where)
            # DDP's averaged grads reach the same MixedPrecisionOptimizer arithmetic: the norms are equal too
            norms, ref = torch.tensor(got["trace"]["norms"]), torch.tensor(oracle["norms"])
            assert describe(norms, ref) == "equal", f"{where}: grad norms per step: {describe(norms, ref)}"


@pytest.mark.slow
def test_ddp_overflow_on_one_rank_skips_on_every_rank(runs):
    ranks = runs.two()
    i = next(i for i, c in enumerate(DDP2) if c.get("poison"))
    poisoned_step = DDP2[i]["poison"][0][0]
    expected = [s == poisoned_step for s in range(STEPS)]
    for r, rank in enumerate(ranks):
        assert_steps(rank["ddp"][i]["trace"]["skipped"], expected, "skipped", f"rank {r}")
        assert rank["ddp"][i]["skipped_steps"] == 1, (
            f"rank {r}: skipped_steps {rank['ddp'][i]['skipped_steps']}"
        )
    # the skip changed the scale identically everywhere (hysteresis=1: one backoff)
    assert_steps(
        ranks[1]["ddp"][i]["trace"]["scales"], ranks[0]["ddp"][i]["trace"]["scales"], "scale", "rank 1 vs 0"
    )


@pytest.mark.slow
def test_ddp_unused_param_gets_no_state(runs):
    # DDP (find_unused_parameters=True) leaves grads of params unused on every rank as None: no update
    for r, rank in enumerate(runs.two()):
        for i in range(len(DDP2)):
            assert "unused" not in rank["ddp"][i]["state"], (
                f"rank {r}, {DDP2[i]}: {rank['ddp'][i]['state']['unused']}"
            )
