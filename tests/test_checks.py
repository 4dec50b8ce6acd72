"""Shared value checks (``halfprec._checks``): every error names the value and what to use instead."""

import math

import pytest
import torch

from halfprec import _checks


@pytest.mark.parametrize(
    ("value", "is_int", "is_number"),
    [(1, True, True), (True, False, False), (1.0, False, True), ("1", False, False), (None, False, False)],
)
def test_bools_are_neither_ints_nor_numbers(value, is_int, is_number):
    assert _checks.is_int(value) is is_int and _checks.is_number(value) is is_number


def test_choice_matches_value_and_type():
    _checks.choice("stage", 1, (1, 2))
    for bad in (True, 1.0, 3):  # True == 1 and 1.0 == 1, but neither is the int 1
        with pytest.raises(ValueError, match=rf"stage must be one of 1, 2, got {bad!r}; see docs$"):
            _checks.choice("stage", bad, (1, 2), "; see docs")


def test_did_you_mean_names_close_matches():
    assert _checks.did_you_mean("stag", ("stage", "impl")) == " (did you mean 'stage'?)"
    assert _checks.did_you_mean("stages", ("stage", "stage2"), n=2) == " (did you mean 'stage' or 'stage2'?)"
    assert _checks.did_you_mean("xyz", ("stage",)) == ""


def test_int_at_least_one():
    assert _checks.int_at_least_one("n", 3, at_most=3) == 3
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"n must be an integer >= 1, got {bad!r}"):
            _checks.int_at_least_one("n", bad)
    with pytest.raises(ValueError, match=r"n=4 is too large: a counter; use at most 3"):
        _checks.int_at_least_one("n", 4, at_most=3, why="a counter")


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "1"])
def test_max_grad_norm_refuses(bad):
    with pytest.raises(ValueError, match=r"max_grad_norm must be a finite number > 0, or None"):
        _checks.check_max_grad_norm(bad)


def test_max_grad_norm_accepts_none_and_positive_numbers():
    for ok in (None, 1, 0.5):
        _checks.check_max_grad_norm(ok)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3.0, r"scale must be a power of two so that scaling is exact, got 3.0; use 4.0 or 2.0"),
        (0, r"positive, finite power of two, got 0"),
        (math.inf, r"positive, finite power of two"),
        (10**400, r"positive, finite power of two, got inf"),  # an int beyond float's range
        (2.0**128, r"\(2\*\*128\) is inf in fp32.*such as 2.0\*\*127"),
        (2.0**-150, r"\(2\*\*-150\) is 0 in fp32.*such as 2.0\*\*-149"),
        ("8", r"scale must be a number \(a power of two\), got '8'"),
    ],
)
def test_power_of_two_refuses_what_fp32_cannot_scale_exactly(value, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_power_of_two("scale", value)


def test_power_of_two_accepts_the_fp32_extremes_as_floats():
    for power in (-149, 0, 127):
        got = _checks.check_power_of_two("scale", 2**power if power >= 0 else 2.0**power)
        assert type(got) is float and got == 2.0**power
        assert torch.tensor(got, dtype=torch.float32).item() == got  # held exactly where the scaler keeps it


DYNAMIC = dict(
    init_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=1000,
    hysteresis=2,
    min_scale=1.0,
)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"growth_factor": 1.0}, r"growth_factor must be > 1, got 1.0; use 2.0"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be < 1, got 1.0; use 0.5"),
        (
            {"init_scale": 0.5},
            r"init_scale \(0.5\) must be >= min_scale \(1.0\); raise init_scale or lower min_scale",
        ),
        ({"hysteresis": 0}, r"hysteresis must be an integer >= 1, got 0"),
        ({"growth_interval": 2**63}, r"growth_interval=9223372036854775808 is too large"),
    ],
)
def test_dynamic_settings_refused(change, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_dynamic_settings({**DYNAMIC, **change})


def test_dynamic_settings_use_the_callers_spelling():
    with pytest.raises(ValueError, match=r"initial_scale \(0.5\) must be >= min_scale"):
        _checks.check_dynamic_settings({**DYNAMIC, "init_scale": 0.5}, {"init_scale": "initial_scale"})
    assert _checks.check_dynamic_settings({**DYNAMIC, "init_scale": 2**4})["init_scale"] == 16.0
