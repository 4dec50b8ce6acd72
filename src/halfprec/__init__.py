"""halfprec: exact, fast mixed-precision training for PyTorch (FP16/BF16 weights, FP32 masters)."""

from .optimizer import MixedPrecisionOptimizer
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler

__all__ = [
    "DynamicLossScaler",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "StaticLossScaler",
    "__version__",
]

__version__ = "0.1.0"
