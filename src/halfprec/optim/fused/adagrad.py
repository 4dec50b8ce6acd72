"""FusedAdagrad: Adagrad in one fused two-pass step.

Per element, in fp32 (torch's ``_single_tensor_adagrad``; ``t`` the param's own step count)::

    g = g + wd * p
    sum = sum + g * g
    p = p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(sum) + eps)

State is torch-format and eager, as torch creates it in its constructor: ``step`` and ``sum`` (filled with
``initial_accumulator_value`` in fp32) for every trainable param.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.slots import ADAGRAD_HP, Kind, hp_row
from .adam import _check_number
from .base import FusedOptimizer

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizer):
    """Adagrad with built-in FP32 masters for fp16/bf16 params (``maximize`` is not supported)."""

    _KIND = Kind.ADAGRAD
    _STATE_NAMES = ("sum",)

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        *,
        maximize: bool = False,
        loss_scaler=None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            eps=eps,
            initial_accumulator_value=initial_accumulator_value,
            foreach=None,
            maximize=maximize,
            differentiable=False,
            fused=None,
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
        for name in ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value"):
            _check_number(name, group[name], 0.0, None, index)
        if group.get("maximize", False):
            raise ValueError(
                f"param group {index}: maximize=True is not supported by FusedAdagrad; use the torch "
                "path (halfprec.MixedPrecisionOptimizer over torch.optim.Adagrad)"
            )

    def _init_state(self) -> None:
        for i in range(len(self._trainable)):
            chunk, local = self._where[i]
            value = float(self._group_of(i)["initial_accumulator_value"])
            chunk.state_views("sum")[local].fill_(value)

    def _group_of(self, i: int) -> dict[str, Any]:
        p = self._trainable[i]
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    @classmethod
    def _hp_row(cls, group: dict[str, Any]) -> list[Any]:
        return hp_row(
            ADAGRAD_HP,
            LR=group["lr"],
            LR_DECAY=group["lr_decay"],
            WEIGHT_DECAY=group["weight_decay"],
            EPS=group["eps"],
        )

    def _export_state(self, i: int, step: float) -> dict[str, Any]:
        chunk, local = self._where[i]
        return {
            "step": torch.tensor(step, dtype=torch.float32),
            "sum": chunk.state_views("sum")[local].clone(),
        }

    def _import_state(self, i: int, saved: dict[str, Any]) -> float:
        step = float(saved.get("step", 0.0))
        if step == 0:
            return 0.0  # constructor-made state: keep our fp32 one (a 16-bit copy would not be exact)
        chunk, local = self._where[i]
        chunk.state_views("sum")[local].copy_(saved["sum"])
        return step
