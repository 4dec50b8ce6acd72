"""Resuming with another loss-scaler setup: a kind mismatch is refused before anything changes; otherwise the
engine's config keeps its scaler settings while the dynamic state (scale, tracker, budget) comes from the file."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from halfprec.checkpoint.manifest import CheckpointError
from halfprec.resume import scaler_kind_error

from .engine_util import build, snapshot, train

_SETTINGS = "loss-scaler settings differ"


def _same(a: dict, b: dict) -> None:
    assert a["weights"].keys() == b["weights"].keys()
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
    assert all(torch.equal(x, y) for x, y in zip(a["masters"], b["masters"], strict=True))
    for sa, sb in zip(a["state"], b["state"], strict=True):
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k] for k in sa)
    for key in ("scaler", "counters", "lr", "sched"):
        assert a[key] == b[key], key


def _scaler_state(engine) -> tuple:
    sd = engine.optimizer.loss_scaler.state_dict()
    return sd["scale"], sd["growth_tracker"], sd["hysteresis_left"]


@pytest.mark.parametrize(
    "saved,mine,pattern",
    [
        (
            {},
            {"static_loss_scale": 128.0},
            "saved with a DynamicLossScaler .*this engine has a StaticLossScaler",
        ),
        (
            {"static_loss_scale": 128.0},
            {},
            "saved with a StaticLossScaler .*this engine has a DynamicLossScaler",
        ),
    ],
    ids=["dynamic-into-static", "static-into-dynamic"],
)
def test_scaler_kind_mismatch_is_refused_before_anything_changes(tmp_path, saved, mine, pattern):
    source = build("fp16", **saved)
    train(source, 2)
    source.save_checkpoint(tmp_path)
    engine = build("fp16", seed=4, **mine)
    train(engine, 2)  # inner state, masters and a scale of its own that a partial load would overwrite
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match=pattern) as info:
        engine.load_checkpoint(tmp_path)
    message = str(info.value)
    assert "static_loss_scale" in message and "load_optimizer_states=False" in message
    _same(before, snapshot(engine))
    engine.load_checkpoint(tmp_path, load_optimizer_states=False)  # the way out that the message names
    pairs = zip(engine.module.parameters(), source.module.parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)


def test_kind_refusal_is_worded_in_the_saved_and_current_config():
    """Wherever the scaler's refusal comes from (the optimizer file, or chained under a sharded load's error), the
    engine words it with the saved config's and its own settings; other errors are not its business."""
    engine = build("fp16", static_loss_scale=64.0)
    with pytest.raises(ValueError) as refused:
        engine.optimizer.loss_scaler.check_state_dict({"type": "DynamicLossScaler"})
    sharded = ValueError(f"checkpoint ckpt: {refused.value}")  # how the sharded load words it
    sharded.__cause__ = refused.value
    state = {"config": {"precision": "fp16", "static_loss_scale": None}}
    for error in (refused.value, sharded):
        message = str(scaler_kind_error(Path("ckpt"), error, state, engine.config))
        assert message.startswith(
            "ckpt was saved with a DynamicLossScaler (precision='fp16', static_loss_scale=None)"
        )
        assert "this engine has a StaticLossScaler (precision='fp16', static_loss_scale=64.0)" in message
    assert scaler_kind_error(Path("ckpt"), ValueError("other"), state, engine.config) is None


def test_config_settings_win_and_dynamic_state_comes_from_the_checkpoint(tmp_path):
    source = build("fp16", min_scale=2.0**10, hysteresis=2)  # growth_interval=3 (build's fp16 default)
    train(source, 5, inject_inf_at=(3,))  # grows at step 2, overflows at 3 (budget 2 -> 1), clean step 4
    source.save_checkpoint(tmp_path)
    assert _scaler_state(source) == (2.0**15, 1, 1)

    changed = dict(min_scale=1.0, growth_interval=50, hysteresis=1, growth_factor=4.0, backoff_factor=0.25)
    engine = build("fp16", seed=2, **changed)
    config = engine.config
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(tmp_path)
    messages = [str(w.message) for w in caught if _SETTINGS in str(w.message)]
    assert len(messages) == 1
    for part in (
        "min_scale 1024.0 -> 1.0",
        "growth_interval 3 -> 50",
        "hysteresis 2 -> 1",
        "growth_factor 2.0 -> 4.0",
        "backoff_factor 0.5 -> 0.25",
    ):
        assert part in messages[0], (part, messages[0])
    assert engine.config is config
    scaler = engine.optimizer.loss_scaler
    assert (scaler.min_scale, scaler.growth_interval, scaler.hysteresis) == (1.0, 50, 1)
    assert (scaler.growth_factor, scaler.backoff_factor) == (4.0, 0.25)
    assert _scaler_state(engine) == (2.0**15, 1, 1)  # the checkpoint's dynamic state
    # the configured schedule runs: hysteresis=1 and backoff 0.25 (the saved 2 / 0.5 would give 2**14)
    train(engine, 1, inject_inf_at=(5,))
    assert engine.last_record.skipped and engine.loss_scale == 2.0**13
    assert engine.optimizer.loss_scaler.state_dict()["min_scale"] == 1.0  # and it is what a new save records


def test_budget_above_the_configured_hysteresis_is_lowered(tmp_path):
    source = build("fp16", hysteresis=2)
    train(source, 4)  # growth at step 2 refills the budget to 2
    source.save_checkpoint(tmp_path)
    assert _scaler_state(source) == (2.0**15, 1, 2)
    engine = build("fp16", seed=2, hysteresis=1)
    with pytest.warns(RuntimeWarning, match="hysteresis 2 -> 1.*budget left lowered from 2 to 1"):
        engine.load_checkpoint(tmp_path)
    train(engine, 1, inject_inf_at=(4,))
    assert engine.loss_scale == 2.0**14  # the first overflow backs off, as hysteresis=1 says


def test_scale_below_the_configured_min_scale_is_raised(tmp_path):
    source = build("fp16")
    train(source, 1)
    source.save_checkpoint(tmp_path)
    engine = build("fp16", seed=2, initial_scale=2.0**15, min_scale=2.0**15)
    with pytest.warns(RuntimeWarning, match="min_scale 1.0 -> 32768.0.*scale 16384 raised to min_scale"):
        engine.load_checkpoint(tmp_path)
    assert engine.loss_scale == 2.0**15


def test_static_scale_of_the_config_wins(tmp_path):
    source = build("fp16", static_loss_scale=128.0)
    train(source, 1)
    source.save_checkpoint(tmp_path)
    engine = build("fp16", seed=2, static_loss_scale=256.0)
    with pytest.warns(RuntimeWarning, match="static_loss_scale 128.0 -> 256.0"):
        engine.load_checkpoint(tmp_path)
    assert engine.loss_scale == 256.0 and engine.optimizer.loss_scaler.state_dict()["init_scale"] == 256.0


def test_same_settings_resume_without_a_warning(tmp_path):
    source = build("fp16")
    train(source, 4, inject_inf_at=(1,))
    source.save_checkpoint(tmp_path)
    engine = build("fp16", seed=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(tmp_path)
    assert not [w for w in caught if _SETTINGS in str(w.message)]
    assert engine.optimizer.loss_scaler.state_dict() == source.optimizer.loss_scaler.state_dict()
