"""Resuming the engine's loss scaler: refuse another scaler kind before anything is loaded, and keep the
config's scaler settings over the checkpoint's (its dynamic state comes from the checkpoint)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError
from .config import Config
from .scaler import LossScaler

__all__ = ["check_scaler_kind", "keep_scaler_settings"]


def check_scaler_kind(
    path: Path, engine_state: Any, optim_state: Any, scaler: LossScaler, config: Config
) -> None:
    """Raise CheckpointError when the checkpoint's loss scaler is of another kind than this engine's.

    The kind comes from the optimizer file (unsharded) or from the saved config (sharded files do not store
    it): a dynamic scaler's state loaded into a static one, or the reverse, has no meaning.
    """
    saved_config = engine_state.get("config") if isinstance(engine_state, dict) else None
    saved_config = saved_config if isinstance(saved_config, dict) else {}
    saved = None
    if isinstance(optim_state, dict) and isinstance(optim_state.get("scaler"), dict):
        saved = optim_state["scaler"].get("type")
    elif "precision" in saved_config:
        dynamic = saved_config["precision"] == "fp16" and saved_config.get("static_loss_scale") is None
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
    """After a load, put back the scaler settings the engine was built with (its config wins); the dynamic
    state (scale, growth tracker, hysteresis budget left) stays the checkpoint's. One warning lists what
    differed, with both values.

    The scaler's own ``load_state_dict`` takes the saved settings too, which would leave ``engine.config``
    saying one thing (say ``min_scale=1`` after a min-scale warning) while the scaler does another.
    """
    loaded = scaler.state_dict()
    dynamic = scaler.is_dynamic
    state_keys = ("type", "scale", "growth_tracker", "hysteresis_left") if dynamic else ("type",)
    wanted = dict(loaded)
    wanted.update({k: v for k, v in configured.items() if k not in state_keys})
    if wanted == loaded:
        return
    # init_scale is where a fresh scaler starts (no effect on a resumed one; a static one's equals its scale)
    names = {"scale": "static_loss_scale"}
    changes = [
        f"{names.get(k, k)} {loaded.get(k)!r} -> {v!r}"
        for k, v in wanted.items()
        if k not in state_keys and k != "init_scale" and loaded.get(k) != v
    ]
    if dynamic and wanted["scale"] < wanted["min_scale"]:
        changes.append(f"the checkpoint's scale {wanted['scale']:g} raised to min_scale")
        wanted["scale"] = wanted["min_scale"]
    if dynamic and wanted["hysteresis_left"] > wanted["hysteresis"]:
        changes.append(
            f"the hysteresis budget left lowered from {wanted['hysteresis_left']} to {wanted['hysteresis']}"
        )
        wanted["hysteresis_left"] = wanted["hysteresis"]
    scaler.load_state_dict(wanted)
    if changes:
        warnings.warn(
            f"{path}: the checkpoint's loss-scaler settings differ from this engine's config, which wins (the "
            f"scale, growth tracker and hysteresis budget come from the checkpoint): checkpoint -> config: "
            f"{'; '.join(changes)}",
            RuntimeWarning,
            stacklevel=3,
        )
