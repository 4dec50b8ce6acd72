"""Training configuration: one frozen dataclass, validated when it is built (a bad value fails where it was
written, not steps later). The loss-scaler fields carry the scalers' own names and are checked by the checks
the scalers run. Imports go one way: config -> deepspeed_config -> _checks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from typing import Any, Literal, get_args, get_type_hints

import torch

from ._checks import (
    DYNAMIC_SETTINGS,
    check_dynamic_settings,
    check_max_grad_norm,
    check_power_of_two,
    choice,
    did_you_mean,
    int_at_least_one,
)
from .deepspeed_config import read_deepspeed
from .precision import DTYPES, Precision, check_grad_accum, check_precision
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler

__all__ = ["OLD_NAMES", "Config", "auto_grad_accum", "check_fields", "config_name", "dynamic_scaling"]


class _NotGiven:
    """Default of an old field name: tells "not passed" apart from any value, None included."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()

OLD_NAMES: Mapping[str, str] = {"initial_scale": "init_scale"}
"""Field names ``Config`` still accepts (as keyword arguments and attributes) -> the field's name now.
``initial_scale`` is spelled in the README, docs/deepspeed-config.md and user code written before the loss-scaler
fields took ``DynamicLossScaler``'s names. Passing both names is an error (unless the new one is at its default)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """What ``halfprec.initialize`` needs to know. Every field has a working default.

    Loss scaling only exists for fp16: with bf16 or fp32 ``static_loss_scale`` must be ``None`` or ``1.0`` (a scale
    there would only hide the real gradient magnitudes from logs), while the dynamic-scaling knobs are validated
    but unused, so one config can switch precision without edits.
    """

    precision: Precision = "bf16"
    """dtype the model's weights are held in; the masters are always fp32."""

    static_loss_scale: float | None = None
    """A fixed loss scale: ``StaticLossScaler(scale=static_loss_scale)`` (a power of two; 1.0 = no scaling).
    ``None``: dynamic scaling for fp16, none otherwise. The one loss-scaler field not named as its scaler names
    it: in a config that also holds the dynamic scaler's settings, a bare ``scale`` would not say which."""

    init_scale: float = 2.0**16
    """Dynamic scaling: the starting scale (power of two). The old name ``initial_scale`` is accepted too."""

    initial_scale: InitVar[float] = _NOT_GIVEN
    """Old name of ``init_scale``: accepted when building a Config and read back as an attribute."""

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

    zero_stage: Literal[0, 1, 2, 3] = 0
    """0: one process, DDP, or (with fp32 accumulation, instead of DDP) halfprec's all-reduce of the fp32 grad sums;
    a model already sharded by ``fully_shard`` (FSDP2) also trains at 0. 1/2: sharded optimizer state (and
    gradients) across data-parallel ranks.

    3: ``initialize`` shards the model with torch FSDP2 (``fully_shard``) by a fixed policy: the fp32 model is cast
    to ``precision`` (its fp32 values kept, so the masters start from them, not from their rounding), then
    ``fully_shard`` is applied to each repeated block (the children of the first ``nn.ModuleList`` in the model,
    as torchtitan shards transformer layers; without one, each direct child that has params), then to the root,
    on a 1-D mesh over the default process group (which must be initialised). The torch optimizer passed to
    ``initialize`` (built over ``model.parameters()``) is pointed at the sharded params, its state at their rows.
    Masters and optimizer state are those of each rank's rows, on the strategy ``impl`` picks as at the other
    stages (``"auto"``: the fused kernels on CUDA, whose step cannot be captured in a CUDA graph over shards;
    ``"torch"``: the exact one); every micro-batch is reduce-scattered. A model that is sharded already is
    refused here: pass 0."""

    reduce_dtype: Literal["fp32", "param"] = "fp32"
    """Sharded stages: dtype of the gradient reduce-scatter (fp32, or the params' 16-bit dtype; at stages 1/2
    ``"param"`` does not combine with ``grad_accum_dtype="fp32"``). At stage 3 FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=...)``: with ``"fp32"`` the reduced shards are rounded to 16 bits once,
    after the sum; fp32 accumulation then sums the micro-batches' reduced shards in fp32 with either."""

    grad_accum_dtype: Literal["auto", "param", "fp32"] = "auto"
    """Where micro-batch grads accumulate: the params' 16-bit ``.grad`` (``"param"``), or fp32 (``"fp32"``, the
    optimizers' ``grad_accum_dtype="fp32"``: at stage 0 the master grads, all-reduced by the optimizer
    across processes instead of DDP; at stages 1/2 an fp32 buffer, reduce-scattered in fp32). ``"auto"``:
    :func:`auto_grad_accum`'s rule, resolved by ``grad_accum()``."""

    masters: Literal["fp32", "split"] = "fp32"
    """How the fused optimizers store the fp32 masters of bf16 params: fp32 buffers, or ``"split"``: the bf16 param
    plus the master's low 16 bits, exact in 2 bytes per param (docs/split-masters.md). Fused path only (at any
    ``zero_stage``): needs ``impl`` "auto" or "triton" and no fp16."""

    impl: Literal["auto", "torch", "triton"] = "auto"
    """Optimizer step implementation: the exact torch path, the fused Triton kernels, or pick automatically."""

    def __post_init__(self, initial_scale: Any) -> None:
        spelled = {}  # setting -> the name it was given under, so that an error names what the user wrote
        if initial_scale is not _NOT_GIVEN:
            if self.init_scale != _DEFAULTS["init_scale"]:  # both passed (the default cannot be told apart)
                raise ValueError(
                    f"init_scale={self.init_scale!r} and initial_scale={initial_scale!r}: initial_scale is the old "
                    "name of init_scale; pass only init_scale"
                )
            object.__setattr__(self, "init_scale", initial_scale)
            spelled["init_scale"] = "initial_scale"
        check_precision(self.precision)
        if self.static_loss_scale is not None:
            scale = check_power_of_two("static_loss_scale", self.static_loss_scale)
            if self.precision != "fp16" and scale != 1.0:
                raise ValueError(
                    f"static_loss_scale={self.static_loss_scale!r} with precision={self.precision!r}: loss scaling "
                    "is only for fp16 (bf16 and fp32 have fp32's exponent range); use static_loss_scale=None, "
                    "or precision='fp16'"
                )
        check_dynamic_settings(self._dynamic_settings(), spelled)
        int_at_least_one("gradient_accumulation_steps", self.gradient_accumulation_steps)
        check_max_grad_norm(self.max_grad_norm)
        choice("skip_nonfinite", self.skip_nonfinite, (True, False))
        # the values their Literal annotations name
        for name in ("zero_stage", "reduce_dtype", "impl", "masters"):
            choice(name, getattr(self, name), get_args(_HINTS[name]))
        check_grad_accum(self.grad_accum_dtype, auto=True)
        if self.masters == "split" and (self.impl == "torch" or self.precision == "fp16"):
            raise ValueError(
                f"masters='split' with impl={self.impl!r}, precision={self.precision!r}: split masters are the "
                "fused path's (impl='auto' or 'triton', at any zero_stage) for bf16 models; the exact path "
                "and fp16 keep fp32 masters: use masters='fp32'"
            )
        if self.grad_accum_dtype == "fp32" and self.reduce_dtype == "param" and self.zero_stage in (1, 2):
            raise ValueError(
                f"grad_accum_dtype='fp32' with reduce_dtype='param' at zero_stage={self.zero_stage!r}: the fp32 sums "
                "would be rounded to 16 bits for the reduction; fp32 accumulation reduces in fp32: use "
                "reduce_dtype='fp32' (the default), or grad_accum_dtype='param'"
            )

    def grad_accum(self) -> str:
        """The optimizers' ``grad_accum_dtype`` this config asks for, ``"param"`` or ``"fp32"`` (at any world size: several ranks at stage 0
        all-reduce the fp32 sums themselves; at stages 1/2 ``reduce_dtype="param"`` rules fp32 sums out)."""
        if self.grad_accum_dtype == "auto":
            sharded_16 = self.zero_stage in (1, 2) and self.reduce_dtype == "param"
            steps = self.gradient_accumulation_steps
            return auto_grad_accum(DTYPES[self.precision], steps, fp32_sums=not sharded_16)
        return self.grad_accum_dtype

    def _dynamic_settings(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in DYNAMIC_SETTINGS}

    def loss_scaler(self) -> LossScaler:
        """A new loss scaler with these settings: ``StaticLossScaler(static_loss_scale)`` when set, else a
        ``DynamicLossScaler`` for fp16 and no scaling (``StaticLossScaler(1.0)``) for bf16 and fp32."""
        if dynamic_scaling(self.precision, self.static_loss_scale):
            return DynamicLossScaler(**self._dynamic_settings())
        return StaticLossScaler(1.0 if self.static_loss_scale is None else self.static_loss_scale)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes`` applied (validated); an unknown field is a TypeError naming close matches."""
        check_fields(changes)
        # dataclasses.replace passes every field, and an InitVar left out as its attribute (here the property
        # that reads the new name): spell out both, so that only an old name the caller passed counts
        for old, new in OLD_NAMES.items():
            if old in changes and new not in changes:
                changes[new] = _DEFAULTS[new]
            changes.setdefault(old, _NOT_GIVEN)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_deepspeed(cls, cfg: Mapping[str, Any] | str | os.PathLike) -> Config:
        """Build a Config from a DeepSpeed config (a dict, or the path of its JSON file).

        Every key inside the blocks halfprec owns must have a row in ``DEEPSPEED_KEYS`` (else ValueError); what
        is not applied is reported in one ``DeepSpeedConfigWarning``. The rules: docs/deepspeed-config.md.
        """
        return read_deepspeed(cls, cfg)


def check_fields(changes: Mapping[str, Any], what: str = "Config field") -> None:
    """Raise TypeError for keys of ``changes`` that are not fields of ``Config``, suggesting the closest ones.

    ``initialize(model, opt, gradient_accumulation=4)`` would otherwise fail with the dataclass's bare
    "unexpected keyword argument", which neither says what the field is called nor lists the choices.
    """
    fields = [f.name for f in dataclasses.fields(Config)]
    unknown = [key for key in changes if key not in fields and key not in OLD_NAMES]
    if not unknown:
        return
    hints = [repr(key) + did_you_mean(str(key), fields, n=3) for key in unknown]
    raise TypeError(
        f"unknown {what}{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; Config's fields are: "
        f"{', '.join(fields)}"
    )


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
_HINTS = get_type_hints(Config)
# read access under the old name (the InitVar above only covers building)
Config.initial_scale = property(lambda self: self.init_scale, doc="Old name of ``init_scale``.")  # type: ignore[assignment]


def auto_grad_accum(param_dtype: torch.dtype, micro_batches: int, *, fp32_sums: bool = True) -> str:
    """What ``grad_accum_dtype="auto"`` asks the optimizers for, the engine's and the integrations' default:
    ``"fp32"`` for bf16 params summing several micro-batches where fp32 sums are possible (``fp32_sums``),
    else ``"param"``, the params' 16-bit ``.grad``: bf16 sums lose 2.7e-3 relative at 4 micro-batches, fp16's go through
    the loss scale (3.3e-4) for 2 B/param less, one micro-batch has nothing to sum (docs/guarantees.md)."""
    return "fp32" if param_dtype == torch.bfloat16 and micro_batches > 1 and fp32_sums else "param"


def dynamic_scaling(precision: str, static_loss_scale: float | None) -> bool:
    """Whether a config with these values (also a saved one, read back as a dict) scales dynamically."""
    return precision == "fp16" and static_loss_scale is None


def config_name(scaler: LossScaler, setting: str) -> str:
    """Config's name for a setting of ``scaler`` (``settings()``'s keys): the scaler's own name, except the
    static scaler's ``scale``, which Config calls ``static_loss_scale``."""
    return "static_loss_scale" if isinstance(scaler, StaticLossScaler) and setting == "scale" else setting
