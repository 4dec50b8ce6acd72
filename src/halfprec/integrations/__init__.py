"""Adapters for the training tools users already run: Accelerate, the HF Trainer, Lightning and Fabric.

Each adapter lives in its own module and imports its tool only when that module is imported, so
``import halfprec.integrations`` needs none of them installed:

* ``halfprec.integrations.accelerate``: ``prepare(accelerator, ...)`` / ``attach(accelerator)``;
* ``halfprec.integrations.hf``: ``HalfprecTrainerMixin``, ``HalfprecTrainer``, ``HalfprecCallback``;
* ``halfprec.integrations.lightning``: ``HalfprecPrecision`` (Trainer), ``HalfprecFabricPrecision`` (Fabric).
"""

__all__: list[str] = []
