"""``halfprec.initialize`` with ``zero_stage`` 1 or 2: the sharded optimizer built from a ``Config``."""

from __future__ import annotations

import torch

from ..config import Config
from ..optim.sharded import ShardedMixedPrecisionOptimizer
from ..precision import DTYPES
from ..scaler import LossScaler

__all__ = ["sharded_engine_optimizer"]


def sharded_engine_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config, loss_scaler: LossScaler | None
) -> ShardedMixedPrecisionOptimizer:
    """Wrap ``optimizer`` for ``config.zero_stage``; an fp32 model is cast to ``config.precision`` (masters keep
    its fp32 weights), as the unsharded engine path does; buffers and untrained params are cast too."""
    dtype = DTYPES[config.precision]
    trained = {p for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p in trained and p.requires_grad and p.dtype not in (torch.float32, dtype):
            raise ValueError(
                f"param {name!r} is {p.dtype} but precision={config.precision!r}; pass the model in fp32 (halfprec "
                "casts it) or set precision to match"
            )
    param_dtype = None if dtype == torch.float32 else dtype
    opt = ShardedMixedPrecisionOptimizer(
        optimizer,
        named_parameters=model,
        stage=config.zero_stage,
        loss_scaler=loss_scaler,
        max_grad_norm=config.max_grad_norm,
        skip_nonfinite=config.skip_nonfinite,
        param_dtype=param_dtype,
        reduce_dtype=config.reduce_dtype,
        impl=config.impl,
    )
    if param_dtype is not None:
        with torch.no_grad():
            for p in model.parameters():
                if (
                    not (p in trained and p.requires_grad)
                    and p.is_floating_point()
                    and p.dtype != param_dtype
                ):
                    p.data = p.data.to(param_dtype)
            for mod in model.modules():
                for name, buf in mod.named_buffers(recurse=False):
                    if buf.is_floating_point() and buf.dtype != param_dtype:
                        setattr(mod, name, buf.to(param_dtype))
    return opt
