"""The Triton dynamic-scaler update against ``DynamicLossScaler.update`` (the reference), state field by field after
every step of long random overflow patterns, and which scalers may take the kernel (``fusable``)."""

from __future__ import annotations

import pytest
import torch

import halfprec

from ..optim.helpers import DEVICE

# (scaler kwargs, overflow probability, steps): each row reaches growth, hysteresis-delayed backoff, the
# min_scale clamp and, for the last rows, a growth that would not be finite (the scale is kept)
CONFIGS = [
    (dict(init_scale=2.0**6, growth_interval=3, hysteresis=2, min_scale=2.0**2), 0.35, 300),
    (dict(init_scale=2.0**3, growth_interval=1, hysteresis=1, min_scale=1.0), 0.5, 200),
    (
        dict(
            init_scale=2.0**8,
            growth_factor=4.0,
            backoff_factor=0.25,
            growth_interval=4,
            hysteresis=3,
            min_scale=2.0**-4,
        ),
        0.4,
        300,
    ),  # fmt: skip
    (dict(init_scale=2.0**124, growth_interval=2, hysteresis=1, min_scale=2.0**120), 0.25, 200),
    (
        dict(init_scale=2.0**126, growth_factor=2.0**10, growth_interval=2, hysteresis=2, min_scale=2.0**100),
        0.3,
        200,
    ),
]


def _fields(scaler):
    s = scaler._state
    return s["scale"].clone(), s["growth_tracker"].clone(), s["hysteresis_left"].clone()


def _pattern(p: float, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    draws = torch.rand(steps, generator=g)
    # found_inf is "> 0" in the reference: values other than 1.0 must mean the same
    values = torch.tensor([1.0, 2.0, 0.5])[torch.randint(0, 3, (steps,), generator=g)]
    return [float(v) if d < p else 0.0 for d, v in zip(draws, values, strict=True)]


def _compare(kwargs, pattern, device, update):
    ref = halfprec.DynamicLossScaler(**kwargs).to(device)
    ker = halfprec.DynamicLossScaler(**kwargs).to(device)
    seen = {"grow": 0, "backoff": 0, "clamp": 0, "kept": 0, "delayed": 0}
    found = torch.zeros((), device=device)
    for step, f in enumerate(pattern):
        before = float(ref.scale)
        found.fill_(f)
        ref.update(found)
        update(ker, found)
        for name, a, b in zip(
            ("scale", "growth_tracker", "hysteresis_left"), _fields(ref), _fields(ker), strict=True
        ):
            assert a.dtype == b.dtype and torch.equal(a, b), (step, name, a, b)
        after = float(ref.scale)
        refilled = int(ref._state["hysteresis_left"]) == ref.hysteresis
        if f and not refilled:
            seen["delayed"] += 1  # hysteresis budget left: no backoff yet
        elif f:
            seen["clamp" if before * ref.backoff_factor < ref.min_scale else "backoff"] += 1
        elif after > before:
            seen["grow"] += 1
        elif int(ref._state["growth_tracker"]) == 0:
            seen["kept"] += 1  # growth would have overflowed fp32: the scale stays
    return seen


@pytest.mark.parametrize(("kwargs", "p", "steps"), CONFIGS)
def test_kernel_equals_reference_update(kwargs, p, steps):
    from halfprec.kernels.scaler import dynamic_update

    seen = _compare(kwargs, _pattern(p, steps, seed=steps), DEVICE, dynamic_update)
    assert seen["grow"] > 0 and seen["backoff"] > 0, seen
    if kwargs.get("hysteresis", 2) > 1:
        assert seen["delayed"] > 0, seen
    if kwargs["init_scale"] < 2.0**100:
        assert seen["clamp"] > 0, seen
    else:
        assert seen["kept"] > 0, seen


def test_state_dict_round_trip_and_config_changes_are_honoured():
    from halfprec.kernels.scaler import dynamic_update

    kwargs = dict(init_scale=2.0**5, growth_interval=2, hysteresis=2, min_scale=1.0)
    ref = halfprec.DynamicLossScaler(**kwargs).to(DEVICE)
    ker = halfprec.DynamicLossScaler(**kwargs).to(DEVICE)
    found = torch.zeros((), device=DEVICE)
    for f in (1.0, 0.0, 1.0):
        found.fill_(f)
        ref.update(found)
        dynamic_update(ker, found)
    sd = ref.state_dict()
    sd.update(growth_interval=1, hysteresis=1, scale=2.0**3)
    ref.load_state_dict(sd)
    ker.load_state_dict(sd)
    for f in (0.0, 1.0, 0.0, 0.0, 1.0):
        found.fill_(f)
        ref.update(found)
        dynamic_update(ker, found)
        assert ref.state_dict() == ker.state_dict()


class _OverriddenScaler(halfprec.DynamicLossScaler):
    def update(self, found_inf):
        super().update(found_inf)


FUSABLE = [
    (lambda: halfprec.DynamicLossScaler(), True),
    (lambda: halfprec.DynamicLossScaler(min_scale=2.0**-126, init_scale=1.0), True),
    (lambda: halfprec.DynamicLossScaler(min_scale=2.0**-127, init_scale=1.0), False),  # fp32 subnormal floor
    (lambda: halfprec.DynamicLossScaler(growth_factor=2.0**65), False),
    (lambda: halfprec.DynamicLossScaler(backoff_factor=2.0**-65), False),
    (lambda: halfprec.StaticLossScaler(2.0**8), False),
    (lambda: _OverriddenScaler(), False),  # an overridden update is the subclass's to run
]


@pytest.mark.parametrize(("factory", "expected"), FUSABLE)
def test_fusable(factory, expected):
    from halfprec.kernels.scaler import fusable

    scaler = factory().to(DEVICE)
    assert fusable(scaler, torch.device(DEVICE)) is expected


def test_state_elsewhere_or_in_other_dtypes_is_not_fusable():
    from halfprec.kernels.scaler import fusable

    scaler = halfprec.DynamicLossScaler().to(DEVICE)
    assert not fusable(scaler, torch.device("meta"))
    scaler._state["growth_tracker"] = scaler._state["growth_tracker"].int()
    assert not fusable(scaler, torch.device(DEVICE))


def test_dynamic_update_errors():
    from halfprec.kernels.scaler import dynamic_update

    with pytest.raises(ValueError, match="cannot be updated by the Triton kernel"):
        dynamic_update(_OverriddenScaler().to(DEVICE), torch.zeros((), device=DEVICE))
    with pytest.raises(ValueError, match="one-element tensor"):
        dynamic_update(halfprec.DynamicLossScaler().to(DEVICE), torch.zeros(3, device=DEVICE))


@pytest.mark.gpu
def test_kernel_equals_reference_update_on_cuda_long_pattern():
    from halfprec.kernels.scaler import dynamic_update

    kwargs = dict(init_scale=2.0**16, growth_interval=4, hysteresis=2, min_scale=2.0**10)
    seen = _compare(kwargs, _pattern(0.3, 3000, seed=1), "cuda", dynamic_update)
    assert seen["grow"] > 0 and seen["backoff"] > 0 and seen["clamp"] > 0 and seen["delayed"] > 0, seen
