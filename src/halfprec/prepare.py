"""Preparing the user's model for the engine: casting what the optimizer does not train, and FSDP2 (``fully_shard``)
by ``Config.zero_stage=3``'s policy, with the weights of a sharded model gathered for a checkpoint and laid out
again on load. The optimizer's masters of the shards are ``optim/mesh.py``'s."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from .optim.base import MixedPrecisionOptimizer
from .optim.checks import set_data, world_size, wraps_tensor
from .optim.mesh import as_dtensor, is_dtensor, local
from .optim.names import uncompiled

__all__ = [
    "cast_module",
    "cast_rest",
    "cast_shards",
    "derived_buffers",
    "float8_scale_precompute",
    "fp32_rows",
    "check_shards",
    "fully_shard_model",
    "laid_out_like",
    "start_masters_from",
    "whole_state",
]


def cast_rest(module: torch.nn.Module, dtype: torch.dtype, handled: set) -> None:
    """Cast the floating params the optimizer does not train, and the floating buffers of the module's state, to
    ``dtype`` (``derived_buffers`` keep theirs)."""
    for p in module.parameters():
        if p not in handled and p.is_floating_point() and p.dtype != dtype:
            set_data(p, p.data.to(dtype))
    derived = {id(buf) for _, _, buf in derived_buffers(module)}
    for mod in module.modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != dtype and id(buf) not in derived:
                setattr(mod, name, buf.to(dtype))


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` (FSDP2's modules lay their shards out again), the ``derived_buffers`` kept as they
    were."""
    kept = derived_buffers(module)
    module.to(dtype)
    for mod, name, buf in kept:
        setattr(mod, name, buf)
    return module


def derived_buffers(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """The floating buffers outside the module's state dict (registered ``persistent=False``), as (owner, name,
    tensor): constants the model derives at construction in the precision its author chose, such as HF's rotary
    ``inv_freq``, which ``from_pretrained(dtype=torch.bfloat16)`` keeps fp32 too. In bf16 it is off by up to 2**-9
    relative: at position 4095 a rotary angle can be off by radians (0.73 for a head of 16 dims)."""
    saved = {id(t) for t in module.state_dict(keep_vars=True).values()}
    return [
        (mod, name, buf)
        for mod in module.modules()
        for name, buf in mod.named_buffers(recurse=False)
        if buf.is_floating_point() and id(buf) not in saved
    ]


def float8_scale_precompute(module: torch.nn.Module) -> Callable[[], None] | None:
    """What the engine runs after each step and load when ``module`` uses FSDP2's float8 all-gather (torchao's
    ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``: each Float8Linear weight's shard wraps its tensor in
    torchao's ``WeightWithDynamicFloat8CastTensor``): torchao's ``precompute_float8_dynamic_scale_for_fsdp``, one
    all-reduce of every weight's amax for the scales the next all-gather casts with, as torchao asks after each
    optimizer step. None for any other module."""
    if "torchao.float8" not in sys.modules:  # torchao not imported: no float8 weight
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # noqa: PLC0415 - the [float8] extra
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: PLC0415

    shards = (local(p) for p in module.parameters() if is_dtensor(p))
    if not any(isinstance(t, WeightWithDynamicFloat8CastTensor) for t in shards):
        return None
    return functools.partial(precompute_float8_dynamic_scale_for_fsdp, module)


def fully_shard_model(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, dtype: torch.dtype, reduce_dtype: str
) -> dict[torch.Tensor, torch.Tensor]:
    """``Config.zero_stage=3``'s policy (its docstring): cast, ``fully_shard`` each repeated block, then the root;
    point ``optimizer`` at the sharded params. Returns, for each sharded param that was fp32, this rank's rows of
    its fp32 value, which its master starts from (the factory builds masters from the 16-bit shards)."""
    import torch.distributed as dist  # noqa: PLC0415 - FSDP2 and DTensor: only for a sharded model
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415
    from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "zero_stage=3 shards the model over the default process group, which is not initialised: call "
            "torch.distributed.init_process_group() first (torchrun sets the rank and world size), or use "
            "zero_stage=0 in one process"
        )
    if any(is_dtensor(p) for p in model.parameters()) or any(
        isinstance(m, FSDPModule) for m in model.modules()
    ):
        raise ValueError(
            "zero_stage=3 applies fully_shard, and the model is sharded already (fully_shard, DTensor params): "
            "pass zero_stage=0, which trains its shards as they are"
        )
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(
            f"zero_stage=3 shards the model over one mesh of one device type, and its params are on "
            f"{sorted(map(str, devices)) or 'no device (it has none)'}: move the model to one device first"
        )
    names = {p: n for n, p in model.named_parameters()}
    # the fp32 storage outlives the cast (the cast gives each param new data), until the masters are set
    fp32 = {}
    if dtype != torch.float32:
        fp32 = {n: p.detach() for n, p in model.named_parameters() if p.dtype == torch.float32}
        cast_rest(model, dtype, set())  # before fully_shard, which fixes the shards' dtype
    mesh = init_device_mesh(devices.pop().type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if reduce_dtype == "fp32" else None)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    sharded = dict(model.named_parameters())  # FSDP2 keeps the names, and gives each param a new object
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[p]] for p in group["params"]]
    # state made before (Adagrad's constructor; a stepped optimizer's) follows its param: a tensor of the param's
    # shape becomes this rank's rows of it, as a DTensor laid out like the shard; the rest (step counts) as it is
    for old in list(optimizer.state):
        new = sharded[names[old]]
        optimizer.state[new] = {
            key: distribute_tensor(v, mesh, new.placements, src_data_rank=None)
            if torch.is_tensor(v) and v.dim() and v.shape == new.shape
            else v
            for key, v in optimizer.state.pop(old).items()
        }
    # src_data_rank=None: each rank takes its own rows of its own weights, as fully_shard did (no communication)
    return {
        sharded[n]: distribute_tensor(w, mesh, sharded[n].placements, src_data_rank=None).to_local()
        for n, w in fp32.items()
    }


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units ``fully_shard`` is applied to before the root: the children of the first ``nn.ModuleList`` (a
    transformer's layers, as torchtitan shards them), else every direct child that has params (of the model a
    ``torch.compile``d one wraps: the same units as uncompiled)."""
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), uncompiled(model))
    return [child for child in layers.children() if next(child.parameters(), None) is not None]


def start_masters_from(mp: MixedPrecisionOptimizer, rows: dict[torch.Tensor, torch.Tensor]) -> None:
    """Set the masters of ``rows``' params to the fp32 rows their 16-bit shards were rounded from, through the
    contract's state dict (every strategy's payload holds the masters by param index; split masters are split
    from them, and the shards rounded)."""
    params = mp.model_params()
    mine = {k: rows[p] for k, p in enumerate(params) if p in rows}
    if not mine:  # none of them is this optimizer's: no state-dict round trip
        return
    state = mp.state_dict()
    for k, row in mine.items():
        if k in state["masters"]:  # laid out like the shard, as the state dict holds it
            state["masters"][k] = as_dtensor(params[k], row) if is_dtensor(params[k]) else row
    mp.load_state_dict(state)


def fp32_rows(module: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """Each fp32 FSDP2 shard (DTensor param) of ``module`` -> this rank's rows of it, taken before the module is cast
    (the cast gives each param new storage; the rows keep the old one), for its master to start from."""
    return {p: local(p).detach() for p in module.parameters() if is_dtensor(p) and p.dtype == torch.float32}


def cast_shards(model: torch.nn.Module, dtype: torch.dtype) -> dict[torch.Tensor, torch.Tensor]:
    """An FSDP2-sharded model with fp32 shards trained in ``dtype``: keep their fp32 rows (``fp32_rows``), then
    ``cast_module``, whose ``model.to(dtype)`` FSDP2's modules handle (they lay their shards out again; the
    Parameters stay, so the optimizer built over them still holds them). Returns the rows."""
    rows = fp32_rows(model)
    if rows and dtype != torch.float32:
        cast_module(model, dtype)
    return rows if dtype != torch.float32 else {}


def check_shards(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the model is sharded by FSDP2 (DTensor params), refusing what the engine cannot train then."""
    shards = [p for p in model.parameters() if is_dtensor(p)]
    if not shards:
        return False
    floating = [p for p in shards if p.is_floating_point()]
    if dtype != torch.float32:
        # fp32 shards are cast (cast_shards); 16-bit shards of the other dtype hold no more than their bits
        other = next((p for p in floating if p.dtype not in (dtype, torch.float32)), None)
        if other is not None:
            raise ValueError(
                f"a param of shape {tuple(other.shape)} is a {other.dtype} DTensor and the precision is {dtype}: "
                f"recasting it would round {other.dtype} values again; pass the model in fp32 (sharded or not) "
                f"or in {dtype}, or set the precision to match"
            )
    ranks, world = shards[0].device_mesh.size(), world_size()
    if ranks != world:
        raise ValueError(
            f"the model is sharded over a mesh of {ranks} rank{'s' if ranks > 1 else ''} and the default process "
            f"group of {world} ranks: the engine saves and loads checkpoints over the default group. Shard it over "
            "every rank (a 1-D mesh, or HSDP's 2-D mesh), or use MixedPrecisionOptimizer with "
            "halfprec.distributed.checkpoint(..., process_group=) directly"
        )
    return True


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a tensor subclass that wraps one (torchao's float8 weights), for a file to hold;
    any other tensor as it is."""
    while wraps_tensor(t):
        names, _ = t.__tensor_flatten__()
        if len(names) != 1:
            raise ValueError(
                f"a weight is a {type(t).__name__} of {len(names)} tensors ({names}), which a checkpoint cannot "
                "hold as one: convert the model back to plain tensors before saving"
            )
        t = getattr(t, names[0])
    return t


def whole_state(module: torch.nn.Module, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """``module.state_dict()`` with each DTensor (an FSDP2 shard) gathered whole into host memory, for rank 0 to
    write as safetensors: one all-gather per tensor, which every rank of the mesh must call. Only where ``keep``
    are the tensors kept (None elsewhere). Memory: one whole tensor at a time on the device of each rank, and on
    the keeping rank the whole state dict in host memory (2 B/param for 16-bit weights), as an unsharded
    model's save holds it."""
    state = module.state_dict()
    if not any(is_dtensor(v) for v in state.values()):
        return {name: plain(v) for name, v in state.items()} if keep else None
    # a tied param is gathered once on every rank (the same collectives everywhere), and stored once
    first: dict[int, str] = {}
    alias = {n: first.setdefault(id(p), n) for n, p in module.named_parameters(remove_duplicate=False)}
    out: dict[str, Any] = {}
    for name, value in state.items():
        source = alias.get(name, name)
        if source not in out:
            whole = value.full_tensor() if is_dtensor(value) else value
            out[source] = plain(whole).cpu() if keep else None
        out[name] = out[source]
    return out if keep else None


def laid_out_like(module: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole ``weights`` as DTensors where the module's state is: each rank takes its own rows of the whole
    tensor it read (no communication), so that ``load_state_dict`` copies shard into shard."""
    own = module.state_dict()
    if not any(is_dtensor(v) for v in own.values()):
        return weights
    from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 - as in fully_shard_model

    return {
        name: distribute_tensor(
            w.to(own[name].device), own[name].device_mesh, own[name].placements, src_data_rank=None
        )
        if is_dtensor(own[name])
        else w
        for name, w in weights.items()
    }
