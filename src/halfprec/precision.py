"""The precision vocabulary: the names ``"bf16"``, ``"fp16"``, ``"fp32"`` and the one map from them to dtypes, so a
name means the same dtype everywhere and an alias such as ``"bfloat16"`` is refused with the same hint."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, get_args

import torch

from ._checks import choice

__all__ = ["DTYPES", "LOW_PRECISION", "PRECISIONS", "Precision", "check_low_precision", "check_precision"]

Precision = Literal["bf16", "fp16", "fp32"]
"""The dtype a model's weights are held in; the fp32 masters do not depend on it."""

PRECISIONS: tuple[Precision, ...] = get_args(Precision)

# read-only: a caller that added a name here would change what every other module accepts
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
)

LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
"""The 16-bit dtypes halfprec keeps fp32 masters for."""

# torch's and numpy's spellings, which users reach for first: refused, with the name to use instead
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def check_precision(value: object, name: str = "precision", allowed: tuple[str, ...] = PRECISIONS) -> str:
    """Return ``value`` when it is one of ``allowed`` (a str subclass or enum member is not); else ValueError
    naming the value and what to write."""
    alias = _ALIASES.get(value) if isinstance(value, str) else None
    choice(name, value, allowed, f"; use {alias!r}" if alias in allowed else "")
    return value


def check_low_precision(
    value: object, name: str = "param_dtype", *, allow_fp32: bool = False
) -> torch.dtype | None:
    """``value`` when it is a 16-bit dtype halfprec keeps masters for (or fp32 when allowed), or None; else
    ValueError naming it."""
    allowed = (*LOW_PRECISION, torch.float32) if allow_fp32 else LOW_PRECISION
    if value is None or value in allowed:
        return value  # type: ignore[return-value]
    names = ", ".join(map(str, allowed))
    raise ValueError(f"{name} must be {names} or None, got {value!r}")
