"""``halfprec.distributed.checkpoint`` loads that apply completely or change nothing, refuse another optimizer's
state, and take every ``MixedPrecisionOptimizer`` (exact, fused, sharded).

The fused optimizer runs on CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py).
"""

from __future__ import annotations

import re

import pytest
import torch
from tests.test_engine_load import assert_refused_unchanged, assert_same_tree, copy_tree, engine_snapshot

from halfprec import MixedPrecisionOptimizer
from halfprec.checkpoint.manifest import CheckpointError
from halfprec.distributed import ShardedMixedPrecisionOptimizer, checkpoint


def _model(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 5, generator=gen).to(next(model.parameters()).dtype)
        opt.backward(model(x).float().square().mean())
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt):
    """Every tensor and counter a load could change: weights, the optimizer's state dict (masters, state,
    groups, scaler, skipped steps)."""
    sharded = isinstance(opt, ShardedMixedPrecisionOptimizer)
    return copy_tree(
        {
            "weights": model.state_dict(),
            "optimizer": opt.state_dict(),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "masters": [opt.flat_master] if sharded else opt.master_params(),
            "skipped": opt.skipped_steps,
        }
    )


# --- the fused optimizer --------------------------------------------------------------------------------------
def _fused(model):
    opt = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), impl="triton"
    )
    assert isinstance(opt, MixedPrecisionOptimizer) and opt.impl == "triton"
    return opt


@pytest.mark.parametrize("first", [0, 3])
def test_fused_optimizer_round_trip_resumes_bit_for_bit(tmp_path, first):
    model = _model()
    opt = _fused(model)
    _train(model, opt, first)
    checkpoint.save(opt, tmp_path / "ck", named_parameters=model)
    _train(model, opt, 2, start=first)

    resumed_model = _model(seed=1)  # other weights: everything must come from the checkpoint
    resumed = _fused(resumed_model)
    checkpoint.load(resumed, tmp_path / "ck", named_parameters=resumed_model)
    _train(resumed_model, resumed, 2, start=first)
    assert_same_tree(_snapshot(model, opt), _snapshot(resumed_model, resumed))


def test_fused_and_exact_checkpoints_load_into_each_other(tmp_path):
    model = _model()
    exact = MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), impl="torch"
    )
    _train(model, exact, 2)
    checkpoint.save(exact, tmp_path / "exact", named_parameters=model)
    fused_model = _model(seed=1)
    fused = _fused(fused_model)
    checkpoint.load(fused, tmp_path / "exact", named_parameters=fused_model)
    assert_same_tree(model.state_dict(), fused_model.state_dict())
    checkpoint.save(fused, tmp_path / "fused", named_parameters=fused_model)
    back_model = _model(seed=2)
    back = MixedPrecisionOptimizer(
        torch.optim.AdamW(back_model.parameters(), lr=1e-2, weight_decay=0.1), impl="torch"
    )
    checkpoint.load(back, tmp_path / "fused", named_parameters=back_model)
    assert_same_tree(_snapshot(model, exact), _snapshot(back_model, back))


# --- failed loads change nothing ----------------------------------------------------------------------------
def _two_groups(model, cls=torch.optim.AdamW, **kw):
    first, second = list(model[0].parameters()), list(model[2].parameters())
    return cls([{"params": first}, {"params": second, "lr": 1e-3}], lr=1e-2, **kw)


@pytest.mark.parametrize("sharded", [False, True])
def test_load_of_another_group_layout_changes_nothing(tmp_path, request, sharded):
    def build(model, params):
        if sharded:
            return ShardedMixedPrecisionOptimizer(params, named_parameters=model)
        return MixedPrecisionOptimizer(params)

    if sharded:
        request.getfixturevalue("one_rank")
    dtype = torch.bfloat16 if sharded else torch.float16
    model = _model(dtype)
    opt = build(model, _two_groups(model))
    _train(model, opt, 2)
    checkpoint.save(opt, tmp_path / "ck", named_parameters=model)

    other = _model(dtype, seed=1)
    one_group = build(other, torch.optim.AdamW(other.parameters(), lr=1e-2))
    _train(other, one_group, 1)
    assert_refused_unchanged(
        lambda: _snapshot(other, one_group),
        lambda: checkpoint.load(one_group, tmp_path / "ck", named_parameters=other),
        ValueError,
        "2 param groups, this optimizer 1",
    )


def test_a_bad_counter_is_refused_before_any_write(tmp_path):
    model = _model()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, 2)
    checkpoint.save(opt, tmp_path / "ck", named_parameters=model)
    items = checkpoint_items(tmp_path / "ck")
    items["counters/skipped_steps"] = torch.tensor(-1, dtype=torch.int64)
    rewrite(tmp_path / "ck", items)

    other = _model(seed=1)
    fresh = MixedPrecisionOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-2))
    assert_refused_unchanged(
        lambda: _snapshot(other, fresh),
        lambda: checkpoint.load(fresh, tmp_path / "ck", named_parameters=other),
        ValueError,
        "skipped_steps",
    )


def checkpoint_items(path):
    from halfprec.distributed import read_checkpoint

    return read_checkpoint(path)


def rewrite(path, items) -> None:
    """Write ``items`` as the checkpoint at ``path`` (plain DCP save, re-sealed as someone editing it would)."""
    import shutil
    import warnings

    import torch.distributed.checkpoint as dcp

    from halfprec.checkpoint.dcp import seal

    shutil.rmtree(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(items, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    seal(path, path.name)


# --- another optimizer's checkpoint ---------------------------------------------------------------------------
@pytest.mark.parametrize("other", [torch.optim.SGD, torch.optim.Adagrad])
def test_another_optimizers_checkpoint_is_refused_naming_both(tmp_path, other):
    model = _model()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, 2)
    checkpoint.save(opt, tmp_path / "ck", named_parameters=model)

    fresh_model = _model(seed=1)
    fresh = MixedPrecisionOptimizer(other(fresh_model.parameters(), lr=1e-2))
    assert_refused_unchanged(
        lambda: _snapshot(fresh_model, fresh),
        lambda: checkpoint.load(fresh, tmp_path / "ck", named_parameters=fresh_model),
        ValueError,
        rf"saved by AdamW, this optimizer is {other.__name__}",
    )


def test_another_optimizers_checkpoint_without_the_record_is_refused(tmp_path):
    """Checkpoints written before the optimizer's name was recorded: told apart by their hyper-parameters."""
    model = _model()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(model, opt, 2)
    checkpoint.save(opt, tmp_path / "ck", named_parameters=model)
    items = {k: v for k, v in checkpoint_items(tmp_path / "ck").items() if not k.startswith("kind/")}
    rewrite(tmp_path / "ck", items)

    same_model = _model(seed=1)
    same = MixedPrecisionOptimizer(torch.optim.AdamW(same_model.parameters(), lr=1e-2))
    checkpoint.load(same, tmp_path / "ck", named_parameters=same_model)  # still loads
    assert_same_tree(model.state_dict(), same_model.state_dict())
    sgd_model = _model(seed=1)
    sgd = MixedPrecisionOptimizer(torch.optim.SGD(sgd_model.parameters(), lr=1e-2, momentum=0.9))
    with pytest.raises(ValueError, match=r"without \['dampening', 'momentum'.*this optimizer is SGD"):
        checkpoint.load(sgd, tmp_path / "ck", named_parameters=sgd_model)


def test_another_loss_scalers_checkpoint_is_refused(tmp_path):
    import halfprec

    model = _model()
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))  # fp16: dynamic scaling
    _train(model, opt, 1)
    checkpoint.save(opt, tmp_path / "ck", named_parameters=model)
    fresh_model = _model(seed=1)
    fresh = MixedPrecisionOptimizer(
        torch.optim.AdamW(fresh_model.parameters(), lr=1e-2), loss_scaler=halfprec.StaticLossScaler(8.0)
    )
    assert_refused_unchanged(
        lambda: _snapshot(fresh_model, fresh),
        lambda: checkpoint.load(fresh, tmp_path / "ck", named_parameters=fresh_model),
        ValueError,
        "DynamicLossScaler.*StaticLossScaler",
    )


@pytest.mark.usefixtures("one_rank")
def test_zero_engine_load_of_another_group_layout_changes_nothing(tmp_path):
    """The engine reads and checks the DCP optimizer part before it loads the weights."""
    import halfprec

    def engine(groups, seed):
        model = _model(torch.float32, seed)
        params = _two_groups(model) if groups == 2 else torch.optim.AdamW(model.parameters(), lr=1e-2)
        return halfprec.initialize(model, params, precision="bf16", zero_stage=1)

    saved = engine(2, 0)
    _train(saved.module, saved, 2)
    saved.save_checkpoint(tmp_path / "ck")
    other = engine(1, 1)
    _train(other.module, other, 1)
    assert_refused_unchanged(
        lambda: engine_snapshot(other),
        lambda: other.load_checkpoint(tmp_path / "ck"),
        CheckpointError,
        "^" + re.escape(f"{tmp_path / 'ck' / 'step-2' / 'optimizer'} has 2 param groups, this optimizer 1"),
    )
