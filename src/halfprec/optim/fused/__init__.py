"""The fused strategy: optimizers with built-in FP32 masters whose whole step runs in Triton kernels (imported
lazily: importing this package does not import Triton)."""

from .adagrad import FusedAdagrad
from .adam import FusedAdam, FusedAdamW
from .base import FusedOptimizer
from .lamb import FusedLamb
from .sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedAdamW", "FusedLamb", "FusedOptimizer", "FusedSGD"]
