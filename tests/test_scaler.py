"""Loss scalers: the exact dynamic schedule against a pure-Python model of it, and state round trips."""

from __future__ import annotations

import pytest
import torch

from halfprec import DynamicLossScaler, StaticLossScaler


def _python_schedule(pattern, *, init, growth, backoff, interval, hysteresis, min_scale):
    """The documented rule, written plainly: the oracle for DynamicLossScaler.update."""
    scale, tracker, left, out = init, 0, hysteresis, []
    for overflow in pattern:
        if overflow:
            tracker, left = 0, left - 1
            if left <= 0:
                scale, left = max(scale * backoff, min_scale), hysteresis
        else:
            tracker += 1
            if tracker >= interval:
                scale, tracker, left = scale * growth, 0, hysteresis
        out.append((scale, tracker, left))
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("interval", [1, 3])
def test_dynamic_schedule_matches_the_documented_rule(hysteresis, interval):
    gen = torch.Generator().manual_seed(hysteresis * 10 + interval)
    pattern = (torch.rand(200, generator=gen) < 0.35).tolist() + [True] * 200  # ends pinned at min_scale
    kw = dict(
        init_scale=2.0**6,
        growth_factor=2.0,
        backoff_factor=0.25,
        growth_interval=interval,
        hysteresis=hysteresis,
        min_scale=2.0,
    )
    scaler = DynamicLossScaler(**kw)
    expected = _python_schedule(
        pattern, init=64.0, growth=2.0, backoff=0.25, interval=interval, hysteresis=hysteresis, min_scale=2.0
    )
    for overflow, (scale, tracker, left) in zip(pattern, expected, strict=True):
        scaler.update(torch.tensor(float(overflow)))
        state = scaler.state_dict()
        assert (state["scale"], state["growth_tracker"], state["hysteresis_left"]) == (scale, tracker, left)
    assert scaler.loss_scale == 2.0 and bool(scaler.at_min_scale())


def test_growth_stops_before_inf():
    scaler = DynamicLossScaler(init_scale=2.0**126, growth_interval=1)
    for _ in range(5):
        scaler.update(torch.tensor(0.0))
    assert scaler.loss_scale == 2.0**127


def test_state_dict_round_trip_every_field():
    a = DynamicLossScaler(init_scale=2.0**10, growth_interval=7, hysteresis=3, min_scale=4.0)
    for flag in (1.0, 0.0, 0.0, 1.0):
        a.update(torch.tensor(flag))
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert (b.growth_interval, b.hysteresis, b.min_scale) == (7, 3, 4.0)
    with pytest.raises(
        ValueError, match="cannot load a 'DynamicLossScaler' loss-scaler state into a StaticLossScaler: build"
    ):
        StaticLossScaler(1.0).load_state_dict(a.state_dict())


def test_static_scaler_never_changes_and_inverse_is_exact():
    s = StaticLossScaler(2.0**-3)
    s.update(torch.tensor(1.0))
    assert s.loss_scale == 0.125 and s.inv_scale().item() == 8.0
    assert s.inv_scale().dtype == torch.float32


def test_update_does_not_sync(monkeypatch):
    scaler = DynamicLossScaler()
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(1))
    scaler.update(torch.tensor(1.0))
    assert calls == []


@pytest.mark.parametrize(
    ("scaler", "change", "match"),
    [
        (lambda: DynamicLossScaler(), {"scale": 3.0}, r"scale must be a power of two"),
        (lambda: DynamicLossScaler(), {"hysteresis": 0}, r"hysteresis must be an integer >= 1"),
        (lambda: DynamicLossScaler(), {"growth_factor": 0.5}, r"growth_factor must be > 1"),
        (lambda: StaticLossScaler(4.0), {"init_scale": 3.0}, r"scale must be a power of two"),
        (lambda: StaticLossScaler(4.0), {"scale": -1.0}, r"scale must be a positive, finite power of two"),
    ],
)
def test_load_state_dict_refuses_invalid_values_and_changes_nothing(scaler, change, match):
    s = scaler()
    before = s.state_dict()
    with pytest.raises(ValueError, match=match):
        s.load_state_dict({**before, **change})
    assert s.state_dict() == before


# --- construction: every value the scaler keeps must be usable on the device ---------------------------

CONSTRUCTION_ERRORS = [
    # a scale that fp32 rounds to inf or 0 would skip every step forever
    (
        StaticLossScaler,
        {"scale": 2.0**200},
        ValueError,
        r"scale=1\.6\d*e\+60 \(2\*\*200\) is inf in fp32.*2\.0\*\*127",
    ),
    (
        StaticLossScaler,
        {"scale": 2.0**-150},
        ValueError,
        r"scale=.* \(2\*\*-150\) is 0 in fp32.*2\.0\*\*-149",
    ),
    (StaticLossScaler, {"scale": True}, ValueError, r"scale must be a number \(a power of two\), got True"),
    (StaticLossScaler, {"scale": "8"}, ValueError, r"scale must be a number \(a power of two\), got '8'"),
    (
        StaticLossScaler,
        {"scale": 10**400},
        ValueError,
        r"scale must be a positive, finite power of two, got inf",
    ),
    (
        DynamicLossScaler,
        {"init_scale": 2.0**128},
        ValueError,
        r"init_scale=3\.4\d*e\+38 \(2\*\*128\) is inf in fp32",
    ),
    (DynamicLossScaler, {"init_scale": 1.0, "min_scale": 2.0**-150}, ValueError, r"min_scale=.*is 0 in fp32"),
    (DynamicLossScaler, {"growth_factor": 2.0**128}, ValueError, r"growth_factor=.*is inf in fp32"),
    (
        DynamicLossScaler,
        {"init_scale": 1000.0},
        ValueError,
        r"init_scale must be a power of two.*use 1024\.0",
    ),
    (DynamicLossScaler, {"growth_factor": 1.0}, ValueError, r"growth_factor must be > 1, got 1\.0; use 2\.0"),
    (
        DynamicLossScaler,
        {"backoff_factor": 1.0},
        ValueError,
        r"backoff_factor must be < 1, got 1\.0; use 0\.5",
    ),
    (
        DynamicLossScaler,
        {"init_scale": 1.0, "min_scale": 2.0},
        ValueError,
        r"init_scale \(1\.0\) must be >= min_scale \(2\.0\); raise init_scale or lower min_scale",
    ),
    # the growth tracker and the hysteresis budget are int64 tensors (2**70 was an OverflowError at step 1)
    (
        DynamicLossScaler,
        {"growth_interval": 2**70},
        ValueError,
        r"growth_interval=1180591620717411303424 is too large: .*int64.*use at most 9223372036854775807",
    ),
    (DynamicLossScaler, {"hysteresis": 2**63}, ValueError, r"hysteresis=9223372036854775808 is too large"),
    (
        DynamicLossScaler,
        {"growth_interval": True},
        ValueError,
        r"growth_interval must be an integer >= 1, got True",
    ),
    (DynamicLossScaler, {"scale": 2.0}, TypeError, r"unexpected keyword argument 'scale'"),
]


@pytest.mark.parametrize(("cls", "kwargs", "error", "regex"), CONSTRUCTION_ERRORS)
def test_construction_refuses_unusable_settings(cls, kwargs, error, regex):
    with pytest.raises(error, match=regex):
        cls(**kwargs)


def test_the_extremes_fp32_holds_are_accepted_and_step():
    static = StaticLossScaler(2.0**127)
    assert static.loss_scale == 2.0**127
    tiny = DynamicLossScaler(init_scale=2.0**-149, min_scale=2.0**-149, hysteresis=1)
    tiny.update(torch.tensor(1.0))
    assert tiny.loss_scale == 2.0**-149
    most = torch.iinfo(torch.int64).max
    slow = DynamicLossScaler(growth_interval=most, hysteresis=most)
    for flag in (0.0, 1.0):
        slow.update(torch.tensor(flag))  # no OverflowError against the int64 counters
    assert slow.state_dict()["hysteresis_left"] == most - 1


# --- resuming with the scaler's own settings -----------------------------------------------------------


def test_keep_settings_takes_the_dynamic_state_within_the_kept_settings():
    saved = DynamicLossScaler(init_scale=2.0**4, growth_interval=1, hysteresis=3, min_scale=1.0)
    saved.update(torch.tensor(0.0))  # grows to 2**5, budget refilled to 3
    mine = DynamicLossScaler(init_scale=2.0**8, growth_interval=9, hysteresis=2, min_scale=2.0**6)
    kept = mine.load_state_dict(saved.state_dict(), keep_settings=True)
    assert kept.differed == {"growth_interval": (1, 9), "hysteresis": (3, 2), "min_scale": (1.0, 64.0)}
    assert kept.adjusted == [
        "the checkpoint's scale 32 raised to min_scale",
        "the hysteresis budget left lowered from 3 to 2",
    ]
    state = mine.state_dict()
    assert (state["scale"], state["growth_tracker"], state["hysteresis_left"]) == (64.0, 0, 2)
    assert (state["init_scale"], state["growth_interval"], state["min_scale"]) == (256.0, 9, 64.0)


def test_keep_settings_on_a_static_scaler_keeps_its_scale():
    mine = StaticLossScaler(256.0)
    kept = mine.load_state_dict(StaticLossScaler(128.0).state_dict(), keep_settings=True)
    assert kept.differed == {"scale": (128.0, 256.0)} and kept.adjusted == []
    assert mine.state_dict() == {"type": "StaticLossScaler", "scale": 256.0, "init_scale": 256.0}


def test_plain_load_reports_nothing_and_takes_the_settings():
    mine = DynamicLossScaler(hysteresis=1)
    kept = mine.load_state_dict(DynamicLossScaler(hysteresis=4).state_dict())
    assert kept == ({}, []) and mine.hysteresis == 4


def test_keep_settings_before_placement_survives_the_placement():
    mine = DynamicLossScaler(min_scale=4.0)
    saved = DynamicLossScaler(init_scale=2.0**3, hysteresis=5)
    saved.update(torch.tensor(1.0))
    mine.load_state_dict(saved.state_dict(), keep_settings=True)
    # the optimizer places it on its params' device later: the loaded state and the kept settings go along
    state = mine.to("cpu").state_dict()
    assert [state[k] for k in ("scale", "hysteresis_left", "min_scale", "hysteresis")] == [8.0, 2, 4.0, 2]
