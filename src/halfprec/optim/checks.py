"""Checks every halfprec optimizer makes (the exact, fused and sharded strategies alike): its options, the torch
optimizer it is given, unfrozen params and their dtypes; and the pieces of the torch.optim contract
they share (zero_grad's grad clearing, telling LR schedulers that a step ran)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._checks import check_max_grad_norm
from ..precision import check_grad_accum, check_low_precision
from ..scaler import LossScaler
from .mesh import is_dtensor, local

__all__ = [
    "ELEMENTWISE", "check_elementwise", "check_dtypes", "check_grad_accum_dtype", "check_options", "check_params", "check_torch_optimizer",
    "check_unfrozen", "check_unwrapped", "clear_grads", "set_data", "tell_schedulers", "world_size", "wrapped_types", "wraps_tensor",
]  # fmt: skip


# Optimizers whose update of an element depends only on that element's grad, state and the group's scalars:
# stepping a piece of a param (a ZeRO-1/2 piece, an FSDP2 shard) is then exactly stepping the param. LAMB, LARS,
# Adafactor, Muon, Shampoo and LBFGS need whole tensors (norms, factored moments, orthogonalisation).
ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adadelta,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop,
    torch.optim.ASGD,
)  # fmt: skip


def check_elementwise(optimizer: torch.optim.Optimizer, pieces: str) -> None:
    """ValueError unless ``optimizer`` is one of ``ELEMENTWISE``: ``pieces`` says what it would step."""
    if not isinstance(optimizer, ELEMENTWISE):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise ValueError(
            f"{type(optimizer).__name__} is not a known elementwise optimizer, and it would step {pieces}, which "
            f"is exact only for {names}. Optimizers that need whole tensors (LAMB, LBFGS, Adafactor, Muon) run "
            "unsharded: MixedPrecisionOptimizer + DistributedDataParallel (stage 0)"
        )


def check_options(
    *, loss_scaler: Any = None, max_grad_norm: Any = None, param_dtype: Any = None, skip_nonfinite: Any = True
) -> None:
    """Raise ValueError naming the value and the fix for a bad ``loss_scaler``, ``max_grad_norm`` or ``param_dtype``."""
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ValueError(
            f"loss_scaler must be a halfprec StaticLossScaler or DynamicLossScaler, got {type(loss_scaler).__name__}"
        )
    check_max_grad_norm(max_grad_norm)
    if not isinstance(skip_nonfinite, bool):
        raise ValueError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
    check_low_precision(param_dtype, allow_fp32=True)


def world_size() -> int:
    """Ranks in the default process group; 1 when torch.distributed is not initialised."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def check_grad_accum_dtype(value: Any, *, strategy: str = "torch", process_group: Any = None) -> str:
    """``value`` when it is ``"param"`` (sum in the params' 16-bit ``.grad``) or ``"fp32"`` (in fp32); else
    ValueError. On the unsharded strategies (``"torch"``, ``"fused"``) fp32 sums across ranks only with
    ``process_group`` (``accumulate.py``: DDP would reduce 16-bit grads); ``"sharded"``: ZeRO-1/2, or params
    sharded by FSDP2, which reduces each grad before the fp32 sum."""
    if check_grad_accum(value) == "param":
        return value
    if strategy != "sharded" and process_group is None and world_size() > 1:
        raise ValueError(
            f"grad_accum_dtype='fp32' with a process group of {world_size()} ranks: DDP's all-reduce "
            "reads the 16-bit .grad that fp32 accumulation releases; data-parallel fp32 accumulation is halfprec's "
            "own, without DDP: pass process_group=torch.distributed.group.WORLD (ZeRO-0: the fp32 sums are "
            "all-reduced at the step; do not wrap the model in DDP), or "
            "MixedPrecisionOptimizer(..., stage=1 or 2, grad_accum_dtype='fp32', named_parameters=model), or use "
            "grad_accum_dtype='param'"
        )
    return value


def check_unfrozen(frozen: Iterable[torch.Tensor]) -> None:
    """Raise when a param that was frozen when the optimizer was built has been unfrozen and got a grad: it has
    no FP32 master (nor shard, nor fused slot), and applying its 16-bit, still loss-scaled grad or dropping it
    would both be silent. A still-frozen param with a stale ``.grad`` is left alone, as the user froze it."""
    for p in frozen:
        if p.requires_grad and p.grad is not None:
            raise RuntimeError(
                f"a param of shape {tuple(p.shape)} and dtype {p.dtype} was frozen (requires_grad=False) when the "
                "optimizer was wrapped and has a gradient now: halfprec made no FP32 master for it, so it cannot "
                "be trained. Set requires_grad=True on every param you will train before wrapping (freeze them "
                "afterwards: params without a grad are not updated), or wrap a new optimizer after unfreezing."
            )


def check_dtypes(params: Iterable[torch.Tensor], dtypes: Iterable[torch.dtype]) -> None:
    """Raise when a trained param's dtype is no longer the one it had when the optimizer was wrapped
    (``model.half()`` after wrapping a bf16 model would train fp16 without loss scaling, silently)."""
    for p, dtype in zip(params, dtypes, strict=True):
        if p.dtype != dtype:
            raise RuntimeError(
                f"a trained param of shape {tuple(p.shape)} is {p.dtype} now but was {dtype} when the optimizer "
                "was wrapped: its masters, loss scaling and state were set up for that dtype. Cast the model "
                "(model.to(dtype)) before wrapping the optimizer, and do not change its dtype afterwards"
            )


def set_data(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.data = value``, ``p`` staying the same object. A tensor subclass that wraps another tensor (torchao's
    float8 weights under FSDP2's float8 all-gather) keeps it in an attribute that ``.data =`` does not reach, so it
    would compute with the old tensor: it is swapped in whole, as ``nn.Module.to()`` does (hooks registered on
    the param are not carried over, as there; a grad is refused: it would be dropped)."""
    if not (is_traceable_wrapper_subclass(p) or is_traceable_wrapper_subclass(value)):
        p.data = value
        return
    what = f"a {type(p).__name__} param of shape {tuple(p.shape)}"
    if p.grad is not None:
        raise ValueError(
            f"{what} has a grad, which casting it (a swap, as nn.Module.to() does) would drop: cast the model "
            "(model.to(dtype)) or call zero_grad() before wrapping the optimizer"
        )
    try:
        torch.utils.swap_tensors(p, torch.nn.Parameter(value, requires_grad=p.requires_grad))
    except RuntimeError as e:
        raise ValueError(
            f"{what} cannot be cast in place ({e}): cast the model (model.to(dtype)) before anything holds a "
            "reference to its params (torch.compile, an optimizer), then wrap the optimizer"
        ) from None


def wraps_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass that wraps another tensor (torchao's float8 weights), DTensors (FSDP2's
    shards, ``mesh.is_dtensor``) aside."""
    return is_traceable_wrapper_subclass(t) and not is_dtensor(t)


def wrapped_types(params: Iterable[torch.Tensor]) -> list[str]:
    """The names of the ``wraps_tensor`` subclasses among ``params`` (of a DTensor's local shard): the fused
    kernels and the sharded strategy write params through their storage, which such a subclass does not have."""
    return sorted({type(local(p)).__name__ for p in params if wraps_tensor(local(p))})


def check_unwrapped(params: Iterable[torch.Tensor], owner: str, instead: str) -> None:
    """ValueError, before anything changes, when ``owner`` (which writes the params through their storage) is
    given params that wrap another tensor (``wrapped_types``)."""
    wrapped = wrapped_types(params)
    if wrapped:
        raise ValueError(
            f"{owner} writes the params through their storage (as views of one flat buffer, or FSDP2's shards in "
            f"place), and params of type {wrapped} wrap another tensor and have none of their own (torchao's "
            f"float8 weights with FSDP2's float8 all-gather): {instead}"
        )


def clear_grads(params: Iterable[torch.Tensor], set_to_none: bool) -> None:
    """What ``torch.optim.Optimizer.zero_grad`` does to each param's ``.grad``."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None and set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()


def tell_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer`` as stepped for torch's LR schedulers built on it: they warn "lr_scheduler.step()
    before optimizer.step()" unless the flag their wrapper of its ``step()`` sets is there, and a fused step
    replaces that ``step()`` without calling it."""
    optimizer._opt_called = True


def check_params(params: list, known: set) -> None:
    seen: set = set()
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"optimizer params must be tensors, got {type(p).__name__}")
        if not p.is_floating_point():
            raise ValueError(
                f"param of shape {tuple(p.shape)} has dtype {p.dtype}; halfprec trains floating-point params "
                "only: remove it from the optimizer or make it a buffer"
            )
        if p in seen or p in known:
            raise ValueError(
                f"param of shape {tuple(p.shape)} appears twice in the optimizer's groups; list each param "
                "in exactly one group"
            )
        seen.add(p)


def check_torch_optimizer(optimizer: Any) -> None:
    """Raise ValueError unless ``optimizer`` is a torch optimizer halfprec can wrap (not an already-wrapped one:
    the caller checks that, knowing the halfprec base class)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}; build one over the model's "
            "params, e.g. torch.optim.AdamW(model.parameters())"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "LBFGS re-evaluates the closure inside step(), which a master-weight wrapper cannot unscale or "
            "check; use it in fp32 without halfprec"
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(
                f"param group {i} has differentiable=True; halfprec's step runs under no_grad: build the "
                "optimizer with differentiable=False"
            )
    check_params([p for g in optimizer.param_groups for p in g["params"]], known=set())
