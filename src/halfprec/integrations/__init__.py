"""Adapters for the training tools users already run: Accelerate, the HF Trainer, Lightning and Fabric.

Each adapter lives in its own module and imports its tool only when that module is imported, so
``import halfprec.integrations`` needs none of them installed:

* ``halfprec.integrations.accelerate``: ``prepare(accelerator, ...)`` / ``attach(accelerator)``;
* ``halfprec.integrations.hf``: ``HalfprecTrainerMixin``, ``HalfprecTrainer``, ``HalfprecCallback``;
* ``halfprec.integrations.lightning``: ``HalfprecPrecision`` (Trainer), ``HalfprecFabricPrecision`` (Fabric).
"""

import importlib
from types import ModuleType

__all__ = ["require"]


def require(package: str, adapter: str) -> ModuleType:
    """Import ``package`` for the ``adapter`` module, or ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            f"halfprec.integrations.{adapter} needs the {package.partition('.')[0]} package: pip install "
            "'halfprec[integrations]'"
        ) from e
