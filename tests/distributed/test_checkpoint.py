"""DCP checkpoints in model space: reshard 2 -> 1, 3, 4 and back, the unsharded optimizer, atomic saves.

A checkpoint saved at world size 2 (``A``) is loaded into fresh sharded optimizers at 3, 4 and 1 ranks
and saved again (``C``, ``D``, ``E``): every item of every checkpoint must equal ``A`` bit for bit. Then ``C``
(written by 3 ranks) is loaded at 2 ranks and training continues: it must equal the run that continued from
``A`` without stopping.
"""

from __future__ import annotations

import pytest
import torch
from _compare import stitch
from _launch import launch

from conftest import CKPT
from halfprec.distributed import consolidate, read_checkpoint


def _assert_same_checkpoint(a, b) -> None:
    items_a, items_b = read_checkpoint(a), read_checkpoint(b)
    assert sorted(items_a) == sorted(items_b)
    for key, value in items_a.items():
        assert value.dtype == items_b[key].dtype, key
        assert torch.equal(value, items_b[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4, 1])
def test_reshard_from_two_ranks_is_bit_identical(runs, world):
    ranks = {3: runs.three, 4: runs.four, 1: runs.one}[world]()
    target = {3: "C", 4: "D", 1: "E"}[world]
    for i in range(len(CKPT)):
        _assert_same_checkpoint(runs.root / f"A{i}", runs.root / f"{target}{i}")
        # state was complete after load on every rank that holds a piece (no silently missing moments)
        assert all(r["ckpt_reshard"][i]["complete"] for r in ranks)
    if world > 1:
        # some rank owns no element of some param group: loading and saving must still agree
        assert any(0 in r["ckpt_reshard"][0]["groups_held"] for r in ranks)


@pytest.mark.slow
def test_checkpoint_contents(runs):
    runs.two()
    items = read_checkpoint(runs.root / "A0")
    assert int(items["counters/skipped_steps"]) == 1  # CKPT[0] poisons one step
    assert items["master/fc1.weight"].shape == (7 * 13,) and items["master/fc1.weight"].dtype == torch.float32
    assert items["state/fc1.weight/exp_avg"].shape == (7 * 13,)
    assert items["state/fc1.weight/step"].dim() == 0
    assert "master/frozen" not in items
    assert "state/unused/exp_avg" not in items  # never got a grad: no state saved, none invented on load
    weights = consolidate(runs.root / "A0")
    assert weights["fc1.weight"].shape == (13, 7) and weights["gain"].shape == ()


@pytest.mark.slow
def test_back_to_two_ranks_resumes_bit_exactly(runs):
    cont = runs.two()
    resumed = runs.back()
    for i in range(len(CKPT)):
        want_m, want_s = stitch([r["ckpt_save"][i]["pieces"] for r in cont])
        got_m, got_s = stitch([r["ckpt_reshard"][i]["pieces"] for r in resumed])
        assert sorted(want_m) == sorted(got_m)
        for name in want_m:
            assert torch.equal(want_m[name], got_m[name]), name
            for key in want_s.get(name, {}):
                assert torch.equal(want_s[name][key], got_s[name][key]), (name, key)
        for name, value in cont[0]["ckpt_save"][i]["params"].items():
            assert torch.equal(value, resumed[1]["ckpt_reshard"][i]["params"][name]), name


@pytest.mark.slow
def test_rank_dying_mid_save_leaves_previous_checkpoint(tmp_path):
    cfg = dict(CKPT[0], poison=[])
    codes = launch(2, "ckpt_die", tmp_path, cfg=cfg, expect_ok=False, timeout=120)
    assert codes[1] == 3 and codes[0] != 0, codes
    ck = tmp_path / "ck"
    assert (ck / ".metadata").is_file()
    assert not (tmp_path / "ck.tmp" / ".metadata").exists()  # the interrupted save never committed
    first = [torch.load(tmp_path / f"first-{r}.pt", weights_only=True) for r in range(2)]
    masters, _ = stitch(first)
    weights = consolidate(ck)
    for name, value in masters.items():
        assert torch.equal(weights[name].reshape(-1), value), name


@pytest.mark.slow
def test_mixed_precision_optimizer_round_trip_and_load_from_sharded(runs, tmp_path):
    """The unsharded optimizer loads a 2-rank checkpoint (no process group) and saves the same items."""
    import _worker  # the model and optimizer factories

    from halfprec import MixedPrecisionOptimizer
    from halfprec.distributed import checkpoint

    runs.two()
    for i, cfg in enumerate(CKPT):
        model = _worker.make_model(_worker.DTYPES[cfg["dtype"]])
        mp = MixedPrecisionOptimizer(
            _worker.make_optimizer(model, cfg["opt"]), loss_scaler=_worker.make_scaler(cfg)
        )
        checkpoint.load(mp, runs.root / f"A{i}", named_parameters=model)
        checkpoint.save(mp, tmp_path / f"M{i}", named_parameters=model)
        _assert_same_checkpoint(runs.root / f"A{i}", tmp_path / f"M{i}")
        weights = consolidate(tmp_path / f"M{i}")
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert torch.equal(p.detach(), weights[name].to(p.dtype)), name
        assert mp.skipped_steps == int(read_checkpoint(tmp_path / f"M{i}")["counters/skipped_steps"])


@pytest.mark.slow
def test_export_writes_the_consolidated_fp32_weights(runs, tmp_path):
    from safetensors.torch import load_file

    import halfprec.distributed
    from halfprec.checkpoint.export import export

    runs.two()
    assert callable(halfprec.distributed.consolidate)  # not shadowed by a submodule of the same name
    export(runs.root / "A0", tmp_path / "w.safetensors")
    written = load_file(str(tmp_path / "w.safetensors"))
    weights = consolidate(runs.root / "A0")
    assert sorted(written) == sorted(weights)
    for name, value in weights.items():
        assert written[name].dtype == torch.float32 and torch.equal(written[name], value), name


def test_a_process_group_other_than_the_optimizers_own_is_refused(tmp_path):
    # ZeRO-0's optimizer reduces over its own group: a save or load on another would mix ranks' views
    import torch.distributed as dist
    from _launch import one_process_group

    import halfprec
    from halfprec.distributed import checkpoint

    with one_process_group("gloo", tmp_path / "store"):
        model = torch.nn.Linear(5, 3).bfloat16()
        mp = halfprec.MixedPrecisionOptimizer(
            torch.optim.AdamW(model.parameters()),
            grad_accum_dtype="fp32",
            process_group=dist.group.WORLD,
        )
        other = dist.new_group([0])
        for call in (checkpoint.save, checkpoint.load):
            with pytest.raises(ValueError, match="differs from the optimizer's own process_group"):
                call(mp, tmp_path / "ckpt", named_parameters=model, process_group=other)
        assert not (tmp_path / "ckpt").exists()
        checkpoint.save(mp, tmp_path / "ckpt", named_parameters=model, process_group=dist.group.WORLD)
        checkpoint.load(mp, tmp_path / "ckpt", named_parameters=model)
