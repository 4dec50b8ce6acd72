"""Triton kernels of the fused optimizer step, with their launchers. Importing this package does not import
Triton (the kernel modules do, imported by the fused optimizers when they are built)."""

from __future__ import annotations

import importlib
import os

__all__ = ["interpreted", "triton_status"]


def interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``, which Triton reads when it is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_status() -> tuple[bool, str]:
    """``(True, "")`` when Triton imports and has a backend here (a CUDA device, or the CPU interpreter when
    ``TRITON_INTERPRET=1`` was set before the import), else ``(False, reason)``."""
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return (
            False,
            f"triton is not importable ({e}); install the extra from the repository's root: pip install -e '.[triton]'",
        )
    import torch

    if torch.cuda.is_available() or interpreted():
        return True, ""
    return False, "no CUDA device (and TRITON_INTERPRET is not set), so the Triton kernels cannot run"
