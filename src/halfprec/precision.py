"""The precision vocabulary: the names ``"bf16"``, ``"fp16"``, ``"fp32"`` and the one map from them to dtypes, so a
name means the same dtype everywhere and an alias such as ``"bfloat16"`` is refused with the same hint."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, get_args

import torch

from ._checks import choice

__all__ = [
    "DTYPES", "GRAD_ACCUM", "GradAccum", "LOW_PRECISION", "PRECISIONS", "Precision", "check_grad_accum",
    "check_low_precision", "check_precision", "spelled_dtype",
]  # fmt: skip

Precision = Literal["bf16", "fp16", "fp32"]
"""The dtype a model's weights are held in; the fp32 masters do not depend on it."""

PRECISIONS: tuple[Precision, ...] = get_args(Precision)

# read-only: a caller that added a name here would change what every other module accepts
DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
)

LOW_PRECISION: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
"""The 16-bit dtypes halfprec keeps fp32 masters for."""

GradAccum = Literal["param", "fp32"]
"""Where micro-batch grads are summed: in the params' own 16-bit ``.grad``, or in fp32 as backward produces them.
The same two names in ``Config``, the optimizers and the integrations; ``Config`` and the integrations also take
``"auto"`` (their accumulation count decides: ``config.auto_grad_accum``)."""

# the one map from those names to the dtype the sums are kept in (None: the param's own)
GRAD_ACCUM: Mapping[str, torch.dtype | None] = MappingProxyType({"param": None, "fp32": torch.float32})

# torch's and numpy's spellings, which users reach for first: refused, with the name to use instead
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def check_precision(value: object, name: str = "precision", allowed: tuple[str, ...] = PRECISIONS) -> str:
    """Return ``value`` when it is one of ``allowed`` (a str subclass or enum member is not); else ValueError
    naming the value and what to write."""
    alias = _ALIASES.get(value) if isinstance(value, str) else None
    choice(name, value, allowed, f"; use {alias!r}" if alias in allowed else "")
    return value


_GRAD_ACCUM_ALIASES = {
    None: "param", torch.bfloat16: "param", torch.float16: "param", "bf16": "param", "fp16": "param",
    torch.float32: "fp32", "float32": "fp32", "float": "fp32",
}  # fmt: skip


def check_grad_accum(value: object, name: str = "grad_accum_dtype", *, auto: bool = False) -> str:
    """Return ``value`` when it is ``"param"`` or ``"fp32"`` (or ``"auto"``, where ``auto``); else ValueError naming
    it and, for a dtype or another spelling, the name to write."""
    allowed = ("auto", *get_args(GradAccum)) if auto else get_args(GradAccum)
    if isinstance(value, str) and value in allowed:
        return value
    try:
        alias = _GRAD_ACCUM_ALIASES.get(value)  # type: ignore[call-overload]
    except TypeError:  # unhashable
        alias = None
    hint = f"; use {alias!r}" if alias else ""
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}{hint}")


# the strings users pass for a dtype from habit (halfprec's names, torch's, Lightning's precision flags)
_SPELLED = {
    **DTYPES, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "float32": torch.float32,
    "float": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16, "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16, "32-true": torch.float32,
}  # fmt: skip


def spelled_dtype(value: object) -> torch.dtype | None:
    """The dtype a string names in halfprec's, torch's or Lightning's spelling (``"bf16"``, ``"bfloat16"``,
    ``"bf16-true"``), else None."""
    return _SPELLED.get(value) if isinstance(value, str) else None


def check_low_precision(
    value: object, name: str = "param_dtype", *, allow_fp32: bool = False, allow_none: bool = True
) -> torch.dtype | None:
    """``value`` when it is a 16-bit dtype halfprec keeps masters for (or fp32 when allowed, None when allowed);
    else ValueError naming it and, for a dtype's name, the ``param_dtype=`` to write."""
    allowed = (*LOW_PRECISION, torch.float32) if allow_fp32 else LOW_PRECISION
    if (value is None and allow_none) or (isinstance(value, torch.dtype) and value in allowed):
        return value  # type: ignore[return-value]
    names = " or ".join(map(str, allowed)) + (" (or None)" if allow_none else "")
    dtype = spelled_dtype(value)
    hint = f"; use param_dtype={dtype}" if dtype in allowed else ""
    raise ValueError(f"{name} must be {names}, got {value!r}{hint}")
