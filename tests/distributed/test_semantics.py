"""Step/zero_grad contract of the sharded optimizer on 2 ranks, as torch (and MixedPrecisionOptimizer) define it.

SGD lr=1 on a zero weight: the weight after a step is minus the applied grad (rank grads 1 and 2, mean 1.5).
"""

from __future__ import annotations

import pytest
import torch
from _compare import assert_equal, describe
from _launch import launch, results

STEPS = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("semantics")
    launch(2, "semantics", out, steps=STEPS)
    return results(out, 2)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_step_twice_without_backward_raises(ranks, stage):
    for r in ranks:
        assert r[stage]["twice"].startswith("step() called again without a new backward()"), r[stage]["twice"]
        assert r[stage]["after_zero_grad"] == "no error"  # zero_grad() then step(): allowed ...
        assert torch.equal(
            r[stage]["w_after_zero_grad_step"], torch.full((1, 4), -1.5)
        )  # ... updates nothing


@pytest.mark.slow
def test_stage1_step_without_zero_grad_accumulates_like_torch(ranks):
    for r in ranks:
        assert r[1]["no_zero_grad"] == "no error"
        assert torch.equal(r[1]["w1"], torch.full((1, 4), -1.5))
        assert torch.equal(r[1]["w2"], torch.full((1, 4), -4.5))  # second grad: 1.5 + 1.5 accumulated


@pytest.mark.slow
def test_stage2_backward_after_step_without_zero_grad_raises(ranks):
    for r in ranks:
        assert r[2]["no_zero_grad"].startswith("ZeRO-2 reduces grads into a shard that step() consumed")
        assert torch.equal(r[2]["w2"], torch.full((1, 4), -1.5))  # nothing applied twice


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_grad_set_to_none_false_keeps_stepping_with_zero_grads(ranks, stage):
    for rank, r in enumerate(ranks):
        kz = r[stage]["keep_zero"]
        assert not torch.equal(kz["params"]["b"], kz["b_before"]), f"rank {rank}: b never moved after step 0"
        assert_equal(kz["params"], kz["oracle"], f"rank {rank}, stage {stage}: params vs torch AdamW")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_at_wrap_params(ranks, stage):
    for rank, r in enumerate(ranks):
        zeroed, cleared = r[stage]["frozen_grad_zeroed"], r[stage]["frozen_grad_cleared"]
        assert zeroed is not None, (
            f"rank {rank}: zero_grad(set_to_none=False) dropped the frozen param's grad"
        )
        assert describe(zeroed, torch.zeros_like(zeroed)) == "equal", (
            f"rank {rank}: {describe(zeroed, 0 * zeroed)}"
        )
        assert cleared is None, f"rank {rank}: zero_grad() left the frozen param's grad {cleared}"
        assert "was frozen (requires_grad=False) when the optimizer was wrapped" in r[stage]["unfrozen"]


@pytest.mark.slow
def test_overflow_at_min_scale_warns_once_on_rank_0(ranks):
    assert len(ranks[0]["min_scale_warnings"]) == 1
    assert "minimum loss scale 1" in ranks[0]["min_scale_warnings"][0]
    assert ranks[1]["min_scale_warnings"] == []
    assert all(r["min_scale_skipped"] == 2 for r in ranks)
