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

from ...kernels.slots import ADAGRAD_HP, Kind, hp_row
from .base import FusedOptimizer

__all__ = ["FusedAdagrad"]


class FusedAdagrad(FusedOptimizer):
    """Adagrad with built-in FP32 masters for fp16/bf16 params (``maximize`` is not supported)."""

    KIND = Kind.ADAGRAD
    STATE_NAMES = ("sum",)
    _EAGER_STATE = True
    _NONNEGATIVE = ("lr", "lr_decay", "weight_decay", "eps", "initial_accumulator_value")
    _TORCH_NAME = "torch.optim.Adagrad"

    def __init__(
        self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False, **options: Any,
    ) -> None:  # fmt: skip
        hyper = dict(
            lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
            initial_accumulator_value=initial_accumulator_value, maximize=maximize,
        )  # fmt: skip
        super().__init__(params, hyper, **options)

    @classmethod
    def initial_value(cls, name: str, group: dict[str, Any]) -> float:
        return float(group["initial_accumulator_value"])

    @classmethod
    def hp_row(cls, group: dict[str, Any]) -> list[Any]:
        return hp_row(
            ADAGRAD_HP, LR=group["lr"], LR_DECAY=group["lr_decay"], WEIGHT_DECAY=group["weight_decay"],
            EPS=group["eps"],
        )  # fmt: skip
