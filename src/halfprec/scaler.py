"""Loss scalers, static and dynamic: state in 0-d device tensors updated without a host sync (the fused
optimizers share them), every scale a power of two so that scaling and unscaling are exact."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._checks import DYNAMIC_SETTINGS, check_dynamic_settings, check_power_of_two

__all__ = ["DynamicLossScaler", "KeptSettings", "LossScaler", "ScalerKindError", "StaticLossScaler"]


class ScalerKindError(ValueError):
    """A loss-scaler state of another kind (``saved``) than the scaler's (``mine``)."""

    def __init__(self, message: str, saved: str, mine: str) -> None:
        super().__init__(message)
        self.saved, self.mine = saved, mine


class KeptSettings(NamedTuple):
    """What ``load_state_dict(..., keep_settings=True)`` did not take from the state dict."""

    differed: dict[str, tuple[Any, Any]]
    """setting -> (saved, kept), for each saved setting that differed from this scaler's (constructor names)."""
    adjusted: list[str]
    """The loaded state moved into the kept settings' range, in words."""


class LossScaler:
    """Common interface of the scalers: ``scale`` (a 0-d fp32 tensor), ``inv_scale()`` and ``update(found_inf)``."""

    def __init__(self, init_scale: float) -> None:
        self._init_scale = init_scale
        self._state: dict[str, torch.Tensor] = {}
        self._device: torch.device | None = None

    # --- state placement -------------------------------------------------------------------------------
    def _fresh_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {"scale": torch.tensor(self._init_scale, dtype=torch.float32, device=device)}

    def to(self, device: torch.device | str) -> LossScaler:
        """Place the state on ``device`` (the optimizer calls this with its params' device)."""
        device = torch.device(device)
        if self._device == device:
            return self
        if self._state:
            self._state = {k: v.to(device) for k, v in self._state.items()}
        else:
            self._state = self._fresh_state(device)
        self._device = device
        return self

    def _ensure(self) -> dict[str, torch.Tensor]:
        if not self._state:
            self.to("cpu")
        return self._state

    @property
    def device(self) -> torch.device:
        return self._ensure()["scale"].device

    @property
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The live 0-d state tensors by name (``scale``; a dynamic scaler's ``growth_tracker`` and
        ``hysteresis_left``), for kernels that update them in place; empty until the state is placed."""
        return dict(self._state)

    @property
    def scale(self) -> torch.Tensor:
        """The current scale (no sync)."""
        return self._ensure()["scale"]

    @property
    def loss_scale(self) -> float:
        """The current scale as a Python float (syncs with the device)."""
        return float(self.scale.item())

    def inv_scale(self) -> torch.Tensor:
        # fp64 reciprocal, then fp32: exact for the powers of two we allow.
        return self.scale.double().reciprocal().float()

    is_dynamic: bool = False

    @property
    def is_unit(self) -> bool:
        """True for a static scale of 1: no scaling at all (known on the host, no sync)."""
        return not self.is_dynamic and self._init_scale == 1.0

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the schedule after a step; ``found_inf``: a 0-d float on the state's device, 1.0 on overflow."""

    def at_min_scale(self) -> torch.Tensor:
        """A 0-d bool tensor: true when an overflow can no longer lower the scale."""
        return torch.ones((), dtype=torch.bool, device=self.device)

    def step_update(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Update after a step and return ``[found_inf, was_at_min_scale, scale_before, scale_after]`` as one fp32
        tensor on the state's device, for the caller's single host read (no sync here)."""
        before = torch.stack(
            [found_inf.to(self.device, torch.float32), self.at_min_scale().float(), self.scale]
        )
        self.update(found_inf)
        return torch.cat([before, self.scale.reshape(1)])

    # --- checkpoint state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {k: v.item() for k, v in self._ensure().items()}
        return {"type": type(self).__name__, **state, **self._config()}

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise ValueError unless ``state_dict`` is the state of a scaler of this kind (changes nothing)."""
        kind = state_dict.get("type") if isinstance(state_dict, dict) else type(state_dict).__name__
        if kind != type(self).__name__:
            raise ScalerKindError(
                f"cannot load a {kind!r} loss-scaler state into a {type(self).__name__}: build the optimizer with "
                f"the kind of loss scaler it was saved with (loss_scaler=halfprec.{kind}(...), or the same "
                "precision and loss scaling settings), or load only the weights",
                str(kind),
                type(self).__name__,
            )

    def load_state_dict(self, state_dict: dict[str, Any], *, keep_settings: bool = False) -> KeptSettings:
        """Load what ``state_dict()`` returned: settings and state, or with ``keep_settings=True`` the state only.

        ``keep_settings=True`` is the engine's resume policy: the settings this scaler was built with (and its
        config says) win; the dynamic state comes from ``state_dict``, moved into their range (a scale below
        ``min_scale`` raised to it, a budget above ``hysteresis`` lowered to it). The result lists what
        differed, for the caller's warning (empty without ``keep_settings``). A ValueError changes nothing.
        """
        self.check_state_dict(state_dict)
        loaded = self._checked_settings(state_dict)
        kept = KeptSettings({}, [])
        if keep_settings:
            state_dict, kept = self._with_own_settings(state_dict)
        else:
            for setting, value in loaded.items():
                setattr(self, self._attribute(setting), value)
        for key, tensor in self._ensure().items():  # not placed yet: on the CPU, until the optimizer moves it
            tensor.fill_(state_dict[key])
        return kept

    # The constructor's setting names, the initial scale first (kept in _init_scale, the others in attributes
    # of their names), and the keys state_dict() saves them under where those differ
    _SETTINGS: tuple[str, ...] = ()
    _SAVED_AS: dict[str, str] = {}
    # Settings a resumed scaler does not use (a dynamic one's init_scale: only where a fresh one starts)
    _NO_EFFECT_ON_RESUME: tuple[str, ...] = ()

    def _attribute(self, setting: str) -> str:
        return "_init_scale" if setting == self._SETTINGS[0] else setting

    def settings(self) -> dict[str, Any]:
        """The constructor's keyword arguments for a scaler with these settings (no state)."""
        return {k: getattr(self, self._attribute(k)) for k in self._SETTINGS}

    def _config(self) -> dict[str, Any]:
        return {self._SAVED_AS.get(k, k): v for k, v in self.settings().items()}

    def _saved_settings(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Under the constructor's names, None where missing."""
        return {k: state_dict.get(self._SAVED_AS.get(k, k)) for k in self._SETTINGS}

    def _with_own_settings(self, saved: dict[str, Any]) -> tuple[dict[str, Any], KeptSettings]:
        mine, theirs = self.settings(), self._saved_settings(saved)
        differed = {
            k: (theirs[k], v)
            for k, v in mine.items()
            if k not in self._NO_EFFECT_ON_RESUME and theirs[k] != v
        }
        wanted = {**saved, **self._config()}
        return wanted, KeptSettings(differed, self._fit_state(wanted))

    def _fit_state(self, wanted: dict[str, Any]) -> list[str]:
        """Move the state in ``wanted`` (saved state, own settings) into the settings' range; say what moved."""
        return []

    def _checked_settings(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The settings ``state_dict`` holds, as the constructor checks and keeps them."""
        saved = {k: self._SAVED_AS.get(k, k) for k in self._SETTINGS}
        given = {k: state_dict[key] for k, key in saved.items() if key in state_dict}
        try:
            checked = type(self)(**given).settings()
        except (TypeError, ValueError) as e:
            raise ValueError(f"loss-scaler state dict holds invalid settings: {e}") from e
        if "scale" in state_dict:
            check_power_of_two("scale", state_dict["scale"])
        return {k: checked[k] for k in given}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({fields})"


class StaticLossScaler(LossScaler):
    """A fixed loss scale. ``StaticLossScaler(1.0)`` turns scaling off."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__(check_power_of_two("scale", scale))

    _SETTINGS = ("scale",)
    _SAVED_AS = {"scale": "init_scale"}

    def _saved_settings(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # the state dict holds the scale twice (scale, init_scale); scale is the one the steps used
        return {"scale": state_dict.get("scale")}

    def _fit_state(self, wanted: dict[str, Any]) -> list[str]:
        wanted["scale"] = self._init_scale  # a static scaler's scale is its setting, not state
        return []


class DynamicLossScaler(LossScaler):
    """Dynamic loss scale, updated on the device after every step.

    Schedule (counted in optimizer steps, skipped ones included):

    * a clean step increments ``growth_tracker``; after ``growth_interval`` consecutive clean steps the scale is
      multiplied by ``growth_factor`` (unless that would not be finite), and the tracker and the hysteresis
      budget are reset;
    * an overflowing step resets ``growth_tracker`` and spends one unit of the hysteresis budget; when the
      budget is exhausted (``hysteresis`` overflows since the last growth or backoff) the scale is multiplied by
      ``backoff_factor``, never going below ``min_scale``, and the budget is refilled (DeepSpeed and Megatron
      refill it on growth only: docs/guarantees.md).

    An overflow at ``min_scale`` cannot lower the scale any more; the optimizer warns when that happens.
    """

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        checked = check_dynamic_settings(
            dict(
                init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale,
            )
        )  # fmt: skip
        super().__init__(checked.pop("init_scale"))
        for setting, value in checked.items():  # growth_factor, ..., min_scale: attributes of their names
            setattr(self, setting, value)

    def _fresh_state(self, device: torch.device) -> dict[str, torch.Tensor]:
        state = super()._fresh_state(device)
        state["growth_tracker"] = torch.zeros((), dtype=torch.int64, device=device)
        state["hysteresis_left"] = torch.full((), self.hysteresis, dtype=torch.int64, device=device)
        return state

    def update(self, found_inf: torch.Tensor) -> None:
        state = self._ensure()
        scale, tracker, left = state["scale"], state["growth_tracker"], state["hysteresis_left"]
        overflow = found_inf.to(device=scale.device) > 0

        tracker_next = torch.where(overflow, torch.zeros_like(tracker), tracker + 1)
        grow = tracker_next >= self.growth_interval
        left_after_overflow = left - 1
        backoff = overflow & (left_after_overflow <= 0)

        grown = scale * self.growth_factor
        grown = torch.where(torch.isfinite(grown), grown, scale)
        backed_off = torch.clamp(scale * self.backoff_factor, min=self.min_scale)
        new_scale = torch.where(backoff, backed_off, torch.where(grow, grown, scale))

        refill = backoff | grow
        new_left = torch.where(
            refill, torch.full_like(left, self.hysteresis), torch.where(overflow, left_after_overflow, left)
        )
        scale.copy_(new_scale)
        left.copy_(new_left)
        tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker_next))

    def at_min_scale(self) -> torch.Tensor:
        return self.scale <= self.min_scale

    is_dynamic = True
    _SETTINGS = DYNAMIC_SETTINGS
    _NO_EFFECT_ON_RESUME = ("init_scale",)

    def _fit_state(self, wanted: dict[str, Any]) -> list[str]:
        adjusted = []
        if wanted["scale"] < self.min_scale:
            adjusted.append(f"the checkpoint's scale {wanted['scale']:g} raised to min_scale")
            wanted["scale"] = self.min_scale
        if wanted["hysteresis_left"] > self.hysteresis:
            adjusted.append(
                f"the hysteresis budget left lowered from {wanted['hysteresis_left']} to {self.hysteresis}"
            )
            wanted["hysteresis_left"] = self.hysteresis
        return adjusted
