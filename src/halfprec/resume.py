"""The engine's two checks around loading a loss scaler from a checkpoint, worded in its config's names (the
policies are the scaler's: ``check_state_dict``, ``load_state_dict(..., keep_settings=True)``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError
from .config import Config, config_name
from .scaler import LossScaler, ScalerKindError

__all__ = ["keep_scaler_settings", "scaler_kind_error"]


def scaler_kind_error(
    path: Path, error: ValueError, engine_state: dict[str, Any], config: Config
) -> CheckpointError | None:
    """``error`` in the config's terms when a ``ScalerKindError`` caused it (the checkpoint's loss scaler is of
    another kind than this engine's, whose state means nothing to it); else None."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ScalerKindError):
        cause = cause.__cause__
    if cause is None:
        return None
    saved_config = engine_state.get("config")
    then = ""
    if isinstance(saved_config, dict) and "precision" in saved_config:
        static = saved_config.get("static_loss_scale")
        then = f" (precision={saved_config['precision']!r}, static_loss_scale={static!r})"
    now = f"precision={config.precision!r}, static_loss_scale={config.static_loss_scale!r}"
    return CheckpointError(
        f"{path} was saved with a {cause.saved}{then} but this engine has a {cause.mine} ({now}): its loss-scaler state "
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
