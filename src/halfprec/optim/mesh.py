"""Params that are DTensors, as ``fully_shard`` (FSDP2) leaves them: each rank holds a shard of rows of each.

FSDP2 is a property of the layout here, not another strategy. A DTensor param's master is an fp32 copy of its
local shard, a plain tensor (the inner torch optimizer then steps plain tensors: DTensor masters step 4-8x slower),
and the step rounds the masters back into the local shard in place. FSDP2 has already reduce-scattered the grads,
so the one collective left is :meth:`Mesh.norm_and_flag`: the global grad norm and the overflow flag in one
all-reduce, so that every rank clips with the same coefficient, skips the same steps and keeps the same loss scale.

``local(t)`` is taken at every use and never kept: FSDP2 may give a sharded param new local storage and keep the
Parameter (``model.to_empty()`` after ``fully_shard``), and the param's ``to_local()`` is the way to the current
one. (``model.load_state_dict(..., assign=True)`` replaces the Parameters themselves: an optimizer, halfprec's or
torch's, is built after it.)

Nothing here imports ``torch.distributed.tensor``: a DTensor exists only once that module is imported, so
``sys.modules`` says whether there can be one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..precision import LOW_PRECISION

__all__ = [
    "Mesh",
    "as_dtensor",
    "check_sharded_options",
    "is_dtensor",
    "local",
    "local_grad",
    "same_rows",
    "check_rows",
]


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage, outside autograd); any other tensor as it is."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    return None if p.grad is None else local(p.grad)


def as_dtensor(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, a tensor of the shape of ``p``'s local shard, as a DTensor laid out like ``p`` (sharing storage);
    a DTensor as it is."""
    if is_dtensor(value):
        return value
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - only reached once DTensors exist

    return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def same_rows(value: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether the DTensor ``value`` holds the rows of DTensor ``p`` that this rank holds: the same whole shape and
    placements, saved at this rank's coordinate on every sharded mesh dim (a DTensor that ``torch.save`` kept
    keeps its mesh coordinate; HSDP's replicas hold the same rows)."""
    if value.shape != p.shape or tuple(value.placements) != tuple(p.placements):
        return False
    mine, theirs = p.device_mesh.get_coordinate(), value.device_mesh.get_coordinate()
    return all(mine[d] == theirs[d] for d, placement in enumerate(p.placements) if placement.is_shard())


def check_rows(what: str, value: torch.Tensor, p: torch.Tensor, *, plain_ok: bool = False) -> None:
    """ValueError naming the fix unless ``value``, a state dict's ``what`` of param ``p``, holds the rows of ``p``
    this rank holds: for an FSDP2 shard a DTensor laid out like it (``same_rows``; with ``plain_ok`` also a plain
    tensor, of the size ``_check_state_sizes`` checks), for an unsharded param no DTensor of fewer rows."""
    fix = (
        "load the state dict this rank saved, or load through torch.distributed.checkpoint or "
        "halfprec.distributed.checkpoint, which reshard"
    )
    if is_dtensor(p):
        if is_dtensor(value) and same_rows(value, p) or not is_dtensor(value) and plain_ok:
            return
        held = (
            f"a DTensor of {list(value.shape)} {value.placements} saved at mesh coordinate "
            f"{value.device_mesh.get_coordinate()}"
            if is_dtensor(value)
            else "a plain tensor"
        )
        raise ValueError(
            f"state dict's {what} is {held}, and the param is an FSDP2 shard of {list(p.shape)} {p.placements} "
            f"whose rows this rank, at mesh coordinate {p.device_mesh.get_coordinate()}, holds: {fix}"
        )
    if is_dtensor(value) and local(value).shape != p.shape:
        raise ValueError(
            f"state dict's {what} is a DTensor of {list(local(value).shape)} rows of {list(value.shape)} here, "
            f"and the param is unsharded: {fix}"
        )


class Mesh:
    """The device mesh and placements every DTensor param of one optimizer shares, and this rank's place in it.

    Placements: ``Shard(0)`` (FSDP2's rows) on at most one mesh dim, ``Replicate()`` on the others (HSDP's
    replicas). ``counts``: this rank is the first replica (coordinate 0 on every Replicate dim), so its sums of
    squares make the global norm, each element once.
    """

    def __init__(self, device_mesh: Any, placements: tuple) -> None:
        from torch.distributed.tensor import Replicate  # noqa: PLC0415 - only reached once DTensors exist

        self.device_mesh = device_mesh
        self.placements = placements
        coordinate = device_mesh.get_coordinate()
        replicas = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
        self.counts = all(coordinate[d] == 0 for d in replicas)
        shard = [d for d in range(len(placements)) if d not in replicas]
        self.shard_ranks, self.shard_index = (
            (device_mesh.size(shard[0]), coordinate[shard[0]]) if shard else (1, 0)
        )
        # one all-reduce over the default group when the mesh spans it; else one per mesh dim (a subgroup made
        # here would be a collective of every rank of the world at construction)
        spans_world = device_mesh.size() == dist.get_world_size()
        self.groups = [None] if spans_world else device_mesh.get_all_groups()

    @classmethod
    def of(cls, params: Sequence[torch.Tensor]) -> Mesh | None:
        """The mesh of ``params`` (None when none is a DTensor). ValueError when they mix plain tensors and
        DTensors, span two meshes or layouts, or have placements other than ``Shard(0)``/``Replicate()``."""
        params = list(params)
        dtensors = [p for p in params if is_dtensor(p)]
        if not dtensors:
            return None
        plain = next((p for p in params if not is_dtensor(p)), None)
        if plain is not None:
            raise ValueError(
                f"a trained param of shape {tuple(plain.shape)} is a plain tensor and others are DTensors: its grad "
                "would not be reduced across ranks. fully_shard every module with trained params (the root module "
                "last), or freeze it"
            )
        first = dtensors[0]
        for p in dtensors:
            if p.device_mesh != first.device_mesh or p.placements != first.placements:
                raise ValueError(
                    f"DTensor params on {first.device_mesh} {first.placements} and on {p.device_mesh} "
                    f"{p.placements}: one halfprec optimizer takes one FSDP2 layout; build one optimizer per mesh"
                )
        _check_placements(first.placements)
        mesh = cls(first.device_mesh, first.placements)
        for p in dtensors:  # the split rows() assumes is the one FSDP2 made
            lo, hi = mesh.rows(p)
            assert p.dim() == 0 or local(p).shape[0] == hi - lo, (tuple(local(p).shape), lo, hi)
        return mesh

    def rows(self, p: torch.Tensor) -> tuple[int, int]:
        """The rows ``[lo, hi)`` of ``p`` this rank holds: ``torch.chunk``'s split, which FSDP2's ``Shard(0)``
        uses (ceil(rows / ranks) per rank; the last ranks may hold fewer, or none)."""
        if p.dim() == 0:
            return 0, 0
        n = p.shape[0]
        per = -(-n // self.shard_ranks)
        lo = min(self.shard_index * per, n)
        return lo, min(lo + per, n)

    def offset(self, p: torch.Tensor) -> int:
        """The flat index, in the whole param, of this rank's first element."""
        return self.rows(p)[0] * math.prod(p.shape[1:])

    def norm_and_flag(
        self, grads: Sequence[torch.Tensor], *, check: bool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm, found_inf)`` of the whole grads, from this rank's local fp32 ``grads``: the norm is
        fp32(sqrt(fp64 sum of squares)), the sum over the mesh of the first replicas' local sums; ``found_inf``
        is 1.0 when ``check`` and any rank's grads (or the norm) are non-finite. One all-reduce of two fp64
        numbers (per mesh dim when the mesh does not span the default group); every rank of the mesh calls it.
        fp64 squares of fp32 values cannot overflow, so a local sum is non-finite exactly when a grad is; the
        sum is rounded once to fp32, so the norm does not depend on how the rows are split (up to fp64 rounding,
        ~1e-16 relative, far below fp32's)."""
        local_sum = torch.zeros((), dtype=torch.float64, device=device)
        if grads:
            local_sum = torch.stack([g.to(torch.float64).square().sum() for g in grads]).sum()
        packed = self._sum_over_mesh(local_sum, (~local_sum.isfinite()).to(torch.float64))
        norm = packed[0].sqrt().to(torch.float32)
        if not check:
            return norm, torch.zeros((), dtype=torch.float32, device=device)
        return norm, ((packed[1] > 0) | ~norm.isfinite()).to(torch.float32)

    @torch.no_grad()
    def reduce_partials(self, sq: torch.Tensor, bad: torch.Tensor, used: int) -> None:
        """The fused norm pass's per-program partials of this rank's grads, the first ``used`` elements of ``sq``
        (sums of squares) and ``bad`` (counts of non-finite values), fp32 buffers of at least one element, become
        the whole grads' in place: element 0 holds each total over the mesh (rounded once to fp32) and the rest
        of the first ``max(used, 1)`` are zero, so the finalize program reads the same norm and skip on every
        rank (one that holds no rows: ``used`` 0)."""
        packed = self._sum_over_mesh(sq[:used].sum(dtype=torch.float64), bad[:used].sum(dtype=torch.float64))
        n = max(used, 1)
        sq[:n].zero_()
        bad[:n].zero_()
        sq[0] = packed[0]
        bad[0] = packed[1]

    def _sum_over_mesh(self, squares: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """``[sum of squares, flags]`` over the mesh (fp64): one all-reduce (per mesh dim when the mesh does not
        span the default group) of this rank's ``squares`` if it is of the first replica (each element counted
        once), else 0, and of every rank's ``flags``."""
        packed = torch.stack([squares if self.counts else torch.zeros_like(squares), flags])
        for group in self.groups:
            dist.all_reduce(packed, group=group)
        return packed


def _check_placements(placements: tuple) -> None:
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 - only reached once DTensors exist

    rows = [pl for pl in placements if type(pl) is Shard and pl.dim == 0]
    other = [
        pl for pl in placements if not isinstance(pl, Replicate) and not (type(pl) is Shard and pl.dim == 0)
    ]
    if other or len(rows) > 1:
        raise ValueError(
            f"DTensor params with placements {placements}: halfprec takes FSDP2's layouts, Shard(0) on one mesh "
            "dim and Replicate() on the others (fully_shard over a 1-D mesh, or HSDP's 2-D mesh); tensor "
            "parallel layouts are not supported"
        )


def check_sharded_options(
    params: Sequence[torch.Tensor], *, param_dtype: Any = None, process_group: Any = None, stage: int = 0
) -> None:
    """ValueError naming the fix for an option that cannot apply to FSDP2-sharded (DTensor) ``params``."""
    if stage:
        raise ValueError(
            f"stage={stage} shards masters and optimizer state over a process group, and these params are already "
            "sharded by fully_shard (DTensors): FSDP2 reduce-scatters their grads and halfprec keeps masters and "
            "state of the local shards only; pass stage=0 (the default)"
        )
    if process_group is not None:
        raise ValueError(
            f"process_group={process_group!r} all-reduces the grads, and these params are sharded by fully_shard "
            "(DTensors), whose grads FSDP2 already reduce-scatters: leave process_group=None"
        )
    if param_dtype in LOW_PRECISION:
        fp32 = next((p for p in params if p.dtype == torch.float32), None)
        if fp32 is not None:
            raise ValueError(
                f"a param of shape {tuple(fp32.shape)} is an fp32 DTensor and param_dtype={param_dtype}: FSDP2 "
                "lays its shards out again only when the module is cast, so the optimizer cannot recast them in "
                f"place (the next forward fails). Cast the model (model.to({param_dtype}), before or after "
                "fully_shard; halfprec.initialize does it and starts the masters from the fp32 rows), or keep "
                f"fp32 shards, compute in 16 bits with fully_shard(..., mp_policy=MixedPrecisionPolicy("
                f"param_dtype={param_dtype})) and pass param_dtype=torch.float32"
            )
