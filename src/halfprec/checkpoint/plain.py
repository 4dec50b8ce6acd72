"""Plain data for checkpoint files, checked at save time: ``torch.load(weights_only=True)`` loads only what
:func:`check_plain` accepts (the RNG states are converted to tensors and plain values for it)."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["check_plain", "rng_state", "set_rng_state"]


def check_plain(value: Any, where: str = "client_state") -> None:
    """Raise unless ``value`` is made of tensors, numbers, strings, None, lists, tuples and dicts (str or int
    keys)."""
    # exact types: a numpy float is a float subclass that torch.load(weights_only=True) refuses
    if value is None or type(value) in (bool, int, float, str) or isinstance(value, torch.Tensor):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ValueError(f"{where} has a key of type {type(key).__name__}; use str or int keys")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise ValueError(
        f"{where} is a {type(value).__name__}; checkpoints hold plain data only (tensors, numbers, strings, "
        "lists, dicts) so that loading never runs code: convert it, e.g. with .state_dict() or int()"
    )


def rng_state() -> dict[str, Any]:
    """Python, torch CPU/CUDA and numpy RNG states as tensors and plain values (loadable weights_only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state(
            (n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"])
        )
