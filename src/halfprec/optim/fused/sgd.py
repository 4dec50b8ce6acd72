"""FusedSGD: SGD with momentum, dampening and Nesterov, in one fused two-pass step.

Per element, in fp32 (torch's ``_single_tensor_sgd``)::

    g = g + wd * p
    buf = g                                   # the param's first step with momentum
    buf = buf * momentum + (1 - dampening) * g  # later steps
    g = g + momentum * buf if nesterov else buf
    p = p - lr * g

State is torch-format: ``momentum_buffer`` per stepped param when ``momentum != 0``. The per-param step count
(kept internally, not in the state dict, as torch keeps none) tells the first step from the others.
"""

from __future__ import annotations

from typing import Any

from ...kernels.slots import SGD_HP, Kind, hp_row
from .base import FusedOptimizer

__all__ = ["FusedSGD"]


class FusedSGD(FusedOptimizer):
    """SGD with built-in FP32 masters for fp16/bf16 params (``maximize`` is not supported)."""

    KIND = Kind.SGD
    STATE_NAMES = ("momentum_buffer",)  # with momentum only
    _NONNEGATIVE = ("lr", "momentum", "weight_decay")
    _TORCH_NAME = "torch.optim.SGD"

    def __init__(
        self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
        nesterov: bool = False, *, maximize: bool = False, **options: Any,
    ) -> None:  # fmt: skip
        hyper = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=maximize,
        )  # fmt: skip
        super().__init__(params, hyper, **options)
        self._momentum_was_zero: list[bool] | None = None  # per group, at the last step

    @classmethod
    def group_state(cls, group: dict[str, Any]) -> tuple[str, ...]:
        return cls.STATE_NAMES if float(group["momentum"]) != 0 else ()

    def _upload_hyper(self, capturing: bool) -> None:
        # torch starts a momentum buffer at a param's first step *with momentum*; the kernel knows only the
        # param's step count, so a group that took steps without momentum cannot start one later
        now_zero = [float(g["momentum"]) == 0 for g in self.param_groups]
        if self._momentum_was_zero is not None:
            for i, (before, now) in enumerate(zip(self._momentum_was_zero, now_zero, strict=True)):
                if before and not now:
                    raise ValueError(
                        f"param group {i}: momentum went from 0 to {self.param_groups[i]['momentum']!r} after steps "
                        "were taken without it, which FusedSGD cannot follow exactly; use the torch path "
                        "(halfprec.MixedPrecisionOptimizer(torch.optim.SGD(...), impl='torch'))"
                    )
        self._momentum_was_zero = now_zero
        super()._upload_hyper(capturing)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._momentum_was_zero = None  # the loaded groups and buffers are the new starting point

    def _validate_group(self, group: dict[str, Any], index: int) -> None:
        super()._validate_group(group, index)
        if group["nesterov"] and (float(group["momentum"]) <= 0 or float(group["dampening"]) != 0):
            raise ValueError(
                f"param group {index}: nesterov=True needs momentum > 0 and dampening = 0, got "
                f"momentum={group['momentum']!r}, dampening={group['dampening']!r}"
            )

    @classmethod
    def hp_row(cls, group: dict[str, Any]) -> list[Any]:
        return hp_row(
            SGD_HP, LR=group["lr"], MOMENTUM=group["momentum"], DAMPENING=group["dampening"],
            WEIGHT_DECAY=group["weight_decay"], NESTEROV=1.0 if group["nesterov"] else 0.0,
        )  # fmt: skip

    def _export_state(self, i: int, step: float) -> dict[str, Any]:
        # state_dict() allocated the buffers of every group with momentum before exporting
        if step == 0 or not self.group_state(self.param_groups[self._group_of[i]]):
            return {}
        return {"momentum_buffer": self._state_view("momentum_buffer", i).clone()}

    @classmethod
    def step_count(cls, state: dict[str, Any] | None) -> float | None:
        # torch keeps no count; the kernels' first step (count 0) copies the grad into a new momentum buffer
        return 1.0 if state and state.get("momentum_buffer") is not None else None
