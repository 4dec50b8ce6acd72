"""Moving a wrapped optimizer's existing state onto the FP32 masters, or onto this rank's pieces of them, exactly.

One policy for every strategy (docs/guarantees.md):

* state that the optimizer's own constructor created (torch Adagrad's ``sum``) is re-created in fp32 by
  constructing the same class over the targets with the same groups and ``defaults`` and taking its fresh
  state; a 16-bit copy upcast later is not the fp32 value (``0.1`` is ``0.0999755859375`` in fp16);
* a 16-bit state tensor that differs from what the constructor would have made was populated by the user and
  is upcast;
* every other value (fp32 tensors, integer counters, bool masks, non-tensors) is kept as it is;
* a constructor that cannot be re-run falls back to upcasting, with one warning.

A DTensor param's state is its local shard's (``mesh.py``): moved onto a master as plain local tensors; loaded
for a DTensor param that is its own master (fp32 shards), made a DTensor laid out like the param again.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..precision import LOW_PRECISION
from .mesh import as_dtensor, is_dtensor, local

__all__ = [
    "SCALAR_KEYS", "Target", "adopt_views", "is_elementwise", "laid_out_like_params", "local_state", "move_state",
    "restore_state_dtypes", "state_record", "check_has_state",
]  # fmt: skip

# 0-d state entries of the elementwise torch optimizers; every other state tensor has the param's shape. The
# names matter only for 0-d params, whose per-element state is 0-d as well.
SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})


def is_elementwise(key: str, value: torch.Tensor, shape: torch.Size) -> bool:
    """True when state ``key`` holds one value per element of a param of ``shape`` (else it is a scalar)."""
    return value.shape == shape and (value.dim() > 0 or key not in SCALAR_KEYS)


def laid_out_like_params(payload: dict[str, Any], params: list[torch.Tensor]) -> dict[str, Any]:
    """A strategy's payload (``"masters"`` and ``"optimizer"``'s ``"state"``, keyed by param index) with the
    master and the elementwise state of each FSDP2 shard (a DTensor in ``params``) as a DTensor laid out like it,
    sharing the local tensor's storage: the state dict is then the same on every rank but for the rows each holds,
    so ``torch.distributed.checkpoint`` saves each tensor whole and loads it at any world size (plain tensors it
    takes for replicas, keeping one rank's). A payload of unsharded params is returned as it is."""
    if not any(is_dtensor(p) for p in params):
        return payload

    def shaped(k: Any, key: str | None, value: Any) -> Any:
        p = params[int(k)]
        if not (is_dtensor(p) and torch.is_tensor(value)) or is_dtensor(value):
            return value
        if key is None or is_elementwise(key, value, local(p).shape):
            # a view into a larger storage (the exact strategy's masters) is copied: torch.save cannot pickle a
            # DTensor over one that starts inside it (torch 2.13: "invalid python storage"), and would write the
            # whole storage for one that starts at its beginning
            owned = value.untyped_storage().nbytes() == value.numel() * value.element_size()
            return as_dtensor(p, value if owned else value.clone())
        return value

    inner = payload["optimizer"]
    state = {k: {key: shaped(k, key, v) for key, v in entry.items()} for k, entry in inner["state"].items()}
    masters = {k: shaped(k, None, v) for k, v in payload["masters"].items()}
    return payload | {"optimizer": inner | {"state": state}, "masters": masters}


def local_state(state: dict[Any, dict[str, Any]], params: list[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """A torch-format ``state`` (keyed by index into ``params``; int keys, as torch's load maps them) with each
    DTensor value this rank's local tensor where its param is a plain tensor (a shard's master): what a torch
    optimizer over ``params`` loads."""
    return {
        int(k): {
            key: local(v) if is_dtensor(v) and not is_dtensor(params[int(k)]) else v
            for key, v in entry.items()
        }
        for k, entry in state.items()
    }


def state_record(state: dict[Any, Any], n: int) -> torch.Tensor:
    """``has_state``: which of ``n`` params (by index) a torch-format ``state`` holds state for."""
    held = {int(k) for k in state}
    return torch.tensor([k in held for k in range(n)], dtype=torch.bool)


def check_has_state(state_dict: dict[str, Any], n: int) -> None:
    """ValueError unless a state dict's ``has_state`` (absent in those saved before it was recorded) records
    exactly the params of ``n`` that its optimizer state holds state for."""
    held = state_dict.get("has_state")
    if held is None:
        return
    if not (torch.is_tensor(held) and held.dtype == torch.bool and held.shape == (n,)):
        found = f"{held.dtype} {list(held.shape)}" if torch.is_tensor(held) else type(held).__name__
        raise ValueError(
            f"state dict's has_state must be a bool tensor of {n} (one per param), got {found}: the state dict "
            "is damaged or not of this model; load one this optimizer's state_dict() wrote for it"
        )
    present = {int(k) for k in state_dict["optimizer"]["state"]}
    recorded = {k for k, h in enumerate(local(held).tolist()) if h}
    missing, extra = sorted(recorded - present), sorted(present - recorded)
    if missing:
        raise ValueError(
            f"state dict records optimizer state for params {missing} but does not hold it. "
            "torch.distributed.checkpoint's load fills a state dict in place, keeping only the items the "
            "destination already holds, and an optimizer that has not stepped holds no state: save and load with "
            "halfprec.distributed.checkpoint, which allocates the state from the file, or load torch's "
            "checkpoint into an optimizer that has stepped"
        )
    if extra:
        raise ValueError(
            f"state dict holds optimizer state for params {extra} that its has_state does not record: its parts "
            "come from different state dicts; load a state dict as state_dict() wrote it"
        )


class Target(NamedTuple):
    """Where a param's state goes: ``tensor`` holds elements ``[lo, hi)`` of it, the whole param (a master, same
    shape) or a 1-D piece (sharded: elementwise state is sliced to it)."""

    tensor: torch.Tensor
    lo: int
    hi: int


def _fresh_state(optimizer: torch.optim.Optimizer, targets: dict) -> dict:
    groups = []
    for group in optimizer.param_groups:
        mine = [targets[p].tensor for p in group["params"] if targets.get(p) is not None]
        if mine:
            keys = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**keys, "params": mine})
    if not groups:
        return {}
    cls = type(optimizer)
    errors = []
    for kwargs in (dict(optimizer.defaults), {}):
        try:
            return dict(cls(groups, **kwargs).state)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot re-run", reported below
            errors.append(f"{type(e).__name__}: {e}")
    warnings.warn(
        f"halfprec: could not re-run {cls.__name__}.__init__ over the fp32 masters ({errors[-1]}); its eagerly "
        "created 16-bit state is upcast to fp32, which is not the exact fp32 value. Build the optimizer over "
        "an fp32 model and pass param_dtype= to wrap it exactly.",
        RuntimeWarning,
        stacklevel=5,
    )
    return {}


def _is_low_precision(value: Any, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dtype in LOW_PRECISION and value.dtype == param.dtype


def move_state(optimizer: torch.optim.Optimizer, targets: dict) -> None:
    """Re-key ``optimizer.state`` in place: ``targets[param]`` is a ``Target`` (the state moves there) or None
    (another rank holds it: dropped); params not in ``targets`` keep their state (fp32 params that are their
    own masters, frozen ones)."""
    old = optimizer.state
    needs_fresh = any(
        targets.get(p) is not None and any(_is_low_precision(v, p) for v in st.values())
        for p, st in old.items()
    )
    fresh = _fresh_state(optimizer, targets) if needs_fresh else {}
    new: defaultdict = defaultdict(dict)
    for param, st in old.items():
        if param not in targets:
            new[param] = st
            continue
        target = targets[param]
        if target is None or not st:
            continue
        shard = local(param)
        st = {key: local(value) if torch.is_tensor(value) else value for key, value in st.items()}
        whole = target.lo == 0 and target.hi == shard.numel() and target.tensor.shape == shard.shape
        made = fresh.get(target.tensor, {})
        out = {}
        for key, value in st.items():
            if torch.is_tensor(value) and not whole:
                value = value.detach()
                if is_elementwise(key, value, shard.shape):
                    value = value.reshape(-1)[target.lo : target.hi]
                value = value.clone()
            if not _is_low_precision(value, param):
                out[key] = value
                continue
            # the constructor's fresh fp32 value when the 16-bit one is its rounding, else the user's, upcast
            fresh_value = made.get(key)
            exact = (
                torch.is_tensor(fresh_value)
                and fresh_value.shape == value.shape
                and torch.equal(fresh_value.to(value.dtype), value)
            )
            out[key] = fresh_value if exact else value.to(torch.float32)
        new[target.tensor] = out
    optimizer.state = new


def restore_state_dtypes(optimizer: torch.optim.Optimizer, saved_state: dict, params: list) -> None:
    """Undo ``Optimizer.load_state_dict``'s cast of every state tensor to the param's dtype (non-tensors too:
    torch's cast turns a string into a generator), and copy every tensor the load left shared with ``saved_state``
    (torch keeps a reference where no cast is needed: two optimizers loaded from one in-process state dict, or
    the saver and the loader, would otherwise step one state). ``params``: the optimizer's, in ``saved_state``'s
    index order."""
    for index, saved in saved_state.items():
        live = optimizer.state.get(params[index])
        if live is None:
            continue
        for key, value in saved.items():
            current = live.get(key)
            if not torch.is_tensor(value):
                live[key] = value
            elif not torch.is_tensor(current):
                continue
            elif not (value.is_floating_point() or value.is_complex()):  # counters and masks
                if current.dtype != value.dtype or current.device != value.device or _shared(current, value):
                    live[key] = value.clone()
            elif current.dtype != value.dtype:
                live[key] = value.to(device=current.device, copy=True)
            elif _shared(current, value):
                live[key] = current.clone()
        param = params[index]
        if is_dtensor(param):  # state loaded as local shards (a DCP load) becomes the param's layout again
            shape = local(param).shape
            for key, value in live.items():
                if torch.is_tensor(value) and not is_dtensor(value) and is_elementwise(key, value, shape):
                    live[key] = as_dtensor(param, value)


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = local(a), local(b)
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.device == b.device


def adopt_views(state: dict, names: Iterable[str], view: Callable[[str], torch.Tensor]) -> None:
    """Copy ``state``'s tensors ``names`` (where present) into ``view(name)``, a view of a flat fp32 buffer, and
    put the view in their place: one launch then updates them all."""
    for name in names:
        value = state.get(name)
        if value is None:
            continue
        target = view(name)
        if value.data_ptr() != target.data_ptr():
            with torch.no_grad():
                target.copy_(value.reshape(target.shape))
            state[name] = target
