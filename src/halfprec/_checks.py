"""Type and range checks shared by ``Config``, the DeepSpeed reader, the precision names and the loss scalers
(below all of them: no import cycle), one wording per rule."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "DYNAMIC_SETTINGS",
    "check_dynamic_settings",
    "check_max_grad_norm",
    "check_power_of_two",
    "choice",
    "did_you_mean",
    "int_at_least_one",
    "is_int",
    "is_number",
]


def is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a count or a stage is a typo, not a number
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def choice(name: str, value: Any, allowed: tuple[Any, ...], hint: str = "") -> None:
    """ValueError unless ``value`` is one of ``allowed`` with the same type (1 is not True, 1.0 is not 1)."""
    if any(type(value) is type(a) and value == a for a in allowed):
        return
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")


def did_you_mean(name: str, known: Iterable[str], n: int = 1) -> str:
    """`` (did you mean 'a' or 'b'?)`` with up to ``n`` close matches of ``name`` in ``known``; '' for none."""
    close = difflib.get_close_matches(name, list(known), n=n)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def int_at_least_one(name: str, value: Any, *, at_most: int | None = None, why: str = "") -> int:
    """``value`` when it is an int in ``[1, at_most]``; else ValueError (``why`` says where the bound comes from)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if at_most is not None and value > at_most:
        raise ValueError(f"{name}={value!r} is too large: {why}; use at most {at_most}")
    return value


def check_max_grad_norm(value: Any) -> None:
    """The clipping threshold: a finite number > 0, or None for no clipping (ValueError otherwise)."""
    if value is None:
        return
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"max_grad_norm must be a finite number > 0, or None for no clipping, got {value!r}")


# The scale lives in an fp32 tensor: a power of two outside [2**-149, 2**127] is stored as 0 or inf there,
# after which every step overflows (or unscales to inf) and is skipped forever. The factors multiply it there.
_FP32_POWERS = (-149, 127)
# growth_tracker and hysteresis_left are int64 tensors compared with, and filled from, these settings
_COUNTER_MAX = torch.iinfo(torch.int64).max
DYNAMIC_SETTINGS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
)


def check_power_of_two(name: str, value: Any) -> float:
    """``value`` as a float when it is a power of two that fp32 holds exactly; else ValueError naming the fix."""
    if not is_number(value):
        raise ValueError(f"{name} must be a number (a power of two), got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond float's range
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive, finite power of two, got {value!r}")
    mantissa, _ = math.frexp(value)
    if mantissa != 0.5:
        raise ValueError(
            f"{name} must be a power of two so that scaling is exact, got {value!r}; "
            f"use {2.0 ** math.ceil(math.log2(value))!r} or {2.0 ** math.floor(math.log2(value))!r}"
        )
    power = int(math.log2(value))
    low, high = _FP32_POWERS
    if not low <= power <= high:
        raise ValueError(
            f"{name}={value!r} (2**{power}) is {'inf' if power > high else '0'} in fp32, the dtype the loss scaler "
            f"keeps it in, so every step would be skipped; use a power of two from 2**{low} to 2**{high}, "
            f"such as 2.0**{min(max(power, low), high)}"
        )
    return value


def check_dynamic_settings(
    settings: Mapping[str, Any], spelled: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Check ``DynamicLossScaler``'s settings (its keyword arguments) and return them as it stores them.

    ``spelled`` maps a setting to the name the caller's user wrote it under, for the messages (``Config``
    still accepts ``initial_scale`` for ``init_scale``).
    """
    names = {key: key for key in DYNAMIC_SETTINGS} | dict(spelled or {})
    checked = {
        key: check_power_of_two(names[key], settings[key])
        for key in ("init_scale", "growth_factor", "backoff_factor", "min_scale")
    }
    if checked["growth_factor"] <= 1.0:
        raise ValueError(f"{names['growth_factor']} must be > 1, got {settings['growth_factor']!r}; use 2.0")
    if checked["backoff_factor"] >= 1.0:
        raise ValueError(
            f"{names['backoff_factor']} must be < 1, got {settings['backoff_factor']!r}; use 0.5"
        )
    if checked["init_scale"] < checked["min_scale"]:
        init, low = names["init_scale"], names["min_scale"]
        raise ValueError(
            f"{init} ({settings['init_scale']!r}) must be >= {low} ({settings['min_scale']!r}); "
            f"raise {init} or lower {low}"
        )
    why = "the loss scaler counts steps in an int64 tensor"
    for key in ("growth_interval", "hysteresis"):
        checked[key] = int_at_least_one(names[key], settings[key], at_most=_COUNTER_MAX, why=why)
    return {key: checked[key] for key in DYNAMIC_SETTINGS}
