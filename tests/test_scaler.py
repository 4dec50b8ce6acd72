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
