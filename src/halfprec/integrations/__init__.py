"""Adapters for the training tools users already run: Accelerate, the HF Trainer, Lightning and Fabric.

Each adapter lives in its own module and imports its tool only when that module is imported, so
``import halfprec.integrations`` needs none of them installed:

* ``halfprec.integrations.accelerate``: ``prepare(accelerator, ...)`` / ``attach(accelerator)``;
* ``halfprec.integrations.hf``: ``HalfprecTrainerMixin``, ``HalfprecTrainer``, ``HalfprecCallback``;
* ``halfprec.integrations.lightning``: ``HalfprecPrecision`` (Trainer), ``HalfprecFabricPrecision`` (Fabric).
"""

__all__: list[str] = []


def _halfprec_optimizer_types() -> tuple[type, ...]:
    """The optimizers that own masters and a loss scale: the wrapper and the fused family (no Triton import)."""
    from ..optim._base import FusedOptimizer
    from ..optimizer import MixedPrecisionOptimizer

    return (MixedPrecisionOptimizer, FusedOptimizer)
