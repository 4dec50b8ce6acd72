"""halfprec: exact, fast mixed-precision training for PyTorch (FP16/BF16 weights, FP32 masters)."""

from .config import Config
from .deepspeed_config import DeepSpeedConfigWarning
from .engine import Engine, StepRecord, initialize
from .optim.base import MixedPrecisionOptimizer
from .scaler import DynamicLossScaler, LossScaler, StaticLossScaler

__all__ = [
    "Config",
    "DeepSpeedConfigWarning",
    "DynamicLossScaler",
    "Engine",
    "LossScaler",
    "MixedPrecisionOptimizer",
    "StaticLossScaler",
    "StepRecord",
    "__version__",
    "initialize",
]

__version__ = "0.1.0"
