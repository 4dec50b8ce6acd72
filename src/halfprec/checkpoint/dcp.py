"""Reshardable optimizer checkpoints through ``torch.distributed.checkpoint``, keyed by parameter name.

Public as ``halfprec.distributed.checkpoint`` (``save``/``load``); lives here, next to the engine's format, so that
both share one atomic commit and one record of the layout.

Layout of a checkpoint directory (model space: nothing depends on the world size that wrote it):

=============================  =====================================================================
``master/{name}``              fp32 master weights, flattened to 1-D (``numel`` elements)
``state/{name}/{key}``         optimizer state: 1-D like the master when elementwise, else 0-d
``shape/{name}``               int64 shape of the param; ``group/{name}``: its param-group index
``hparam/{group}/{key}``       numeric group hyper-parameters (lr, betas, weight_decay, ...), fp64
``scaler/{key}``               loss-scaler state and settings; ``counters/skipped_steps``; ``format/version``
``manifest.json``              written by rank 0 last: ``{"format": "halfprec-dcp/1"}`` (``formats.layout_of``)
=============================  =====================================================================

Every item is a tensor, so loading never unpickles anything but ``.metadata``, and that through an allow-list
(``_safe_dcp``). State is allocated from the checkpoint's own metadata before DCP loads into it, so no state
key can be silently left out (DCP loads in place and skips what the destination does not hold).

A save is atomic: every rank writes into ``{path}.tmp`` (held by rank 0, see ``atomic.held``); after a barrier
rank 0 commits it to ``path`` with ``atomic.commit``, which replaces an existing ``path`` crash-safely. A rank
that dies mid-save leaves only ``.tmp`` behind, removed by the next save, and the previous checkpoint untouched.

Every branch on the optimizer's type and every read of its private attributes is in the two functions of the
section "optimizer access" (:func:`_model_space`, :func:`_set_counters`), to become optimizer methods.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..optim.base import MixedPrecisionOptimizer
from ..optim.sharded import ShardedMixedPrecisionOptimizer
from ..optim.sharded.checks import named_trainable
from ..optim.state import is_elementwise
from .atomic import commit, fsync_path, held, located, remove_if_dead
from .formats import DCP_FORMAT, MANIFEST
from .safe_dcp import ChunkLoadPlanner, ChunkSavePlanner, SafeFileSystemReader, read_metadata, refuse_bytes

__all__ = ["save", "load", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when no group is initialized: that is the intent here."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(group) -> None:
    if _distributed():
        dist.barrier(group=group)


def _rank(group) -> int:
    return dist.get_rank(group) if _distributed() else 0


# --- optimizer access: the only type branches ----------------------------------------------------------------
def _model_space(optimizer, named_parameters) -> tuple[list, list, bool]:
    """``(held, every, sharded)``: ``held`` is ``(name, shape, group, lo, fp32 tensor to save/load,
    writes_scalars)`` per param this rank holds, ``every`` is ``(name, shape, group)`` per param of the model.

    Reads ``ShardedMixedPrecisionOptimizer.model_space()`` and ``MixedPrecisionOptimizer.model_params()``.
    """
    if isinstance(optimizer, ShardedMixedPrecisionOptimizer):
        space = list(optimizer.model_space())
        held = [(n, s, g, piece.lo, p, piece.lo == 0) for n, s, g, piece, p in space if piece is not None]
        return held, [(n, s, g) for n, s, g, _, _ in space], True
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise ValueError(
            f"expected a ShardedMixedPrecisionOptimizer or MixedPrecisionOptimizer, got {type(optimizer).__name__}"
        )
    if optimizer.impl != "torch":
        # its state lives in flat buffers, not in a torch optimizer's ``state`` keyed by the masters
        raise ValueError(
            f"halfprec.distributed.checkpoint does not take the fused {type(optimizer).__name__} yet; save it with "
            "Engine.save_checkpoint or torch.save(optimizer.state_dict()), or build it with impl='torch'"
        )
    if named_parameters is None:
        raise ValueError("a MixedPrecisionOptimizer checkpoint is keyed by name: pass named_parameters=model")
    # the inner optimizer's params (masters, or fp32 params that are their own) pair with the model's params
    inner = [p for g in optimizer.param_groups for p in g["params"]]
    model = optimizer.model_params()
    names, params, groups = named_trainable(_Groups(model, optimizer.param_groups), named_parameters)
    master_of = {id(m): i for m, i in zip(model, inner, strict=True)}
    held = [(n, p.shape, g, 0, master_of[id(p)], True) for n, p, g in zip(names, params, groups, strict=True)]
    return held, [(n, s, g) for n, s, g, *_ in held], False


def _set_counters(optimizer, sharded: bool, scaler_state: dict, skipped: int) -> None:
    """Set the loss scaler's state and the skipped-step counter, once masters, state and groups are in place.

    Sharded: ``restore_counters`` (it also rounds the masters into the model). Unsharded: the optimizer's own
    ``load_state_dict`` sets its counters and scaler and rounds the masters into the model.
    """
    if sharded:
        optimizer.restore_counters(scaler_state, skipped)
    else:
        full = optimizer.state_dict()
        full["scaler"], full["skipped_steps"] = scaler_state, skipped
        optimizer.load_state_dict(full)


# --- what a checkpoint holds ------------------------------------------------------------------------------
class _Groups:
    """The model's params arranged in the inner optimizer's groups (what ``named_trainable`` walks)."""

    def __init__(self, model: list, groups: list[dict]) -> None:
        it = iter(model)
        self.param_groups = [{"params": [next(it) for _ in g["params"]]} for g in groups]


def _global_items(optimizer, entries_all: list) -> dict[str, torch.Tensor]:
    items: dict[str, torch.Tensor] = {"format/version": torch.tensor(FORMAT_VERSION, dtype=torch.int64)}
    for gi, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            tensor = _hparam_tensor(value)
            if key not in ("params", "param_names") and tensor is not None:
                items[f"hparam/{gi}/{key}"] = tensor
    for key, value in optimizer.loss_scaler.state_dict().items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            dtype = torch.int64 if isinstance(value, int) else torch.float64
            items[f"scaler/{key}"] = torch.tensor(value, dtype=dtype)
    items["counters/skipped_steps"] = torch.tensor(optimizer.skipped_steps, dtype=torch.int64)
    for name, shape, group in entries_all:
        items[f"shape/{name}"] = torch.tensor(list(shape), dtype=torch.int64)
        items[f"group/{name}"] = torch.tensor(group, dtype=torch.int64)
    return items


def _hparam_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, bool) or value is None:
        return None
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=torch.float64)
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


# --- save -------------------------------------------------------------------------------------------------
def save(optimizer, path: str | os.PathLike, *, named_parameters=None, process_group=None) -> Path:
    """Write ``optimizer`` (sharded or not) to the directory ``path``, atomically. Collective when distributed.

    ``named_parameters`` (the model) is needed for a ``MixedPrecisionOptimizer``. Returns ``path``.
    """
    path = Path(path)
    group = getattr(optimizer, "process_group", process_group)
    rank = _rank(group)
    entries, every, sharded = _model_space(optimizer, named_parameters)
    state_dict: dict[str, torch.Tensor] = {}
    chunks: dict[str, tuple[int, int]] = {}
    writes_replicated = rank == 0 or sharded  # unsharded: every rank holds the same; rank 0 writes it
    for name, shape, _group, lo, tensor, scalars in entries if writes_replicated else []:
        numel = math.prod(shape)
        if numel == 0:
            continue
        key = f"master/{name}"
        state_dict[key] = tensor.detach().reshape(-1)
        chunks[key] = (lo, numel)
        for skey, value in optimizer.state.get(tensor, {}).items():
            item = f"state/{name}/{skey}"
            if not torch.is_tensor(value):
                raise ValueError(
                    f"optimizer state {skey!r} of {name!r} is a {type(value).__name__}, not a tensor; halfprec "
                    "checkpoints hold tensors only"
                )
            if is_elementwise(skey, value, tensor.shape):
                state_dict[item] = value.detach().reshape(-1)
                chunks[item] = (lo, numel)
            elif value.dim() == 0:
                if scalars:
                    state_dict[item] = value.detach()
            else:
                raise ValueError(
                    f"optimizer state {skey!r} of {name!r} has shape {tuple(value.shape)}: not elementwise"
                )
    if rank == 0:
        state_dict.update(_global_items(optimizer, every))
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.ExitStack() as hold:
        if rank == 0:
            _fresh_tmp(tmp, path)
            hold.enter_context(held(tmp))  # until committed: no other save takes it for a leftover
        _barrier(group)
        with _quiet_single_process():
            dcp.save(
                state_dict,
                storage_writer=FileSystemWriter(str(tmp)),
                planner=ChunkSavePlanner(chunks),
                process_group=group,
                no_dist=not _distributed(),
            )
        _barrier(group)
        if rank == 0:
            _write_manifest(tmp)
            commit(tmp, path)
    _barrier(group)
    return path


def _fresh_tmp(tmp: Path, path: Path) -> None:
    """Create ``tmp``, removing the one a killed save left; refuse the one of a save still running."""
    if (tmp.exists() or tmp.is_symlink()) and not remove_if_dead(tmp):
        raise FileExistsError(
            f"{tmp} is being written by another save of {path} that is still running; wait for it to finish or "
            "save to another path"
        )
    tmp.mkdir(parents=True)


def _write_manifest(tmp: Path) -> None:
    """Record the layout (``formats.layout_of`` reads it), after every rank's files are in; fsync the directory."""
    with open(tmp / MANIFEST, "w") as f:
        json.dump({"format": DCP_FORMAT, "format_version": FORMAT_VERSION}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(tmp)


# --- load -------------------------------------------------------------------------------------------------
def load(optimizer, path: str | os.PathLike, *, named_parameters=None, process_group=None) -> None:
    """Load a checkpoint written at any world size into ``optimizer`` (sharded or not). Collective when distributed."""
    path = located(Path(path))  # a replace that died midway left the previous checkpoint aside
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no .metadata); was the save interrupted?"
        )
    group = getattr(optimizer, "process_group", process_group)
    metadata = read_metadata(path)
    saved = metadata.state_dict_metadata
    refuse_bytes(metadata, saved.keys())
    version = saved.get("format/version")
    if version is None:
        raise ValueError(f"{path} is not a halfprec optimizer checkpoint (no format/version item)")
    entries, every, sharded = _model_space(optimizer, named_parameters)
    _check_names(path, saved, every)

    state_dict: dict[str, torch.Tensor] = {}
    chunks: dict[str, int] = {}
    plans = []  # (tensor, {key: item name})
    for name, shape, _group, lo, tensor, _ in entries:
        numel = math.prod(shape)
        if numel == 0:
            continue
        key = f"master/{name}"
        state_dict[key] = torch.empty(tensor.numel(), dtype=torch.float32)
        chunks[key] = lo
        wanted = {}
        prefix = f"state/{name}/"
        for item, md in saved.items():
            if not item.startswith(prefix):
                continue
            skey = item[len(prefix) :]
            if tuple(md.size) == (numel,):
                state_dict[item] = torch.empty(tensor.numel(), dtype=md.properties.dtype)
                chunks[item] = lo
            else:
                state_dict[item] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            wanted[skey] = item
        plans.append((name, shape, tensor, wanted))
    for item, md in saved.items():
        if item.startswith(("hparam/", "scaler/", "counters/", "group/", "shape/")):
            state_dict[item] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    with _quiet_single_process():
        dcp.load(
            state_dict,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=ChunkLoadPlanner(chunks),
            process_group=group,
            no_dist=not _distributed(),
        )
    _apply(optimizer, sharded, state_dict, plans, set(chunks), path)


def _check_names(path: Path, saved: dict, names: list) -> None:
    mine = {n: (s, g) for n, s, g in names if math.prod(s) > 0}
    theirs = {k[len("master/") :] for k in saved if k.startswith("master/")}
    missing, extra = sorted(set(mine) - theirs), sorted(theirs - set(mine))
    if missing or extra:
        raise ValueError(
            f"{path} does not match this model: missing params {missing}, unexpected params {extra}"
        )
    for name, (shape, _) in mine.items():
        if tuple(saved[f"master/{name}"].size) != (math.prod(shape),):
            raise ValueError(
                f"{path}: param {name!r} has {saved[f'master/{name}'].size} elements saved, shape {tuple(shape)} here"
            )


@torch.no_grad()
def _apply(
    optimizer, sharded: bool, loaded: dict[str, torch.Tensor], plans: list, chunked: set, path: Path
) -> None:
    for name, shape, tensor, wanted in plans:
        if tuple(loaded[f"shape/{name}"].tolist()) != tuple(shape):
            raise ValueError(
                f"{path}: param {name!r} was saved with shape {loaded[f'shape/{name}'].tolist()}"
            )
        tensor.copy_(loaded[f"master/{name}"].view(tensor.shape))
        group = optimizer.param_groups[int(loaded[f"group/{name}"])]
        if not any(p is tensor for p in group["params"]):
            raise ValueError(
                f"{path}: param {name!r} was saved in param group {int(loaded[f'group/{name}'])}"
            )
        on_device = group.get("capturable", False) or group.get("fused", False)
        state = {}
        for skey, item in wanted.items():
            value = loaded[item]
            if item in chunked:
                state[skey] = value.view(tensor.shape).to(tensor.device)
            else:
                state[skey] = value.to(tensor.device if on_device else "cpu")
        if state:
            optimizer.state[tensor] = state
        else:
            optimizer.state.pop(tensor, None)
    for gi, group in enumerate(optimizer.param_groups):
        for key in list(group):
            item = f"hparam/{gi}/{key}"
            if item in loaded:
                group[key] = _restore_hparam(group[key], loaded[item])
    scaler_sd = optimizer.loss_scaler.state_dict()
    for key, value in scaler_sd.items():
        if f"scaler/{key}" in loaded:
            scaler_sd[key] = _number(value, loaded[f"scaler/{key}"].item())
    _set_counters(optimizer, sharded, scaler_sd, int(loaded["counters/skipped_steps"]))


def _restore_hparam(live: Any, saved: torch.Tensor) -> Any:
    if torch.is_tensor(live):
        return saved.to(device=live.device, dtype=live.dtype)
    if isinstance(live, tuple):
        return tuple(_number(v, x) for v, x in zip(live, saved.tolist(), strict=True))
    return _number(live, saved.item())


def _number(live: Any, saved: float | int) -> Any:
    """The saved value, in the live value's type when that loses nothing: an optimizer built with ``lr=1`` (an
    int) and scheduled to 0.25 resumes at 0.25, not ``int(0.25) == 0``; an int setting stays an int."""
    if isinstance(live, int) and not isinstance(live, bool) and float(saved).is_integer():
        return int(saved)
    if isinstance(live, (int, float)) and not isinstance(live, bool):
        return float(saved)
    return type(live)(saved)
