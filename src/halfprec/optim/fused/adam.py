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

from ...kernels.slots import ADAM_HP, Kind, hp_row
from .base import FusedOptimizer, check_number

__all__ = ["FusedAdam", "FusedAdamW"]


class FusedAdam(FusedOptimizer):
    """Adam (L2 weight decay unless ``decoupled_weight_decay=True``) with built-in FP32 masters, over the model's
    fp16/bf16 params (fp32 params are their own masters)."""

    KIND = Kind.ADAM
    STATE_NAMES = ("exp_avg", "exp_avg_sq")
    _DECOUPLED = False
    _NONNEGATIVE = ("lr", "eps", "weight_decay")
    _UNSUPPORTED = ("amsgrad", "maximize")
    _TORCH_NAME = "torch.optim.AdamW"

    def __init__(
        self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0.0, *, decoupled_weight_decay: bool | None = None, amsgrad: bool = False,
        maximize: bool = False, **options: Any,
    ) -> None:  # fmt: skip
        decoupled = self._DECOUPLED if decoupled_weight_decay is None else bool(decoupled_weight_decay)
        hyper = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled_weight_decay=decoupled,
            amsgrad=amsgrad, maximize=maximize, capturable=False,
        )  # fmt: skip
        super().__init__(params, hyper, **options)

    def _validate_group(self, group: dict[str, Any], index: int) -> None:
        super()._validate_group(group, index)
        b1, b2 = group["betas"]
        check_number("betas[0]", b1, 0.0, 1.0, index)
        check_number("betas[1]", b2, 0.0, 1.0, index)

    @classmethod
    def hp_row(cls, group: dict[str, Any]) -> list[Any]:
        b1, b2 = group["betas"]
        dec = 1.0 if group.get("decoupled_weight_decay", cls._DECOUPLED) else 0.0
        return hp_row(
            ADAM_HP, LR=group["lr"], BETA1=b1, BETA2=b2, EPS=group["eps"], WEIGHT_DECAY=group["weight_decay"],
            DECOUPLED=dec,
        )  # fmt: skip


class FusedAdamW(FusedAdam):
    """AdamW: ``FusedAdam`` with decoupled weight decay (default ``weight_decay=1e-2``, as torch.optim.AdamW)."""

    _DECOUPLED = True

    def __init__(
        self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 1e-2, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
