"""Checks on what a sharded optimizer wraps (the param names that key its checkpoints: ``optim/names.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..base import MixedPrecisionOptimizer
from ..checks import check_elementwise, check_options, check_torch_optimizer

__all__ = [
    "check_named_parameters",
    "check_optimizer",
    "check_reduce_dtype",
]


def check_optimizer(optimizer: Any, loss_scaler: Any, max_grad_norm: Any, param_dtype: Any) -> None:
    if isinstance(optimizer, MixedPrecisionOptimizer):
        raise ValueError(
            "optimizer is a MixedPrecisionOptimizer; give ShardedMixedPrecisionOptimizer the plain torch optimizer"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        check_elementwise(optimizer, "each rank's pieces of the params (ZeRO-1/2)")
    check_torch_optimizer(optimizer)  # a torch optimizer, floating params listed once, differentiable=False
    check_options(loss_scaler=loss_scaler, max_grad_norm=max_grad_norm, param_dtype=param_dtype)


def check_named_parameters(named_parameters: Any) -> None:
    """Raise ValueError unless ``named_parameters`` is an ``nn.Module`` or an iterable (of ``(name, param)``
    pairs, which ``names.named_trainable`` checks one by one)."""
    if not isinstance(named_parameters, (torch.nn.Module, Iterable)):
        raise ValueError(
            f"named_parameters must be the model or its named_parameters(), got {named_parameters!r}; pass "
            "named_parameters=model (the names key checkpoints)"
        )


def check_reduce_dtype(reduce_dtype: Any, grad_accum_dtype: str) -> None:
    """Raise ValueError for a ``reduce_dtype`` other than ``"fp32"``/``"param"``, and for fp32 accumulation with
    ``"param"``: the fp32 sums would be rounded to 16 bits before the ranks' sum, the very rounding fp32
    accumulation is there to avoid (Megatron ties the two: ``accumulate_allreduce_grads_in_fp32``)."""
    if reduce_dtype not in ("fp32", "param"):
        raise ValueError(f"reduce_dtype must be 'fp32' or 'param', got {reduce_dtype!r}")
    if grad_accum_dtype == "fp32" and reduce_dtype == "param":
        raise ValueError(
            "grad_accum_dtype='fp32' with reduce_dtype='param': the fp32 sums of the micro-batch grads would "
            "be rounded to the params' 16-bit dtype for the reduction; fp32 accumulation reduces in fp32: pass "
            "reduce_dtype='fp32' (the default), or grad_accum_dtype='param'"
        )
