"""Loading a script that is not a package module (an example, a benchmark) by its path, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """Run the script at ``path`` as the module ``name`` (in ``sys.modules`` while it runs: its dataclasses look
    their module up there) and return it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
