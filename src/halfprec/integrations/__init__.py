"""Adapters for the training tools users already run: ``accelerate``, ``hf`` (the Trainer) and ``lightning``
(Trainer and Fabric), one module each (docs/integrations.md). Each imports its tool only when it is imported, so
``import halfprec.integrations`` needs none of them installed.
"""

import importlib
from types import ModuleType
from typing import Any

from ..optim.checks import check_grad_accum_dtype

__all__ = ["check_strategy", "require"]


def require(package: str, adapter: str) -> ModuleType:
    """Import ``package`` for the ``adapter`` module, or ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"halfprec.integrations.{adapter} needs the {package.partition('.')[0]} package: pip install "
            "'halfprec[integrations]'"
        ) from e


def check_strategy(impl: Any, grad_accum_dtype: Any) -> None:
    """ValueError for an ``impl`` or ``grad_accum_dtype`` that ``MixedPrecisionOptimizer`` would refuse: raised when
    the adapter is built, not when it first wraps an optimizer inside the tool's loop."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(
            f"impl must be 'auto' (the fused path on CUDA, else the exact one), 'torch' (the exact path) or "
            f"'triton' (the fused path), got {impl!r}"
        )
    check_grad_accum_dtype(grad_accum_dtype)
