"""Adapters for the training tools users already run: ``accelerate``, ``hf`` (the Trainer) and ``lightning``
(Trainer and Fabric), one module each (docs/integrations.md). Each imports its tool only when it is imported, so
``import halfprec.integrations`` needs none of them installed.
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
