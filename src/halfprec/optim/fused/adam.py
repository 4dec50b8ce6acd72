"""FusedAdamW and FusedAdam: Adam with decoupled or L2 weight decay, in one fused two-pass step.

Per element, in fp32 (torch's ``_single_tensor_adam`` order; ``g`` is the 16-bit grad times the inverse loss
scale times the clip coefficient)::

    p = p * (1 - lr * wd)            # AdamW only (decoupled)
    g = g + wd * p                   # Adam only (L2)
    m = lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

with ``t`` the param's own step count and the bias corrections in fp64 (torch computes them as Python
doubles). State is torch-format: ``step`` (0-d fp32 CPU tensor), ``exp_avg``, ``exp_avg_sq`` per param that has
been stepped. ``amsgrad`` and ``maximize`` are not supported (the torch path has them).
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.slots import ADAM_HP, Kind, hp_row
from .base import FusedOptimizer

__all__ = ["FusedAdam", "FusedAdamW"]


def _check_number(name: str, value: Any, lo: float, hi: float | None, index: int) -> None:
    v = float(value)
    if not (v >= lo and (hi is None or v < hi)):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"param group {index}: {name} must be {bound}, got {value!r}")


class FusedAdam(FusedOptimizer):
    """Adam (L2 weight decay unless ``decoupled_weight_decay=True``) with built-in FP32 masters.

    Takes the model's fp16/bf16 params directly (fp32 params are their own masters). See
    ``halfprec.optim.fused.base`` for the step, the grad marking and the loss-scaling arguments.
    """

    _KIND = Kind.ADAM
    _STATE_NAMES = ("exp_avg", "exp_avg_sq")
    _DECOUPLED = False

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool | None = None,
        amsgrad: bool = False,
        maximize: bool = False,
        loss_scaler=None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        decoupled = self._DECOUPLED if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=None,
            capturable=False,
            differentiable=False,
            fused=None,
            decoupled_weight_decay=decoupled,
        )
        super().__init__(
            params,
            defaults,
            loss_scaler=loss_scaler,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=skip_nonfinite,
            param_dtype=param_dtype,
        )

    def _validate_group(self, group: dict[str, Any], index: int) -> None:
        _check_number("lr", group["lr"], 0.0, None, index)
        _check_number("eps", group["eps"], 0.0, None, index)
        _check_number("weight_decay", group["weight_decay"], 0.0, None, index)
        b1, b2 = group["betas"]
        _check_number("betas[0]", b1, 0.0, 1.0, index)
        _check_number("betas[1]", b2, 0.0, 1.0, index)
        for flag in ("amsgrad", "maximize"):
            if group.get(flag, False):
                raise ValueError(
                    f"param group {index}: {flag}=True is not supported by {type(self).__name__}; "
                    "use the torch path (halfprec.MixedPrecisionOptimizer over torch.optim.AdamW)"
                )

    @classmethod
    def _hp_row(cls, group: dict[str, Any]) -> list[Any]:
        b1, b2 = group["betas"]
        dec = 1.0 if group.get("decoupled_weight_decay", cls._DECOUPLED) else 0.0
        return hp_row(
            ADAM_HP, LR=group["lr"], BETA1=b1, BETA2=b2, EPS=group["eps"], WEIGHT_DECAY=group["weight_decay"],
            DECOUPLED=dec,
        )  # fmt: skip

    def _export_state(self, i: int, step: float) -> dict[str, Any]:
        if step == 0:
            return {}
        chunk, local = self._where[i]
        return {
            "step": torch.tensor(step, dtype=torch.float32),
            "exp_avg": chunk.state_views("exp_avg")[local].clone(),
            "exp_avg_sq": chunk.state_views("exp_avg_sq")[local].clone(),
        }

    def _import_state(self, i: int, saved: dict[str, Any]) -> float:
        step = float(saved.get("step", 0.0))
        if step == 0:
            return 0.0
        chunk, local = self._where[i]
        chunk.state_views("exp_avg")[local].copy_(saved["exp_avg"])
        chunk.state_views("exp_avg_sq")[local].copy_(saved["exp_avg_sq"])
        return step


class FusedAdamW(FusedAdam):
    """AdamW: ``FusedAdam`` with decoupled weight decay (default ``weight_decay=1e-2``, as torch.optim.AdamW)."""

    _DECOUPLED = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("decoupled_weight_decay", True)
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
