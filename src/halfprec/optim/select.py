"""The one factory: ``build(optimizer, **options)`` validates every option, then picks the strategy.

``MixedPrecisionOptimizer(...)``, ``halfprec.initialize`` and every integration call it, so an option means the
same on every machine: it is honoured, or a ValueError says why this strategy cannot take it and how to get one
that can. The choice, in order (``policy.py`` says when the fused kernels can run):

* params sharded by ``fully_shard`` (FSDP2's DTensors): a strategy over their local shards (``mesh.py``), picked
  as below for unsharded params (the fused kernels write 16-bit shards in place); the options that cannot apply
  to them (``stage``, ``process_group``, a ``param_dtype`` cast of fp32 shards) raise a ValueError naming the fix;
* ``stage`` 1 or 2: the sharded strategy (ZeRO-1/2, ``sharded/``), whose local step ``impl`` picks;
* ``masters="split"``: the fused strategy, which alone keeps split masters (ValueError when it cannot run);
* else ``impl``: ``"torch"`` the exact strategy (``exact.py``); ``"triton"`` the fused one (ValueError when it
  cannot run); ``"auto"`` the fused one when it can run, else the exact one.
"""

from __future__ import annotations

from typing import Any

import torch

from ..scaler import LossScaler
from .accumulate import check_process_group
from .base import MixedPrecisionOptimizer, check_wrappable, register_factory
from .checks import check_elementwise, check_grad_accum_dtype, check_options
from .exact import ExactMixedPrecisionOptimizer
from .masters import check_masters
from .mesh import Mesh, check_sharded_options
from .policy import IMPLS, fused_class, fused_unsupported_reason, select_impl

__all__ = ["STAGES", "build", "fused_from_torch"]

STAGES = (0, 1, 2)  # ZeRO stages: 0 unsharded, 1 masters and state sharded, 2 grads too
_SHARDED_ONLY = ("named_parameters", "reduce_dtype", "bucket_size")


def build(
    optimizer: torch.optim.Optimizer, *, loss_scaler: LossScaler | None = None, max_grad_norm: float | None = None,
    skip_nonfinite: bool = True, param_dtype: torch.dtype | None = None, impl: str = "auto", stage: int = 0,
    masters: str = "fp32", grad_accum_dtype: str = "param", process_group: Any = None,
    named_parameters: Any = None, reduce_dtype: str | None = None, bucket_size: int | None = None,
    tool_flags: bool = False,
) -> MixedPrecisionOptimizer:  # fmt: skip
    """The halfprec optimizer over ``optimizer`` for these options.

    Args:
        optimizer, loss_scaler, max_grad_norm, skip_nonfinite, param_dtype: ``MixedPrecisionOptimizer``'s.
        impl: ``"auto"``, ``"torch"`` or ``"triton"`` (module docstring; at stages 1/2 the local step's).
        stage: ZeRO stage, 0 (default), 1 (masters and optimizer state sharded over ``process_group``) or 2
            (grads too).
        masters: ``"fp32"`` or ``"split"`` (bf16 params only; the fused kernels: docs/split-masters.md).
        grad_accum_dtype: ``"param"`` (micro-batch grads summed in the params' 16-bit ``.grad``) or ``"fp32"``
            (summed in fp32 as backward produces them).
        process_group: stage 0: ``None``, or a group with ``grad_accum_dtype="fp32"`` (ZeRO-0: the fp32
            sums are all-reduced at the step; no DDP). Stages 1/2: the data-parallel group (None: the default).
        named_parameters: stages 1/2: the model (or its ``named_parameters()``), whose names key checkpoints.
        reduce_dtype: stages 1/2: ``"fp32"`` (default) or ``"param"``. bucket_size: stages 1/2, in elements.
        tool_flags: the groups' ``foreach``/``fused`` flags were set by a tool (the HF Trainer's default
            ``adamw_torch_fused``), not the user, so they do not ask for torch's kernels.
    """
    check_wrappable(optimizer)
    check_options(
        loss_scaler=loss_scaler,
        max_grad_norm=max_grad_norm,
        param_dtype=param_dtype,
        skip_nonfinite=skip_nonfinite,
    )
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (the ZeRO stage), got {stage!r}")
    trained = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    mesh = Mesh.of(trained)
    if mesh is not None:
        check_elementwise(optimizer, "each rank's FSDP2 shards of the params")
        check_sharded_options(
            trained,
            param_dtype=param_dtype,
            process_group=process_group,
            stage=stage,
        )
    check_masters(masters, [param_dtype, *(p.dtype for p in trained)])
    check_grad_accum_dtype(
        grad_accum_dtype, strategy="sharded" if stage or mesh else "torch", process_group=process_group
    )
    options = dict(
        loss_scaler=loss_scaler, max_grad_norm=max_grad_norm, skip_nonfinite=skip_nonfinite,
        param_dtype=param_dtype, grad_accum_dtype=grad_accum_dtype, process_group=process_group,
    )  # fmt: skip
    sharded_only = dict(named_parameters=named_parameters, reduce_dtype=reduce_dtype, bucket_size=bucket_size)
    check_process_group(process_group, grad_accum_dtype, stage=stage)
    if masters == "split":  # the fused kernels keep them, at every stage
        if impl == "torch":
            raise ValueError(
                "masters='split' is kept by the fused kernels, and impl='torch' asks for the torch update: use "
                "impl='auto' or 'triton' (CUDA params, Triton installed), or masters='fp32'"
            )
        reason = fused_unsupported_reason(
            optimizer,
            explicit=impl == "triton",
            tool_flags=tool_flags,
            instead="masters='fp32' (every strategy)",
        )
        if reason is not None:
            raise ValueError(
                f"masters='split' runs on the fused kernels, which cannot take this optimizer: {reason}"
            )
    if stage:
        if named_parameters is None:
            raise ValueError(
                f"stage={stage} needs named_parameters=model (or model.named_parameters()): the names key its "
                "checkpoints, which reshard across world sizes"
            )
        from .sharded import ShardedMixedPrecisionOptimizer  # noqa: PLC0415 - imports torch.distributed's parts

        given = {k: v for k, v in sharded_only.items() if v is not None}
        return ShardedMixedPrecisionOptimizer(
            optimizer, stage=stage, impl=impl, masters=masters, **given, **options
        )
    for name, value in sharded_only.items():
        if value is not None:
            raise ValueError(
                f"{name}={value!r} applies to the sharded strategy (stage 1 or 2), and stage is 0: pass stage=1 "
                f"or 2, or leave {name} out"
            )
    if masters == "split":
        return fused_from_torch(optimizer, masters="split", **options)
    # FSDP2's shards as unsharded params (the fused kernels write 16-bit shards in place)
    if select_impl(optimizer, impl, tool_flags=tool_flags) == "triton":
        return fused_from_torch(optimizer, **options)
    return ExactMixedPrecisionOptimizer(optimizer, **options)


register_factory(build)

_SKIP_KEYS = {"params", "foreach", "fused", "capturable", "differentiable"}


def fused_from_torch(optimizer: torch.optim.Optimizer, **options: Any) -> MixedPrecisionOptimizer:
    """The fused optimizer equivalent to ``optimizer``: it takes over the very param-group dicts (so an LR
    scheduler built on ``optimizer`` drives the kernel, and state dicts carry over) and moves the state (held
    once); ``optimizer`` is never stepped, and its params become views of the fused optimizer's flat buffers.
    ``options``: the fused optimizers' keyword options."""
    cls = fused_class(optimizer)
    if cls is None:
        raise ValueError(
            f"{type(optimizer).__name__} has no fused kernel (torch Adam, AdamW, SGD and Adagrad do)"
        )
    saved_state = optimizer.state_dict() if len(optimizer.state) else None
    groups = [
        {k: v for k, v in g.items() if k not in _SKIP_KEYS} | {"params": list(g["params"])}
        for g in optimizer.param_groups
    ]
    fused = cls(groups, **options)
    fused.param_groups = optimizer.param_groups
    if saved_state is not None:
        fused.load_state_dict(saved_state)
        optimizer.state.clear()
    fused.adopt_scheduler_target(optimizer)
    return fused
