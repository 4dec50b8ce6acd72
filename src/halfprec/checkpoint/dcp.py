"""Reshardable optimizer checkpoints through ``torch.distributed.checkpoint``, keyed by parameter name.

Public as ``halfprec.distributed.checkpoint``. Items of a checkpoint directory (model space: nothing depends on
the world size that wrote it):

=============================  =====================================================================
``master/{name}``              fp32 master weights, flattened to 1-D (``numel`` elements)
``state/{name}/{key}``         optimizer state: 1-D like the master when elementwise, else 0-d
``shape/{name}``               int64 shape of the param; ``group/{name}``: its param-group index
``hparam/{group}/{key}``       numeric group hyper-parameters (lr, betas, weight_decay, ...), fp64
``scaler/{key}``               loss-scaler state and settings; ``counters/skipped_steps``; ``format/version``
``kind/optimizer/{name}``      the optimizer (``algorithm()``) and ``kind/scaler/{type}`` the loss scaler: 1
``manifest.json``              written by rank 0 last (``manifest.seal``): the format, the directory's name,
                               each file's size and SHA-256, its own SHA-256; verified before any file is read
=============================  =====================================================================

``{name}`` is the param's clean name (``optim/names.py``: without torch.compile's ``_orig_mod.``), so a model saved
compiled loads uncompiled and back. Every item is a tensor, so loading unpickles only ``.metadata``, through an
allow-list (``safe_dcp``). State is allocated from the checkpoint's own metadata, so no state key can be silently
left out (DCP loads in place and skips what the destination does not hold). The one branch on the optimizer's type
is :func:`_model_space`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from .._checks import is_number
from ..optim.base import MixedPrecisionOptimizer
from ..optim.mesh import Mesh
from ..optim.mesh import local as local_shard
from ..optim.names import clean_keys, named_trainable
from ..optim.sharded import ShardedMixedPrecisionOptimizer
from ..optim.state import is_elementwise, laid_out_like_params, state_record
from .atomic import commit, remove_if_dead
from .atomic import held as held_dir  # ``held`` names what a rank holds here
from .consolidate import hparam_groups
from .manifest import DCP, DCP_FORMAT, MANIFEST, reraised, writing
from .manifest import seal as seal_directory
from .safe_dcp import ChunkLoadPlanner, ChunkSavePlanner, SafeFileSystemReader, open_checkpoint

__all__ = ["save", "load", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _run_dcp(run, state_dict: dict[str, torch.Tensor], group, planner, local: bool, **storage) -> None:
    """``dcp.save`` or ``dcp.load`` (``run``), without DCP's warning that no process group means one process;
    ``local``: this process alone, whatever torch.distributed holds."""
    alone = local or not _distributed()
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        run(state_dict, planner=planner, process_group=group, no_dist=alone, **storage)


def _barrier(group, local: bool) -> None:
    if _distributed() and not local:
        dist.barrier(group=group)


# --- optimizer access: what this rank holds, in model space ------------------------------------------------
class _Held(NamedTuple):
    """One param (or, sharded, this rank's piece of one) as the checkpoint sees it."""

    name: str
    shape: tuple[int, ...]
    group: int
    lo: int  # first element of the flattened param held here (its holder of element 0 writes its 0-d state)
    master: torch.Tensor  # fp32 values: saved from it; loaded into it (sharded) or in its place (unsharded)
    state: dict[str, Any]  # torch-format optimizer state of the held elements
    index: int | None  # unsharded: the param's index in ``state_dict()``
    writes: bool | None = None  # saved by this rank (None: rank 0 unsharded, the holder sharded)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _model_space(optimizer, named_parameters) -> tuple[list[_Held], list[tuple], dict | None]:
    """``(held, every, full)``: ``held`` per param this rank holds, ``every`` is ``(name, shape, group)`` per
    trainable param of the model, ``full`` the unsharded optimizer's ``state_dict()`` (None when sharded). A
    param sharded by ``fully_shard`` (a DTensor) is held as this rank's rows: a chunk of the flat param, saved by
    the first replica (HSDP's replicas hold the same rows)."""
    if isinstance(optimizer, ShardedMixedPrecisionOptimizer):
        space = list(optimizer.model_space())
        held = [
            _Held(n, tuple(s), g, piece.lo, p, optimizer.state.get(p, {}), None)
            for n, s, g, piece, p in space
            if piece is not None
        ]
        return held, [(n, tuple(s), g) for n, s, g, _, _ in space], None
    if not isinstance(optimizer, MixedPrecisionOptimizer):
        raise ValueError(
            f"expected a ShardedMixedPrecisionOptimizer or MixedPrecisionOptimizer, got {type(optimizer).__name__}"
        )
    if named_parameters is None:
        raise ValueError("a MixedPrecisionOptimizer checkpoint is keyed by name: pass named_parameters=model")
    full = optimizer.state_dict()
    model = optimizer.model_params()
    index = {id(p): k for k, p in enumerate(model)}
    it = iter(model)  # the model's params arranged in the optimizer's groups, which hold the masters
    by_group = [{"params": [next(it) for _ in g["params"]]} for g in optimizer.param_groups]
    names, params, groups = named_trainable(SimpleNamespace(param_groups=by_group), named_parameters)
    mesh = Mesh.of(params)
    held = []
    for name, p, group in zip(names, params, groups, strict=True):
        k = index[id(p)]
        master = local_shard(full["masters"].get(k, p)).detach()  # fp32 params are their own masters
        state = {key: local_shard(v) for key, v in full["optimizer"]["state"].get(k, {}).items()}
        lo, writes = (0, None) if mesh is None else (mesh.offset(p), mesh.counts)
        held.append(_Held(name, tuple(p.shape), group, lo, master, state, k, writes))
    return held, [(h.name, h.shape, h.group) for h in held], full


def _plan(held: list[_Held], state_keys) -> list[tuple[str, _Held, str | None, bool]]:
    """``(item, param, state key or None for the master, elementwise)`` per item of the held params, the state
    keys from ``state_keys(param)`` (the live state on save, the file on load). Zero-element params have none."""
    plan = []
    for h in held:
        if h.numel:
            plan.append((f"master/{h.name}", h, None, True))
            plan += [(f"state/{h.name}/{key}", h, key, elementwise) for key, elementwise in state_keys(h)]
    return plan


# --- what a checkpoint holds besides the params ----------------------------------------------------------
def _global_items(optimizer, every: list) -> dict[str, torch.Tensor]:
    one = torch.tensor(1, dtype=torch.int64)
    items: dict[str, torch.Tensor] = {
        "format/version": torch.tensor(FORMAT_VERSION, dtype=torch.int64),
        # which optimizer and loss scaler wrote it, in the item names (items are tensors only)
        f"kind/optimizer/{optimizer.algorithm()}": one,
        f"kind/scaler/{type(optimizer.loss_scaler).__name__}": one,
    }
    for gi, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            tensor = _hparam_tensor(value)
            if key not in ("params", "param_names") and tensor is not None:
                items[f"hparam/{gi}/{key}"] = tensor
    for key, value in _scaler_numbers(optimizer.loss_scaler.state_dict()).items():
        dtype = torch.int64 if isinstance(value, int) else torch.float64
        items[f"scaler/{key}"] = torch.tensor(value, dtype=dtype)
    items["counters/skipped_steps"] = torch.tensor(optimizer.skipped_steps, dtype=torch.int64)
    for name, shape, group in every:
        items[f"shape/{name}"] = torch.tensor(list(shape), dtype=torch.int64)
        items[f"group/{name}"] = torch.tensor(group, dtype=torch.int64)
    return items


def _scaler_numbers(state: dict[str, Any]) -> dict[str, int | float]:
    return {k: v for k, v in state.items() if is_number(v)}


def _hparam_tensor(value: Any) -> torch.Tensor | None:
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if is_number(value):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, tuple) and value and all(map(is_number, value)):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


def _group(optimizer, process_group):
    """The group a save or load runs its collectives on: the optimizer's own (sharded, or ZeRO-0's), else the
    caller's ``process_group`` (``None``: the default group)."""
    own = optimizer.process_group
    if own is not None and process_group is not None and process_group is not own:
        raise ValueError(
            "process_group differs from the optimizer's own process_group, which its shards or grad reduction "
            "use: pass process_group=None (or the optimizer's group)"
        )
    return own if own is not None else process_group


# --- save -------------------------------------------------------------------------------------------------
def save(
    optimizer, path: str | os.PathLike, *, named_parameters=None, process_group=None, local: bool = False
) -> Path:
    """Write ``optimizer`` (any ``MixedPrecisionOptimizer``; an unsharded one needs ``named_parameters``, the
    model) to the directory ``path``, atomically; returns ``path``. Collective when distributed, unless ``local``
    (an unsharded optimizer saved by this process alone: ``optimizer.collective`` is False)."""
    path = Path(path)
    group = _group(optimizer, process_group)
    rank = dist.get_rank(group) if _distributed() and not local else 0
    held, every, full = _model_space(optimizer, named_parameters)
    state_dict: dict[str, torch.Tensor] = {}
    chunks: dict[str, tuple[int, int]] = {}
    # unsharded: every rank holds the same; rank 0 writes it
    mine = [h for h in held if h.writes or (h.writes is None and (rank == 0 or full is None))]
    for item, h, key, elementwise in _plan(mine, _live_keys):
        value = (h.master if key is None else h.state[key]).detach()
        if elementwise and value.numel():  # a rank holding no rows of a param writes none
            state_dict[item] = value.reshape(-1)
            chunks[item] = (h.lo, h.numel)
        elif h.lo == 0:
            state_dict[item] = value
    if rank == 0:
        state_dict.update(_global_items(optimizer, every))
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.ExitStack() as hold:
        if rank == 0:  # remove the temporary directory a killed save left; refuse one of a save still running
            if not remove_if_dead(tmp):
                raise FileExistsError(
                    f"{tmp} is being written by another save of {path} that is still running; wait for it to "
                    "finish or save to another path"
                )
            tmp.mkdir(parents=True)
            hold.enter_context(held_dir(tmp))  # until committed: no other save takes it for a leftover
        _barrier(group, local)
        with _dcp_writing(tmp, rank):
            _run_dcp(
                dcp.save,
                state_dict,
                group,
                ChunkSavePlanner(chunks),
                local,
                storage_writer=FileSystemWriter(str(tmp)),
            )
        _barrier(group, local)
        if rank == 0:  # after every rank's files are in
            seal(tmp, path.name)
            commit(tmp, path)
    _barrier(group, local)
    if full is None:  # sharded: the joined split masters are no longer needed
        optimizer.release_model_space()
    return path


@contextlib.contextmanager
def _dcp_writing(tmp: Path, rank: int):
    """DCP reports a failed write as a ``CheckpointException`` (a BaseException, which ``except Exception`` lets
    through) holding each rank's error: raise this rank's as the CheckpointError of the file it was writing (DCP's
    default writer: one data file per rank, then the coordinator's ``.metadata``)."""
    try:
        yield
    except CheckpointException as e:
        failed = e.failures.get(rank) or next(iter(e.failures.values()), None)
        if failed is None:
            raise
        error, trace = failed
        name = ".metadata" if any(frame.name == "finish" for frame in trace or ()) else f"__{rank}_0.distcp"
        with writing(tmp / name):
            raise error from None


def seal(directory: Path, name: str) -> None:
    """Write (or replace) the manifest of the DCP checkpoint in ``directory``, to be published as ``name``."""
    (directory / MANIFEST).unlink(missing_ok=True)
    seal_directory(directory, name, {"format": DCP_FORMAT, "layout": DCP})


def _live_keys(h: _Held) -> list[tuple[str, bool]]:
    keys = []
    for key, value in h.state.items():
        if not torch.is_tensor(value):
            raise ValueError(
                f"optimizer state {key!r} of {h.name!r} is a {type(value).__name__}, not a tensor; halfprec "
                "checkpoints hold tensors only"
            )
        elementwise = is_elementwise(key, value, h.master.shape)
        if not elementwise and value.dim() != 0:
            raise ValueError(
                f"optimizer state {key!r} of {h.name!r} has shape {tuple(value.shape)}: not elementwise"
            )
        keys.append((key, elementwise))
    return keys


# --- load -------------------------------------------------------------------------------------------------
def load(
    optimizer, path: str | os.PathLike, *, named_parameters=None, process_group=None, local: bool = False
) -> None:
    """Load a checkpoint written at any world size into ``optimizer`` (any ``MixedPrecisionOptimizer``).
    Collective when distributed, unless ``local`` (as for ``save``). Everything is read and checked before the
    first write: a failed load changes nothing."""
    staged_load(
        optimizer, path, named_parameters=named_parameters, process_group=process_group, local=local
    )()


def staged_load(
    optimizer, path: str | os.PathLike, *, named_parameters=None, process_group=None, local: bool = False
):
    """Read and check the checkpoint at ``path`` for ``optimizer`` (collective when distributed); return the
    function that applies it. Raises (ValueError, or CheckpointError for unreadable files) before anything of
    ``optimizer`` changes, so a caller can check several parts of a checkpoint before applying any."""
    group = _group(optimizer, process_group)
    path, metadata = open_checkpoint(path)
    saved = metadata.state_dict_metadata
    held, every, full = _model_space(optimizer, named_parameters)
    held, every = _as_saved(path, saved, held, every)
    _check_names(path, saved, every)
    _check_kinds(path, saved, optimizer)
    plan = _plan(held, lambda h: _saved_keys(path, saved, h))
    items = {
        item: torch.empty(h.master.numel() if elementwise else (), dtype=saved[item].properties.dtype)
        for item, h, _, elementwise in plan
    }
    chunks = {item: h.lo for item, h, _, elementwise in plan if elementwise and h.master.numel()}
    for item, md in saved.items():
        if item.startswith(("hparam/", "scaler/", "counters/", "group/", "shape/")):
            items[item] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    empty = {item for item, h, _, elementwise in plan if elementwise and not h.master.numel()}  # no rows here
    _run_dcp(
        dcp.load,
        {item: tensor for item, tensor in items.items() if item not in empty},
        group,
        ChunkLoadPlanner(chunks),
        local,
        storage_reader=SafeFileSystemReader(str(path)),
    )
    _check_params(path, items, held, len(optimizer.param_groups))
    hparams = _hparams(path, items, optimizer.param_groups)
    scaler_state = _scaler_state(path, items, optimizer.loss_scaler)
    skipped = items.get("counters/skipped_steps")
    if skipped is None or skipped.dtype != torch.int64 or skipped.dim() or int(skipped) < 0:
        raise ValueError(f"{path}: counters/skipped_steps is missing or not a non-negative integer")
    states: dict[int, dict[str | None, torch.Tensor]] = {id(h): {} for h in held}  # key None: the master
    for item, h, key, elementwise in plan:
        states[id(h)][key] = items[item].view(h.master.shape) if elementwise else items[item]
    masters = {i: state.pop(None) for i, state in states.items() if None in state}
    if full is None:
        return lambda: _apply_sharded(optimizer, held, masters, states, hparams, scaler_state, int(skipped))
    for h in held:
        if h.numel and h.index in full["masters"]:
            full["masters"][h.index] = masters[id(h)]
        if h.numel and states[id(h)]:
            full["optimizer"]["state"][h.index] = states[id(h)]
        elif h.numel:
            full["optimizer"]["state"].pop(h.index, None)
    for gi, values in enumerate(hparams):
        full["optimizer"]["param_groups"][gi].update(values)
    full["scaler"], full["skipped_steps"] = scaler_state, int(skipped)
    full["has_state"] = state_record(full["optimizer"]["state"], len(full["params"]))
    # an FSDP2 shard's master and state as DTensors, as state_dict() hands them out
    full = laid_out_like_params(full, optimizer.model_params())
    optimizer.check_state_dict(full)
    own = [(h.index, masters[id(h)]) for h in held if h.numel and h.index not in full["masters"]]
    return lambda: _apply_unsharded(optimizer, full, own)


def _as_saved(path: Path, saved: dict, held: list[_Held], every: list) -> tuple[list[_Held], list]:
    """``held`` and ``every`` under the names ``path`` holds them by, matched by clean name (``optim/names.py``):
    their clean names, except in a checkpoint written before names were cleaned, whose names may hold
    torch.compile's ``_orig_mod.`` (every param has a ``shape/`` item). Either loads into the model compiled or not."""
    names = [item[len("shape/") :] for item in saved if item.startswith("shape/")]
    with reraised(ValueError, str(path), ValueError):
        as_saved = clean_keys({name: name for name in names}, what="params")
    held = [_Held(as_saved.get(h.name, h.name), *h[1:]) for h in held]
    return held, [(as_saved.get(n, n), s, g) for n, s, g in every]


def _check_names(path: Path, saved: dict, every: list) -> None:
    mine = {n: s for n, s, _ in every if math.prod(s) > 0}
    theirs = {k[len("master/") :] for k in saved if k.startswith("master/")}
    missing, extra = sorted(set(mine) - theirs), sorted(theirs - set(mine))
    if missing or extra:
        raise ValueError(
            f"{path} does not match this model: missing params {missing}, unexpected params {extra}"
        )
    for name, shape in mine.items():
        if tuple(saved[f"master/{name}"].size) != (math.prod(shape),):
            raise ValueError(
                f"{path}: param {name!r} has {saved[f'master/{name}'].size} elements saved, shape {tuple(shape)} here"
            )


def _check_kinds(path: Path, saved: dict, optimizer) -> None:
    """The optimizer and loss scaler that wrote ``path`` are of this optimizer's kinds (ValueError)."""
    kinds = {k.split("/")[1]: k.split("/", 2)[2] for k in saved if k.startswith("kind/")}
    # older checkpoints: told by the numeric hyper-parameters their groups hold
    numeric = {k for g in optimizer.param_groups for k, v in g.items() if _hparam_tensor(v) is not None}
    other = dict.fromkeys(k for k in optimizer.defaults if k not in numeric)
    optimizer.check_algorithm(
        kinds.get("optimizer"),
        [{**dict.fromkeys(keys), **other} for keys in hparam_groups(saved).values()],
        where=f"checkpoint {path}",
    )
    scaler = kinds.get("scaler")
    if scaler is None:  # older checkpoints: a scaler of another kind has other numeric fields
        mine = _scaler_numbers(optimizer.loss_scaler.state_dict())
        theirs = {k[len("scaler/") :] for k in saved if k.startswith("scaler/")}
        scaler = (
            type(optimizer.loss_scaler).__name__
            if theirs == set(mine)
            else f"loss scaler with the fields {sorted(theirs)}"
        )
    with reraised(ValueError, f"checkpoint {path}", ValueError):
        optimizer.loss_scaler.check_state_dict({"type": scaler})


def _saved_keys(path: Path, saved: dict, h: _Held) -> list[tuple[str, bool]]:
    """The state keys saved for ``h`` and whether each is elementwise (ValueError for any other shape)."""
    prefix, keys = f"state/{h.name}/", []
    for item, md in saved.items():
        if item.startswith(prefix):
            size = tuple(md.size)
            if size not in ((h.numel,), ()):
                raise ValueError(f"{path}: {item} has shape {list(size)}, expected [{h.numel}] or a scalar")
            keys.append((item[len(prefix) :], size == (h.numel,)))
    return keys


def _check_params(path: Path, items: dict[str, torch.Tensor], held: list[_Held], groups: int) -> None:
    saved_groups = hparam_groups(items)
    if saved_groups and max(saved_groups) + 1 != groups:
        raise ValueError(
            f"{path} has {max(saved_groups) + 1} param groups, this optimizer {groups}: build the "
            "optimizer with the param groups it was saved with"
        )
    for h in held:
        shape = tuple(items[f"shape/{h.name}"].tolist())
        if shape != h.shape:
            raise ValueError(
                f"{path}: param {h.name!r} was saved with shape {list(shape)}, here {list(h.shape)}"
            )
        group = int(items[f"group/{h.name}"])
        if group != h.group:
            raise ValueError(
                f"{path}: param {h.name!r} was saved in param group {group}, it is in group {h.group} here"
            )


def _hparams(path: Path, items: dict[str, torch.Tensor], param_groups: list[dict]) -> list[dict[str, Any]]:
    out = []
    for gi, group in enumerate(param_groups):
        values = {}
        for key, live in group.items():
            item = items.get(f"hparam/{gi}/{key}")
            if item is not None:
                try:
                    values[key] = _restore_hparam(live, item)
                except (ValueError, TypeError) as e:
                    raise ValueError(
                        f"{path}: hparam/{gi}/{key} {item.tolist()} does not fit {live!r}"
                    ) from e
        out.append(values)
    return out


def _scaler_state(path: Path, items: dict[str, torch.Tensor], scaler) -> dict[str, Any]:
    state = scaler.state_dict()
    for key, value in state.items():
        if f"scaler/{key}" in items:
            state[key] = _number(value, items[f"scaler/{key}"].item())
    with reraised(ValueError, str(path), ValueError):
        copy.deepcopy(scaler).load_state_dict(state)  # its own checks, on a copy: nothing changes here
    return state


@torch.no_grad()
def _apply_sharded(optimizer, held, masters, states, hparams, scaler_state, skipped) -> None:
    for h in held:
        if not h.numel:
            continue
        h.master.copy_(masters[id(h)])
        group = optimizer.param_groups[h.group]
        on_device = group.get("capturable", False) or group.get("fused", False)
        state = {
            key: value.to(h.master.device if value.dim() or on_device else "cpu")
            for key, value in states[id(h)].items()
        }
        if state:
            optimizer.state[h.master] = state
        else:
            optimizer.state.pop(h.master, None)
    for group, values in zip(optimizer.param_groups, hparams, strict=True):
        group.update(values)
    optimizer.restore_counters(scaler_state, skipped)


@torch.no_grad()
def _apply_unsharded(optimizer, full: dict[str, Any], own: list[tuple[int, torch.Tensor]]) -> None:
    optimizer.load_state_dict(full)
    params = optimizer.model_params()
    for index, value in own:  # fp32 params, their own masters
        local_shard(params[index]).copy_(value)


def _restore_hparam(live: Any, saved: torch.Tensor) -> Any:
    if torch.is_tensor(live):
        return saved.to(device=live.device, dtype=live.dtype)
    if isinstance(live, tuple):
        return tuple(_number(v, x) for v, x in zip(live, saved.tolist(), strict=True))
    return _number(live, saved.item())


def _number(live: Any, saved: float | int) -> Any:
    """The saved value, in the live value's type when that loses nothing: an optimizer built with ``lr=1`` (an
    int) and scheduled to 0.25 resumes at 0.25, not ``int(0.25) == 0``; an int setting stays an int."""
    if is_number(live):
        return int(saved) if isinstance(live, int) and float(saved).is_integer() else float(saved)
    return type(live)(saved)
