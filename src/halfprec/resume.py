"""The engine's two checks around loading a loss scaler from a checkpoint, in the config's words.

The policies belong to the scaler (``check_state_dict``, ``load_state_dict(..., keep_settings=True)``); here is
what only the engine knows: the saved config (sharded files do not store the scaler's kind) and its setting names.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError
from .config import Config, config_name, dynamic_scaling
from .scaler import LossScaler

__all__ = ["check_scaler_kind", "keep_scaler_settings"]


def check_scaler_kind(
    path: Path, engine_state: Any, optim_state: Any, scaler: LossScaler, config: Config
) -> None:
    """Raise CheckpointError when the checkpoint's loss scaler (from the optimizer file, else the saved config)
    is of another kind than this engine's: a dynamic scaler's state means nothing to a static one."""
    saved_config = engine_state.get("config") if isinstance(engine_state, dict) else None
    saved_config = saved_config if isinstance(saved_config, dict) else {}
    saved = None
    if isinstance(optim_state, dict) and isinstance(optim_state.get("scaler"), dict):
        saved = optim_state["scaler"].get("type")
    elif "precision" in saved_config:
        dynamic = dynamic_scaling(saved_config["precision"], saved_config.get("static_loss_scale"))
        saved = "DynamicLossScaler" if dynamic else "StaticLossScaler"
    mine = type(scaler).__name__
    if saved is None or saved == mine:
        return
    then = ""
    if "precision" in saved_config:
        static = saved_config.get("static_loss_scale")
        then = f" (precision={saved_config['precision']!r}, static_loss_scale={static!r})"
    now = f"precision={config.precision!r}, static_loss_scale={config.static_loss_scale!r}"
    raise CheckpointError(
        f"{path} was saved with a {saved}{then} but this engine has a {mine} ({now}): its loss-scaler state "
        "cannot be loaded. Set the config's precision and static_loss_scale as when it was saved, or pass "
        "load_optimizer_states=False to load the weights only (no optimizer or loss-scaler state then)"
    )


def keep_scaler_settings(path: Path, scaler: LossScaler, configured: dict[str, Any]) -> None:
    """After a load, put back the scaler settings the engine was built with (``configured``, the scaler's
    ``state_dict()`` taken before the load); the state stays the checkpoint's. One warning lists what
    differed, with both values."""
    loaded = scaler.state_dict()
    scaler.load_state_dict(configured)
    kept = scaler.load_state_dict(loaded, keep_settings=True)
    changes = [
        f"{config_name(scaler, k)} {saved!r} -> {mine!r}" for k, (saved, mine) in kept.differed.items()
    ]
    changes += kept.adjusted
    if changes:
        warnings.warn(
            f"{path}: the checkpoint's loss-scaler settings differ from this engine's config, which wins (the "
            f"scale, growth tracker and hysteresis budget come from the checkpoint): checkpoint -> config: "
            f"{'; '.join(changes)}",
            RuntimeWarning,
            stacklevel=3,
        )
