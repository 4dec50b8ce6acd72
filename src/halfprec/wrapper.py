"""The torch.optim contract for a wrapper that owns an inner optimizer (forwarding, hook registries).

A wrapper cannot call ``Optimizer.__init__`` (its ``param_groups`` are the inner optimizer's very dicts, so LR
schedulers write where the inner step reads), so it creates the hook registries that ``__init__`` would, as
``Optimizer.__setstate__`` does, and patches ``step`` so that step hooks and torch's global hooks run.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["WrappingOptimizer"]

_HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class WrappingOptimizer(torch.optim.Optimizer):
    """Base of halfprec's optimizers that wrap a torch optimizer: ``param_groups/state/defaults`` forward to it."""

    optimizer: torch.optim.Optimizer

    def _init_wrapper(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        for name in _HOOK_REGISTRIES:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure=None):
        """Run ``closure`` (with grad enabled) if given, then the wrapper's ``_step()``; return the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _step(self) -> None:
        raise NotImplementedError

    def _run_hooks(self, registry: str, state_dict: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Run one of torch's state-dict hook registries; hooks given a state dict may return a new one."""
        for hook in getattr(self, registry).values():
            if state_dict is None:
                hook(self)
            else:
                state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
