"""Checkpoint state of the fused optimizers, in the generic path's format, so checkpoints move between the paths.

``state_dict()`` returns what ``MixedPrecisionOptimizer.state_dict()`` returns: ``format``, ``optimizer`` (a
torch-format optimizer state dict: per-param ``step``/``exp_avg``/``exp_avg_sq`` etc. and the param groups),
``masters`` (fp32 masters of 16-bit params by param index), ``params`` (shape/dtype/master per param), ``scaler``
and ``skipped_steps``. ``load_state_dict()`` takes that, or a plain torch optimizer state dict.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CheckpointMixin"]


class CheckpointMixin:
    def state_dict(self) -> dict[str, Any]:
        self._reporter.drain(wait=True)
        self._ensure_state()
        steps = self._steps.cpu().tolist()
        state: dict[int, dict[str, Any]] = {}
        masters: dict[int, torch.Tensor] = {}
        groups = []
        k = 0
        for group in self.param_groups:
            saved = {key: v for key, v in group.items() if key != "params"}
            saved["params"] = list(range(k, k + len(group["params"])))
            groups.append(saved)
            for p in group["params"]:
                i = self._index.get(p)
                is_master = i is not None and p.dtype != torch.float32
                if i is not None:
                    exported = self._export_state(i, steps[i])
                    if exported:
                        state[k] = exported
                    if is_master:
                        chunk, local = self._where[i]
                        masters[k] = chunk.master_views[local].clone()
                k += 1
        return {
            "format": self._FORMAT,
            "optimizer": {"state": state, "param_groups": groups},
            "masters": masters,
            "params": self._param_entries(),
            "scaler": self.loss_scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def _param_entries(self) -> list[dict[str, Any]]:
        return [
            {
                "shape": list(p.shape),
                "dtype": str(p.dtype),
                "master": p in self._index and p.dtype != torch.float32,
            }
            for p in self._all
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the generic path's checkpoint format, or a plain torch optimizer state dict (masters are then
        taken from the model's current weights)."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"expected a state dict, got {type(state_dict).__name__}")
        if state_dict.get("format") == self._FORMAT:
            self._check_compatible(state_dict["params"])
            inner = state_dict["optimizer"]
        elif "state" in state_dict and "param_groups" in state_dict:
            inner, state_dict = state_dict, None
        else:
            raise ValueError(f"not a halfprec or torch optimizer state dict (keys {sorted(state_dict)[:6]})")
        saved_groups = inner["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError(
                "state dict has a different number of param groups or params per group than this optimizer"
            )
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            for key, v in saved.items():
                if key != "params":
                    group[key] = v
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, gi)
        self._hp_key = None
        self._prepare_step()
        steps = [0.0] * len(self._trainable)
        with torch.no_grad():
            self._ensure_state()
            for chunk in self._chunks:
                for buf in chunk.state.values():
                    buf.zero_()
            self._init_state()
            saved_state = {int(k): v for k, v in inner["state"].items()}
            for k, p in enumerate(self._all):
                i = self._index.get(p)
                if i is not None and k in saved_state:
                    steps[i] = self._import_state(i, saved_state[k])
            self._steps.copy_(torch.tensor(steps or [0.0], dtype=torch.float32))
            if state_dict is not None:
                for k, value in state_dict["masters"].items():
                    i = self._index[self._all[int(k)]]
                    chunk, local = self._where[i]
                    chunk.master_views[local].copy_(value)
                for chunk in self._chunks:
                    chunk.write_params()
                self.loss_scaler.load_state_dict(state_dict["scaler"])
                self._scalars[3].fill_(float(state_dict["skipped_steps"]))
