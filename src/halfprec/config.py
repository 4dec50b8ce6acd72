"""Training configuration: one frozen dataclass, and a reader for DeepSpeed JSON configs.

``Config`` validates every field when it is built, so a bad value fails where it was written, not steps later.
``Config.from_deepspeed`` reads the parts of a DeepSpeed config that halfprec owns; ``DEEPSPEED_KEYS`` says, for
every DeepSpeed key inside those parts, whether it is mapped, accepted with a warning, or an error
(rendered in ``docs/deepspeed-config.md`` by ``render_deepspeed_table``). Nothing is silently dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .scaler import _check_power_of_two

__all__ = ["Config", "check_fields"]

_FSDP2_HINT = (
    "halfprec does not shard parameters (ZeRO-3); use torch FSDP2 (torch.distributed.fsdp.fully_shard with "
    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), or ZeRO stage 1/2"
)
_PRECISION_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _choice(name: str, value: Any, allowed: tuple[Any, ...], hint: str = "") -> None:
    if any(type(value) is type(a) and value == a for a in allowed):
        return
    raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}{hint}")


def _power_of_two(name: str, value: Any) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number (a power of two), got {value!r}")
    return _check_power_of_two(name, value)


def _int_at_least_one(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Config:
    """What ``halfprec.initialize`` needs to know. Every field has a working default.

    Loss scaling only exists for fp16: with bf16 or fp32 ``static_loss_scale`` must be ``None`` or ``1.0`` (a scale
    there would only hide the real gradient magnitudes from logs), while the dynamic-scaling knobs are validated
    but unused, so one config can switch precision without edits.
    """

    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """dtype the model's weights are held in; the masters are always fp32."""

    static_loss_scale: float | None = None
    """A fixed loss scale (a power of two; 1.0 = no scaling). ``None``: dynamic scaling for fp16, none otherwise."""

    initial_scale: float = 2.0**16
    """Dynamic scaling: the starting scale (power of two)."""

    growth_factor: float = 2.0
    """Dynamic scaling: factor applied after ``growth_interval`` clean steps (power of two, > 1)."""

    backoff_factor: float = 0.5
    """Dynamic scaling: factor applied on backoff (power of two, < 1)."""

    growth_interval: int = 1000
    """Dynamic scaling: clean steps before the scale grows."""

    hysteresis: int = 2
    """Dynamic scaling: overflows (since the last growth or backoff) before the scale backs off."""

    min_scale: float = 1.0
    """Dynamic scaling: the scale never goes below this (power of two)."""

    max_grad_norm: float | None = None
    """Clip the global L2 norm of the unscaled grads to this; ``None`` = no clipping."""

    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; ``Engine.backward`` divides the loss by it."""

    skip_nonfinite: bool = True
    """Skip steps with non-finite bf16/fp32 grads (fp16 grads are always checked)."""

    zero_stage: Literal[0, 1, 2] = 0
    """0: one process or DDP; 1/2: sharded optimizer state (and gradients) across data-parallel ranks."""

    reduce_dtype: Literal["fp32", "param"] = "fp32"
    """Sharded stages: dtype of the gradient reduce-scatter (fp32, or the params' 16-bit dtype)."""

    impl: Literal["auto", "torch", "triton"] = "auto"
    """Optimizer step implementation: the exact torch path, the fused Triton kernels, or pick automatically."""

    def __post_init__(self) -> None:
        alias = _PRECISION_ALIASES.get(self.precision) if isinstance(self.precision, str) else None
        _choice("precision", self.precision, ("bf16", "fp16", "fp32"), f"; use {alias!r}" if alias else "")
        if self.static_loss_scale is not None:
            scale = _power_of_two("static_loss_scale", self.static_loss_scale)
            if self.precision != "fp16" and scale != 1.0:
                raise ValueError(
                    f"static_loss_scale={self.static_loss_scale!r} with precision={self.precision!r}: loss scaling "
                    "is only for fp16 (bf16 and fp32 have fp32's exponent range); use static_loss_scale=None, "
                    "or precision='fp16'"
                )
        initial = _power_of_two("initial_scale", self.initial_scale)
        growth = _power_of_two("growth_factor", self.growth_factor)
        backoff = _power_of_two("backoff_factor", self.backoff_factor)
        minimum = _power_of_two("min_scale", self.min_scale)
        if growth <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}; use 2.0")
        if backoff >= 1.0:
            raise ValueError(f"backoff_factor must be < 1, got {self.backoff_factor!r}; use 0.5")
        if initial < minimum:
            raise ValueError(
                f"initial_scale ({self.initial_scale!r}) must be >= min_scale ({self.min_scale!r}); "
                "raise initial_scale or lower min_scale"
            )
        _int_at_least_one("growth_interval", self.growth_interval)
        _int_at_least_one("hysteresis", self.hysteresis)
        _int_at_least_one("gradient_accumulation_steps", self.gradient_accumulation_steps)
        if self.max_grad_norm is not None and (
            not _is_number(self.max_grad_norm)
            or not math.isfinite(self.max_grad_norm)
            or self.max_grad_norm <= 0
        ):
            raise ValueError(
                f"max_grad_norm must be a finite number > 0, or None for no clipping, got {self.max_grad_norm!r}"
            )
        _choice("skip_nonfinite", self.skip_nonfinite, (True, False))
        if _is_int(self.zero_stage) and self.zero_stage == 3:
            raise ValueError(f"zero_stage=3 is not supported: {_FSDP2_HINT}")
        _choice("zero_stage", self.zero_stage, (0, 1, 2))
        _choice("reduce_dtype", self.reduce_dtype, ("fp32", "param"))
        _choice("impl", self.impl, ("auto", "torch", "triton"))

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated); an unknown field is a TypeError naming close matches."""
        check_fields(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(cls, cfg: Mapping[str, Any] | str | os.PathLike) -> Config:
        """Build a Config from a DeepSpeed config (a dict, or the path of its JSON file).

        Reads ``fp16``, ``bf16`` (or legacy ``bfloat16``), ``gradient_clipping``, ``gradient_accumulation_steps``,
        ``zero_optimization`` and ``communication_data_type``; every key inside them must have a row in
        ``DEEPSPEED_KEYS`` (else ValueError listing the keys). Other top-level keys (batch sizes, ``optimizer``,
        ``scheduler``, logging, ...) are not halfprec's and are listed in the warning. Everything accepted but not
        applied, every ``"auto"`` (= halfprec's default) and every rounding is reported in one
        ``DeepSpeedConfigWarning`` per call. Absent keys take halfprec's defaults, which equal DeepSpeed's for the
        fp16 block; ``gradient_clipping`` absent means no clipping (recent DeepSpeed defaults it to 1.0).
        """
        from .deepspeed_config import read_deepspeed

        return read_deepspeed(cls, cfg)


def check_fields(changes: Mapping[str, Any], what: str = "Config field") -> None:
    """Raise TypeError for keys of ``changes`` that are not fields of ``Config``, suggesting the closest ones.

    ``initialize(model, opt, gradient_accumulation=4)`` would otherwise fail with the dataclass's bare
    "unexpected keyword argument", which neither says what the field is called nor lists the choices.
    """
    fields = [f.name for f in dataclasses.fields(Config)]
    unknown = [key for key in changes if key not in fields]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), fields, n=3, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(key))
    raise TypeError(
        f"unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; Config's fields are: "
        f"{', '.join(fields)}"
    )
