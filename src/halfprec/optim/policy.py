"""The ``impl=`` policy: whether the fused kernels can take an optimizer here (the factory, ``select.py``, and the
sharded strategy's local step read it).

``impl="auto"`` takes the fused path when the wrapped optimizer is exactly torch
``Adam``, ``AdamW``, ``SGD`` or ``Adagrad``, every trainable param is on CUDA, Triton imports, the inner
``foreach``/``fused`` flags are left at None (an explicit flag asks for that torch implementation) and no flag the
kernels lack (``amsgrad``, ``maximize``, ``capturable``, ``differentiable``) is on; else the torch path.
``impl="triton"`` overrides an explicit ``foreach``/``fused`` and raises a ValueError naming the reason and the fix
when the rest does not hold (under ``TRITON_INTERPRET=1`` it accepts CPU params, for the interpreter tests);
``impl="torch"`` always takes the torch path.
"""

from __future__ import annotations

import torch

from ..kernels import interpreted, triton_status
from .checks import wrapped_types
from .chunk import interpreter_reason

__all__ = ["IMPLS", "fused_class", "fused_unsupported_reason", "select_impl", "unsupported_flag"]

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def unsupported_flag(groups: list[dict], instead: str = "impl='torch'") -> str | None:
    """The first group flag the fused kernels lack, as a reason that ends in ``instead``, the fix; or None."""
    for i, group in enumerate(groups):
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag, False):
                return f"param group {i} has {flag}=True, which the fused kernels do not implement; use {instead}"
    return None


IMPLS = ("auto", "torch", "triton")


def fused_class(optimizer: torch.optim.Optimizer):
    from .fused import FusedAdagrad, FusedAdam, FusedAdamW, FusedSGD

    return {
        torch.optim.AdamW: FusedAdamW,
        torch.optim.Adam: FusedAdam,
        torch.optim.SGD: FusedSGD,
        torch.optim.Adagrad: FusedAdagrad,
    }.get(type(optimizer))


def fused_unsupported_reason(
    optimizer: torch.optim.Optimizer,
    *,
    explicit: bool,
    tool_flags: bool = False,
    instead: str = "impl='torch'",
) -> str | None:
    """Why the fused path cannot take ``optimizer`` (None when it can), naming ``instead`` as the way out.
    ``explicit``: impl='triton' was asked; ``tool_flags``: a tool, not the user, set the groups'
    ``foreach``/``fused`` flags, which then select nothing."""
    if fused_class(optimizer) is None:
        return f"{type(optimizer).__name__} has no fused kernel (torch Adam, AdamW, SGD and Adagrad do); use {instead}"
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("foreach", "fused"):
            if group.get(flag) is not None and not (explicit or tool_flags):
                return f"param group {i} sets {flag}={group[flag]!r} explicitly, which selects a torch kernel"
    flag = unsupported_flag(optimizer.param_groups, instead)
    if flag is not None:
        return flag
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    wrapped = wrapped_types(params)
    if wrapped:
        return (
            f"params of type {wrapped} wrap another tensor and have no storage of their own, and the fused kernels "
            f"write params through theirs (views of one flat buffer, or FSDP2's shards in place): torchao's float8 "
            f"all-gather weights; use {instead}"
        )
    off_cuda = sorted({str(p.device) for p in params if p.device.type != "cuda"})
    on_interpreter = explicit and interpreted()  # CPU tests of the kernels
    if off_cuda and not on_interpreter:
        return f"params on {off_cuda}; the fused kernels need CUDA params: move the model to CUDA or use {instead}"
    if (why := interpreter_reason(params)) is not None:
        return f"{why}: unset TRITON_INTERPRET or use {instead}"
    odd = sorted(
        {str(p.dtype) for p in params if p.dtype not in (torch.float16, torch.bfloat16, torch.float32)}
    )
    if odd:
        return f"params of dtype {odd}; the fused kernels train fp16, bf16 and fp32 params: use {instead}"
    return triton_status()[1] or None  # the reason Triton cannot run here, "" when it can


def select_impl(optimizer: torch.optim.Optimizer, impl: str, *, tool_flags: bool = False) -> str:
    """``impl`` resolved to "torch" or "triton" for ``optimizer`` (``tool_flags``: ``fused_unsupported_reason``)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    reason = fused_unsupported_reason(optimizer, explicit=impl == "triton", tool_flags=tool_flags)
    if reason is None:
        return "triton"
    if impl == "triton":
        raise ValueError(f"impl='triton' cannot be honoured: {reason}")
    return "torch"
