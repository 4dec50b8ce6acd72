"""ShardedMixedPrecisionOptimizer: ZeRO-1/2 FP32 masters and optimizer state, sharded over data-parallel ranks.

Layout (``optim/layout.py``): the trainable params become views of one flat 16-bit buffer, in reverse optimizer
order, cut into buckets; rank ``r`` owns shard ``r`` of every bucket and keeps fp32 masters, fp32 grads and
optimizer state for its shards only. The part of a param inside a shard (a *piece*) is a 1-D fp32
``nn.Parameter`` that the wrapped torch optimizer steps, its math untouched: exact only for elementwise
optimizers, the only ones accepted.

A step (every rank takes the same decisions, made from all-reduced values):

1. ``unscale_()``: finish the gradient reduce-scatter (``grads.py``; with ``grad_accum_dtype="fp32"``
   the reduce-scatter of each rank's fp32 sum of its micro-batch grads), take the mean over ranks and multiply
   by the reciprocal of the loss scale, on the fp32 grad shard (a 16-bit one, of ``reduce_dtype="param"`` with
   the fused step, stays scaled: its norm and the kernel's coefficient take the reciprocal instead).
2. One all-reduce (SUM, fp64) of ``[||local grad shard||^2, used flags of every param]``: the global L2 norm
   (non-finite iff some grad on some rank is) and which params got a grad on any rank.
   The same all-reduce sums the buckets' ``dirty`` flags: a grad that reached a rank after its bucket's
   reduction (a hook that ran again late in the backward; a grad assigned to ``.grad``, zeroed or set to None by
   hand after backward, which ``step()`` collects first, ``grads.py``) makes every rank reduce that bucket again
   and all-reduce the norm again. When no rank has one, nothing more runs.
3. One host sync reads the norm, the flags and the scale; the scaler updates on the device.
4. Overflow: skip (only the scaler and ``skipped_steps`` change). Otherwise clip the shard by the global norm,
   give pieces of params that got no grad anywhere ``grad=None`` (torch leaves them and their counters alone),
   run the inner step and round the masters into this rank's shard of the flat params (with ``impl="triton"``:
   the fused update kernel of ``fused_step.py``, which applies the clip coefficient as it reads the grads and
   writes the 16-bit shard itself), then all-gather every bucket.

``state_dict()`` is the rank-local state, loaded at the same world size and layout only; checkpoints that
reshard across world sizes: ``halfprec.distributed.checkpoint``. Both hold fp32 masters, split (``optim/masters.py``)
or not.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...scaler import LossScaler
from ..base import MixedPrecisionOptimizer
from ..checks import check_dtypes, check_grad_accum_dtype, check_unfrozen, check_unwrapped, clear_grads
from ..clip import clip_coefficient
from ..layout import Layout
from ..masters import Masters, check_masters
from ..names import clean_name, named_trainable
from ..policy import select_impl
from ..state import Target, move_state, restore_state_dtypes
from .checks import check_named_parameters, check_optimizer, check_reduce_dtype
from .fused_step import FusedLocalStep
from .grads import GradReducer

__all__ = ["ShardedMixedPrecisionOptimizer", "DEFAULT_BUCKET_SIZE"]

FORMAT = "halfprec.ShardedMixedPrecisionOptimizer/1"  # the rank-local state dict (same world size only)
DEFAULT_BUCKET_SIZE = 2**23  # elements (16 MiB of 16-bit grads); Megatron uses 40M, DDP 25 MiB
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardedMixedPrecisionOptimizer(MixedPrecisionOptimizer):
    """Shard ``optimizer``'s FP32 masters and state (stage 1) and gradients (stage 2) over the ranks of a group.

    Args:
        optimizer: an elementwise ``torch.optim`` optimizer (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax,
            NAdam, RAdam, RMSprop, Rprop, ASGD) over the model's params, built the same way on every rank.
        named_parameters: the model (an ``nn.Module``) or its ``named_parameters()``: names key checkpoints.
        stage: 1 shards masters and optimizer state; 2 also shards gradients.
        loss_scaler, max_grad_norm, skip_nonfinite, param_dtype: as for ``MixedPrecisionOptimizer``.
        reduce_dtype: ``"fp32"`` reduces grads in fp32 (exact sums for two ranks); ``"param"`` in the
            params' 16-bit dtype (half the traffic, rounds; DDP's default).
        bucket_size: elements per gradient bucket (params are never split across buckets).
        process_group: the data-parallel group; ``None`` = the default group.
        impl: the local step: ``"torch"``, the wrapped torch optimizer on this rank's pieces (exact);
            ``"triton"``, the fused update kernel over the flat local buffers (torch Adam, AdamW, SGD and
            Adagrad; the fused path's tolerance), raising when it cannot run; ``"auto"``, ``"triton"`` when
            ``halfprec.optim.select.select_impl`` picks it.
        grad_accum_dtype: ``"param"`` accumulates micro-batch grads in 16 bits (stage 1: the whole 16-bit grads;
            stage 2: each micro-batch is reduced, and the results added in fp32); ``"fp32"`` adds each
            16-bit grad into a whole fp32 grad buffer as backward produces it and reduce-scatters the fp32 sums
            (``grads.py``; needs ``reduce_dtype="fp32"``; ``no_sync()`` then works at both stages).
        masters: ``"fp32"``, or ``"split"``: bf16 params keep exact fp32 masters as the param plus its low 16
            bits (2 B/param per rank less at d = 1, 2/d at world size d); the fused local step only.
    """

    _FORMAT = FORMAT
    collective = True  # its state is spread over the ranks of process_group (None: the default group)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        named_parameters: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
        stage: int = 1,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = True,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: str = "fp32",
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        process_group: dist.ProcessGroup | None = None,
        impl: str = "auto",
        grad_accum_dtype: str = "param",
        masters: str = "fp32",
    ) -> None:
        check_optimizer(optimizer, loss_scaler, max_grad_norm, param_dtype)
        check_named_parameters(named_parameters)
        check_masters(masters, [param_dtype])
        grad_accum_dtype = check_grad_accum_dtype(grad_accum_dtype, strategy="sharded")
        self.impl = select_impl(optimizer, impl)
        if stage not in (1, 2) or isinstance(stage, bool):
            raise ValueError(f"stage must be 1 or 2, got {stage!r}; stage 0 is MixedPrecisionOptimizer + DDP")
        check_reduce_dtype(reduce_dtype, grad_accum_dtype)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ShardedMixedPrecisionOptimizer needs an initialized process group: call "
                "torch.distributed.init_process_group() first (torchrun sets the environment)"
            )
        self.stage = stage
        self.masters = masters
        super().__init__(
            loss_scaler=loss_scaler, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
            param_dtype=param_dtype, wrapped=optimizer,
        )  # fmt: skip
        self.reduce_dtype = reduce_dtype
        self.grad_accum_dtype = grad_accum_dtype
        self.process_group = process_group
        self._model_params = [p for g in optimizer.param_groups for p in g["params"]]
        # params of the groups left out for being frozen now: refused if unfrozen later, grads cleared
        self._frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
        names, params, group_of = named_trainable(optimizer, named_parameters)
        # layout order: reverse of the optimizer's order, the usual approximation of backward order
        self._names, self._params, self._group_of = names[::-1], params[::-1], group_of[::-1]
        originals = self._init_flat()
        self._check_split()
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        numels = [p.numel() for p in self._params]
        self.layout = Layout(numels, world_size=self.world_size, rank=self.rank, bucket_size=bucket_size)
        self._build_buffers(originals)
        self._build_pieces()
        self._fused = None
        if self.impl == "triton":
            pieces, param, master = self._piece_params, self.flat_param, self._masters.kernel_buffer
            self._fused = FusedLocalStep(self.optimizer, self.layout, pieces, param=param, master=master)
        self._init_scaler(loss_scaler, dtypes={self.dtype} if self._params else set(), device=self.device)
        # the fused kernel reads 16-bit grads as they are (unscaled by its coefficient); torch steps fp32 grads
        sixteen = self._fused is not None and reduce_dtype == "param" and self.dtype != torch.float32
        # a 16-bit shard stays scaled until the fused kernel reads it: unscale_() leaves no unscaled .grad then
        self.unscales_in_place = not sixteen
        self._reducer = GradReducer(
            self._params, self.layout, stage=stage, reduce_dtype=reduce_dtype, group=process_group,
            accumulate=grad_accum_dtype == "fp32", shard_dtype=self.dtype if sixteen else torch.float32,
            names=self._names,
        )  # fmt: skip

    def _backward_params(self) -> list[torch.nn.Parameter]:
        return self._params  # the reducer's hooks may have consumed their grads already (stage 2)

    # --- construction --------------------------------------------------------------------------------
    def _check_split(self) -> None:
        """ValueError for split masters where they cannot be kept: the torch local step, non-bf16 params."""
        if self.masters != "split":
            return
        check_masters(self.masters, [self.dtype])
        if self.impl != "triton":
            raise ValueError(
                f"masters='split' needs the fused local step, got impl={self.impl!r}: the torch local step updates "
                "fp32 pieces. Pass impl='triton' (on CUDA impl='auto' picks it for torch Adam, AdamW, SGD and "
                "Adagrad with default flags), or masters='fp32'"
            )
        if self.dtype != torch.bfloat16:
            raise ValueError(
                f"masters='split' keeps the masters of bf16 params, got {self.dtype} params: pass "
                "param_dtype=torch.bfloat16 (or a bf16 model), or masters='fp32'"
            )

    def _init_flat(self) -> dict[int, torch.Tensor]:
        """Cast to ``param_dtype``, check one dtype and device; return the fp32 originals by layout index."""
        check_unwrapped(
            self._params,
            f"stage={self.stage}",
            "use stage 0 with torch.distributed's DDP, or FSDP2 (fully_shard)",
        )
        originals: dict[torch.Tensor, torch.Tensor] = {}
        for p in self._params:
            self._cast_to_param_dtype(p, originals)
        dtypes = {p.dtype for p in self._params}
        devices = {p.device for p in self._params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"trainable params must share one dtype and one device, got dtypes {sorted(map(str, dtypes))} "
                f"on {sorted(map(str, devices))}; cast the model (model.to(torch.bfloat16)) or pass param_dtype="
            )
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = devices.pop() if devices else torch.device("cpu")
        return {i: originals[p] for i, p in enumerate(self._params) if p in originals}

    @torch.no_grad()
    def _build_buffers(self, originals: dict[int, torch.Tensor]) -> None:
        layout = self.layout
        self.flat_param = torch.zeros(layout.total, dtype=self.dtype, device=self.device)
        for i, p in enumerate(self._params):
            view = self.flat_param[layout.offsets[i] : layout.offsets[i] + p.numel()]
            view.copy_(p.data.reshape(-1))
            p.data = view.view(p.shape)
        split = self.masters == "split"
        self._masters = Masters(layout, originals, param=self.flat_param, split=split, device=self.device)
        self._masters.make_pieces()

    @property
    def flat_master(self) -> torch.Tensor | None:
        """This rank's fp32 masters in local coordinates (None with split masters)."""
        return self._masters.fp32

    @property
    def flat_low(self) -> torch.Tensor | None:
        """Split masters: the low 16 bits (int16) of this rank's masters in local coordinates (else None)."""
        return self._masters.low

    def _build_pieces(self) -> None:
        """Swap the inner optimizer's params for this rank's fp32 pieces and shard its existing state."""
        self._piece_params = self._masters.pieces
        index_of = {id(p): i for i, p in enumerate(self._params)}
        indices = [[index_of.get(id(p)) for p in g["params"]] for g in self.optimizer.param_groups]
        orders = [[i for i in group if i in self._piece_params] for group in indices]
        # state of params held by no piece here (other ranks' pieces, frozen params) is dropped; moved while the
        # groups still hold the params, so eager state is re-created over the pieces in the same groups
        targets: dict = {p: None for g in self.optimizer.param_groups for p in g["params"]}
        for i in (i for order in orders for i in order):
            piece = self.layout.piece_of[i]
            targets[self._params[i]] = Target(self._piece_params[i], piece.lo, piece.hi)
        move_state(self.optimizer, targets)
        for group, order in zip(self.optimizer.param_groups, orders, strict=True):
            group["params"] = [self._piece_params[i] for i in order]
            if "param_names" in group:
                group["param_names"] = [self._names[i] for i in order]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError(
            "ShardedMixedPrecisionOptimizer fixes its flat layout at construction: put every param group in the "
            "torch optimizer before wrapping it"
        )

    def master_params(self) -> list[torch.nn.Parameter]:
        """This rank's fp32 pieces (1-D), in inner param-group order (split masters: joined copies, held until the
        next step; writing to them changes nothing)."""
        self._masters.join()
        return self._index_params()

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the model's current weights into this rank's masters (after an external weights-only load; split
        masters: the low halves become zero)."""
        self._masters.reset()

    @property
    def reducer(self) -> GradReducer:
        """The gradient reducer: its flat grad buffer (``flat_grad``) and whether the last backward's reduction
        overlapped it (``overlapped``)."""
        return self._reducer

    def param_name(self, index: int) -> str:
        """The name of the param at layout ``index`` (``layout.pieces[k].param``)."""
        return self._names[index]

    def piece_param(self, index: int) -> torch.nn.Parameter | None:
        """The inner optimizer's param for this rank's piece of layout param ``index`` (None: held elsewhere)."""
        return self._piece_params.get(index)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Stage 1, or fp32 accumulation: accumulate grads locally (no communication) for the micro-batches run
        inside."""
        return self._reducer.no_sync()

    # --- the step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def unscale_(self) -> None:
        """Finish the gradient reduction; an fp32 grad shard then holds the unscaled mean grad (a 16-bit one, of
        ``reduce_dtype="param"`` with the fused local step, stays scaled: the kernel unscales as it reads it).
        Idempotent."""
        if self._s.unscaled:
            return
        check_unfrozen(self._frozen)
        check_dtypes(self._params, [self.dtype] * len(self._params))
        if self._reducer.applied:
            raise RuntimeError(
                "step() called again without a new backward(): these grads were already applied (and fp32 grads "
                "unscaled in place); call zero_grad() and backward() before the next step()"
            )
        shard = self._finish_reduction(self._reducer.finish())
        if shard.dtype == torch.float32:
            # what master_params() callers read, rank-local (a 16-bit shard stays scaled for the fused kernel)
            for i, piece_param in self._piece_params.items():
                pc = self.layout.piece_of[i]
                piece_param.grad = shard[pc.local : pc.local + pc.numel]
        self._s.unscaled = True
        self._reducer.frozen = True

    def _finish_reduction(self, reduced: torch.Tensor) -> torch.Tensor:
        """Sums of the ranks' grads -> their mean, unscaled (in place; a 16-bit shard stays scaled)."""
        if self.reduce_dtype == "fp32" and self.world_size > 1:
            reduced.div_(self.world_size)
        if not self.loss_scaler.is_unit and reduced.dtype == torch.float32:
            reduced.mul_(self.loss_scaler.inv_scale())
        return reduced

    def _norm_squared(self, shard: torch.Tensor, inv: torch.Tensor | None) -> torch.Tensor:
        local = torch.linalg.vector_norm(shard, dtype=torch.float32)
        return (local if inv is None else local * inv.to(local.device)).double().square().reshape(1)

    @torch.no_grad()
    def _step(self) -> None:
        self._masters.release()
        self._reducer.collect()
        self.unscale_()
        self._s.unscaled = False
        self._reducer.frozen = False
        shard = self._reducer.grad_shard
        # a 16-bit shard is still scaled: its norm and the kernel's coefficient take 1/scale (a power of two, so
        # both equal those of the unscaled fp32 shard, bit for bit)
        inv = (
            None if shard.dtype == torch.float32 or self.loss_scaler.is_unit else self.loss_scaler.inv_scale()
        )
        flags = torch.tensor(
            self._reducer.used + self._reducer.dirty, dtype=torch.float64, device=self.device
        )
        stats = torch.cat([self._norm_squared(shard, inv), flags])
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=self.process_group)
        norm = stats[0].sqrt().float()
        scaler = self.loss_scaler
        # read before the scaler's update: a bucket reduced again below changes the norm
        before = torch.stack([scaler.scale, scaler.at_min_scale().float()]).double().to(self.device)
        values = torch.cat([norm.double().reshape(1), before, stats[1:]]).tolist()  # the one host sync
        n = len(self._params)
        redo = [b for b, d in enumerate(values[3 + n :]) if d > 0]
        if redo:
            self._reducer.reduce_again(redo, self._finish_reduction)
            local = self._norm_squared(shard, inv)
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.process_group)
            norm = local[0].sqrt().float()
            values[0] = norm.item()
        found_inf = torch.zeros((), dtype=torch.float32, device=scaler.device)
        if self._checks_grads:
            found_inf = (~torch.isfinite(norm)).to(device=found_inf.device, dtype=torch.float32)
        scaler.update(found_inf)
        skipped = self._checks_grads and not math.isfinite(values[0])
        after = scaler.loss_scale if skipped else values[1]  # read for the skip's log line only
        self._record_step(
            [skipped, values[2], values[1], after], values[0], where=" on some rank", log=self.rank == 0
        )
        # the shard is unscaled (and clipped) in place: it cannot be applied again nor added to
        self._reducer.mark_applied()
        if self._s.step_was_skipped:
            return
        used_anywhere = values[3 : 3 + n]
        coef = None
        if self.max_grad_norm is not None:
            coef = clip_coefficient(self.max_grad_norm, norm).to(shard.device)
        if inv is not None:
            inv = inv.to(shard.device)
            coef = inv if coef is None else inv * coef
        if self._fused is not None:
            # applies coef to the grads as it reads them and writes the 16-bit params
            self._fused.step(shard, used_anywhere, coef)
        else:
            for i, piece_param in self._piece_params.items():
                if used_anywhere[i] == 0:  # torch steps no param without a grad
                    piece_param.grad = None
            if coef is not None:
                shard.mul_(coef)
            self.optimizer.step()
        # the fused kernel wrote the 16-bit shards (fp32 params are its masters: they are copied)
        self._publish(rounded=self._fused is not None and self.dtype != torch.float32)

    @torch.no_grad()
    def _publish(self, *, rounded: bool = False) -> None:
        """Round this rank's masters into its shard of the flat params (unless ``rounded``: the shard holds them
        already, as split masters' always does) and all-gather every bucket."""
        if not rounded:
            self._masters.round_into_params()
        works = []
        for b, lo, hi in self._masters.shards():
            out = self.flat_param[b.start : b.start + b.numel]
            works.append(_all_gather(out, self.flat_param[lo:hi], group=self.process_group, async_op=True))
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the grads of every param of the groups, frozen ones included (as torch does).

        At stage 1 the model grads are views of one buffer: they are zeroed, not freed. ``set_to_none=False``
        keeps torch's meaning: a param that has had a grad since the last ``set_to_none=True`` call keeps a
        zero grad and is stepped (momentum and weight decay still move it).
        """
        self._masters.release()
        self._reducer.zero_grad(set_to_none)
        for p in self._piece_params.values():
            p.grad = None
        clear_grads(self._frozen, set_to_none)
        self._s.unscaled = False

    # --- rank-local checkpoint state (same world size only; see checkpoint.py for resharding) ----------
    def _fingerprint(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "names": list(self._names),
            "numels": list(self.layout.numels),
            "bucket_numels": [b.numel for b in self.layout.buckets],
        }

    def _payload(self) -> dict[str, Any]:
        """This rank's state: inner optimizer state over its pieces, its fp32 masters (split masters: joined, a
        copy) and the layout it was saved from."""
        masters = self._masters.join()
        return {
            "layout": self._fingerprint(),
            "optimizer": self.optimizer.state_dict(),
            "masters": masters.detach(),
        }

    def _check_payload(self, state_dict: dict[str, Any]) -> None:
        saved, mine = state_dict.get("layout"), self._fingerprint()
        if isinstance(saved, dict) and isinstance(saved.get("names"), list):
            # clean names on both sides: a state dict saved before names were cleaned holds `_orig_mod.` ones
            saved = {**saved, "names": [clean_name(n) if isinstance(n, str) else n for n in saved["names"]]}
        if saved != mine:
            saved = saved if isinstance(saved, dict) else {}
            differs = "; ".join(
                f"{k} {saved.get(k)} (here {v})" for k, v in mine.items() if saved.get(k) != v
            )
            raise ValueError(
                f"rank-local state dict does not match this layout: {differs}. It loads into the same model's "
                "optimizer (param groups, bucket_size) on the same rank at the same world size; to change any, "
                "save and load with halfprec.distributed.checkpoint"
            )

    def _load_payload(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` of the same rank at the same world size and layout."""
        inner = state_dict["optimizer"]
        self._masters.release()
        self.optimizer.load_state_dict(inner)
        restore_state_dtypes(self.optimizer, inner["state"], self._index_params())
        self._masters.load(state_dict["masters"])
        self._masters.restore()
        self._publish()

    _TORCH_STATE_REFUSED = (
        "a plain torch optimizer state dict holds whole params, and this optimizer holds pieces of them on "
        "each rank: load model-space checkpoints with halfprec.distributed.checkpoint.load(...), or this "
        "optimizer's own state_dict() at the same world size"
    )

    def restore_counters(self, scaler_state: dict[str, Any], skipped_steps: int) -> None:
        """After a model-space checkpoint load put masters, state and groups in place: the scaler and counters,
        then the masters rounded into the model on every rank (split masters: the joined pieces the load wrote
        split back first)."""
        self.loss_scaler.load_state_dict(scaler_state)
        self._s.skipped_steps = int(skipped_steps)
        self._masters.restore()
        self._publish()

    # --- model-space view (used by halfprec.distributed.checkpoint) ---------------------------------------
    def model_space(self) -> Iterator[tuple[str, torch.Size, int, Any, torch.nn.Parameter | None]]:
        """``(name, shape, group index, piece or None, piece param or None)`` for every trainable param (split
        masters: the pieces view their joined fp32 values, see the module docstring)."""
        self._masters.join()
        for i, name in enumerate(self._names):
            piece = self.layout.piece_of.get(i)
            yield name, self._params[i].shape, self._group_of[i], piece, self._piece_params.get(i)

    def release_model_space(self) -> None:
        """Free what ``model_space()`` built for a checkpoint (split masters: the joined fp32 buffer, 4 B per
        element of this rank's shards); a checkpoint save calls it when done."""
        self._masters.release()

    def __repr__(self) -> str:
        return (
            f"ShardedMixedPrecisionOptimizer({self.optimizer!r}, stage={self.stage}, world_size={self.world_size}, "
            f"reduce_dtype={self.reduce_dtype!r}, impl={self.impl!r}, masters={self.masters!r}, "
            f"loss_scaler={self.loss_scaler!r})"
        )
