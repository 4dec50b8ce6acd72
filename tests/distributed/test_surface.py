"""The MixedPrecisionOptimizer-like surface of the sharded optimizer, checked inside the 2-rank launch."""

from __future__ import annotations

import pytest
from _compare import assert_equal


def _misc(runs) -> list[dict]:
    return [r["misc"] for r in runs.two()]


@pytest.mark.slow
def test_is_an_optimizer_and_schedulers_work_without_warnings(runs):
    for rank, m in enumerate(_misc(runs)):
        assert "torch.optim.optimizer.Optimizer" in m["mro"], f"rank {rank}: bases {m['mro']}"
        assert m["lr_after"] == [0.005, 0.005]
        assert m["scheduler_warnings"] == []


@pytest.mark.slow
def test_buckets_reduce_while_backward_runs(runs):
    for m in _misc(runs):
        assert m["buckets"] >= 3
        assert m["overlapped"] >= 1, m  # at least one bucket launched before backward ended
        # a param without a grad holds back its bucket and every later one, to the end of backward
        assert m["overlapped_with_unused_first"] == 0


@pytest.mark.slow
def test_stage1_grads_are_views_and_stage2_frees_them(runs):
    for rank, m in enumerate(_misc(runs)):
        offsets = m["stage1_grad_offsets"]
        assert all(o is not None and o >= 0 for o in offsets.values()), (
            f"rank {rank}: stage-1 grads must be views into the flat grad buffer; byte offsets {offsets}"
        )
        assert m["stage2_grads_kept"] == [], (
            f"rank {rank}: stage 2 left whole grads on {m['stage2_grads_kept']}"
        )
        assert "only meaningful at stage 1" in m["stage2_no_sync"]


@pytest.mark.slow
def test_wrong_order_and_fixed_layout_errors(runs):
    for m in _misc(runs):
        assert "a backward ran after unscale_()" in m["backward_after_unscale"]
        assert "fixes its flat layout" in m["add_param_group"]
        assert "a backward ran after unscale_()" in m["plain_backward_after_unscale"]


@pytest.mark.slow
def test_refresh_masters_copies_the_model_weights(runs):
    for rank, m in enumerate(_misc(runs)):
        assert_equal(
            m["refresh"]["masters"], m["refresh"]["weights"], f"rank {rank}: masters after refresh_masters"
        )


@pytest.mark.slow
def test_rank_local_state_dict_round_trip(runs):
    for rank, m in enumerate(_misc(runs)):
        assert_equal(m["round_trip"]["loaded"], m["round_trip"]["saved"], f"rank {rank}: loaded vs saved")


@pytest.mark.slow
def test_optimizer_built_from_named_parameters(runs):
    names = [n for m in _misc(runs) for g in m["param_names"] for n in g]
    assert {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "gain", "unused"} <= set(names)


@pytest.mark.slow
def test_initialize_with_zero_stage_builds_the_sharded_optimizer(runs):
    ms = _misc(runs)
    for m in ms:
        assert m["engine"]["type"] == "ShardedMixedPrecisionOptimizer"
        assert m["engine"]["dtypes"] == ["torch.bfloat16"]
        assert [r[0] for r in m["engine"]["records"]] == [1, 2]
    assert ms[0]["engine"]["records"] == ms[1]["engine"]["records"]  # same norm and decisions on every rank
