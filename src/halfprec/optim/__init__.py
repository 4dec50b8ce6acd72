"""Fused optimizers with built-in FP32 masters (Triton kernels, imported lazily: importing this package does
not import Triton)."""

from .adagrad import FusedAdagrad
from .adam import FusedAdam, FusedAdamW
from .lamb import FusedLamb
from .sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedAdamW", "FusedLamb", "FusedSGD"]
