"""halfprec's optimizers: ``MixedPrecisionOptimizer`` (the contract and its exact strategy, ``base``), the fused
strategy (``fused/``: ``FusedAdamW`` and friends, Triton kernels imported lazily) and the sharded strategy
(``sharded/``: ZeRO-1/2, imported on first use through ``halfprec.distributed``). ``layout`` holds the flat
buffers, ``state`` moves torch optimizer state onto masters, ``select`` is the ``impl=`` policy."""

from .base import MixedPrecisionOptimizer
from .fused import FusedAdagrad, FusedAdam, FusedAdamW, FusedLamb, FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedAdamW", "FusedLamb", "FusedSGD", "MixedPrecisionOptimizer"]
