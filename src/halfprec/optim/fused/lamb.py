"""FusedLamb: LAMB (layer-wise adaptive moments) with built-in FP32 masters.

Per param, in fp32, after global unscaling and clipping (``t`` the param's own step count)::

    m = lerp(m, g, 1 - beta1);  v = v * beta2 + (1 - beta2) * g * g
    u = (m / (1 - beta1**t)) / (sqrt(v) / sqrt(1 - beta2**t) + eps) + weight_decay * p
    p = p - lr * (||p|| / ||u||) * u        # trust ratio 1 when either norm is 0

The trust ratio needs each param's whole ``u`` before any element moves, so LAMB runs three passes after the
norm pass (``halfprec.kernels.lamb``) instead of Adam's one. State is torch-format like Adam's (``step``,
``exp_avg``, ``exp_avg_sq``), so LAMB checkpoints load into a reference LAMB written the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from ...kernels.slots import Kind
from .adam import FusedAdam

__all__ = ["FusedLamb"]


class FusedLamb(FusedAdam):
    """LAMB over fp16/bf16 params with FP32 masters (see the module docstring for the math). Its hyper-parameter
    row is Adam's; its kernels add ``weight_decay * p`` to the update themselves (``AdamScalars.WD_RAW``)."""

    KIND = Kind.LAMB

    def __init__(
        self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
        weight_decay: float = 0.01, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)
        from ...kernels.lamb import trust_table

        self._trust_rows = [trust_table(t) for t in self._update_tables]
        self._lamb_partials = [
            torch.zeros(max(t.shape[0], 1), 2, device=self._device) for t in self._update_tables
        ]

    def _launch_update(self, k: int) -> None:
        from ...kernels.lamb import lamb_update

        chunk = self._chunks[k]
        param, master = chunk.kernel_buffers()
        lamb_update(
            param, chunk.grad, master, chunk.state["exp_avg"], chunk.state["exp_avg_sq"], self._update_tables[k],
            self._trust_rows[k], self._lamb_partials[k], self._pscal, self._scalars,
        )  # fmt: skip
