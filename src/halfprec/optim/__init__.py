"""halfprec's optimizers. ``MixedPrecisionOptimizer`` (``base``) is the contract; calling it runs the one factory
(``select.build``), which returns a strategy: exact (``exact``), fused (``fused/``: ``FusedAdamW`` and friends,
Triton kernels imported lazily) or sharded (``sharded/``: ZeRO-1/2, imported on first use). ``layout`` holds the
flat buffers, ``state`` moves torch optimizer state onto masters, ``policy`` says when the fused kernels can run."""

from .base import MixedPrecisionOptimizer
from .exact import ExactMixedPrecisionOptimizer
from .fused import FusedAdagrad, FusedAdam, FusedAdamW, FusedLamb, FusedSGD
from .select import build

__all__ = [
    "ExactMixedPrecisionOptimizer", "FusedAdagrad", "FusedAdam", "FusedAdamW", "FusedLamb", "FusedSGD",
    "MixedPrecisionOptimizer", "build",
]  # fmt: skip
