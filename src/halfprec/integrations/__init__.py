"""Adapters for the training tools users already run: ``accelerate``, ``hf`` (the Trainer) and ``lightning``
(Trainer and Fabric), one module each (docs/integrations.md). Each imports its tool only when it is imported, so
``import halfprec.integrations`` needs none of them installed.
"""

import importlib
from types import ModuleType
from typing import Any

import torch

from ..config import auto_grad_accum
from ..optim.checks import check_grad_accum_dtype, world_size
from ..precision import check_grad_accum

__all__ = ["check_strategy", "require", "resolve_grad_accum_dtype"]


def require(package: str, adapter: str) -> ModuleType:
    """Import ``package`` for the ``adapter`` module, or ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"halfprec.integrations.{adapter} needs the {package.partition('.')[0]} package: from the repository's "
            "root, pip install -e '.[integrations]'"
        ) from e


def check_strategy(impl: Any, grad_accum_dtype: Any) -> None:
    """ValueError for an ``impl`` or ``grad_accum_dtype`` that ``MixedPrecisionOptimizer`` would refuse: raised when
    the adapter is built, not when it first wraps an optimizer inside the tool's loop."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(
            f"impl must be 'auto' (the fused path on CUDA, else the exact one), 'torch' (the exact path) or "
            f"'triton' (the fused path), got {impl!r}"
        )
    # 'auto': fp32 for bf16 params when the tool accumulates micro-batches
    if check_grad_accum(grad_accum_dtype, auto=True) == "fp32":
        check_grad_accum_dtype(grad_accum_dtype)


def resolve_grad_accum_dtype(
    choice: Any,
    optimizer: torch.optim.Optimizer,
    param_dtype: torch.dtype | None,
    micro_batches: int,
    *,
    fp32_sums: bool | None = None,
) -> str:
    """The ``grad_accum_dtype`` an adapter wraps ``optimizer`` with (its params cast to ``param_dtype``; None: they
    are 16-bit already): ``"auto"`` is ``Config``'s rule for the tool's ``micro_batches`` where ``fp32_sums`` are
    possible; an explicit value as it is. ``fp32_sums=None``: on one process only (the tool's DDP all-reduces the
    16-bit ``.grad``, which fp32 accumulation releases); over FSDP2 shards the adapter says whether the tool
    reduce-scatters every micro-batch."""
    if choice != "auto":
        return choice
    if param_dtype is None:
        bf16 = any(p.dtype == torch.bfloat16 for group in optimizer.param_groups for p in group["params"])
        param_dtype = torch.bfloat16 if bf16 else torch.float16
    if fp32_sums is None:
        fp32_sums = world_size() == 1
    return auto_grad_accum(param_dtype, micro_batches, fp32_sums=fp32_sums)
