"""Which Lightning strategies take the halfprec plugins, and :class:`HalfprecModelParallelStrategy`, the one for
FSDP2: Lightning's ``ModelParallelStrategy`` with checkpoints that carry halfprec's optimizers.

The Trainer: DDP and one device take the plugin as they are; ``FSDPStrategy`` (FSDP1) and ``DeepSpeedStrategy``
bring their own masters and precision and are refused (Lightning itself gives FSDPStrategy no precision plugin
but its own). Under ``ModelParallelStrategy`` the module shards itself in ``configure_model`` (``fully_shard``);
the plugin recasts the shards and wraps the optimizer over them (``lightning.py``), and the step is halfprec's
over each rank's rows (the plugin's ``impl``). What ``ModelParallelStrategy`` cannot do is checkpoint that
optimizer: it saves and loads every optimizer through ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict``/``set_optimizer_state_dict``, which read torch's own state-dict format and first
step an optimizer that has no state yet on zero grads (a step halfprec never takes).
:class:`HalfprecModelParallelStrategy` saves each one with ``halfprec.distributed.checkpoint`` instead, into
``<checkpoint>/halfprec-optimizer-<i>`` (each rank its rows, loadable at any world size), and leaves the model,
the loops and the schedulers to Lightning; the plain ``ModelParallelStrategy`` is refused, naming it.

Fabric: ``setup_fabric`` wraps the optimizer before ``fabric.setup``, where Fabric's sharding strategies shard the
module, so they are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..distributed.checkpoint import load as load_optimizer
from ..distributed.checkpoint import save as save_optimizer
from . import require

_strategies = require("lightning.pytorch.strategies", "lightning")
_fabric_strategies = require("lightning.fabric.strategies", "lightning")

__all__ = [
    "HalfprecModelParallelStrategy",
    "check_fabric_strategy",
    "check_trainer_strategy",
    "optimizer_path",
]

_FSDP2 = (
    "strategy=HalfprecModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) with fully_shard in "
    "configure_model (FSDP2; docs/integrations.md)"
)
# Trainer strategies that shard or cast the model themselves, each with its own masters and precision plugin
_REFUSED = {
    _strategies.FSDPStrategy: "it is FSDP1: it wraps the model in FullyShardedDataParallel, whose flat params "
    "and mixed precision are its own (Lightning gives it no precision plugin but its FSDPPrecision). halfprec "
    f"trains FSDP2's shards: use {_FSDP2}",
    _strategies.DeepSpeedStrategy: "DeepSpeed brings its own master weights and loss scaling, and halfprec and "
    f"it are alternatives, not layers: use DDP, one device, or {_FSDP2}",
}


def optimizer_path(checkpoint_path: str | Path, index: int) -> Path:
    """Where :class:`HalfprecModelParallelStrategy` keeps optimizer ``index`` of the checkpoint ``checkpoint_path``."""
    return Path(checkpoint_path) / f"halfprec-optimizer-{index}"


def _unwrap(optimizer: Any) -> Any:
    """The optimizer under Lightning's wrapper, which keeps it in ``_optimizer`` (``lightning.py``)."""
    while hasattr(optimizer, "_optimizer"):
        optimizer = optimizer._optimizer
    return optimizer


class HalfprecModelParallelStrategy(_strategies.ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints hold halfprec optimizers (module docstring); its arguments.

    Checkpoints are distributed ones (a directory, each rank its shards): ``save_distributed_checkpoint=False``
    (one file gathered on rank 0) is refused, since each optimizer's checkpoint is a directory inside it.
    """

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        if not save_distributed_checkpoint:
            raise ValueError(
                "HalfprecModelParallelStrategy(save_distributed_checkpoint=False) would gather the checkpoint into "
                "one file on rank 0, and halfprec's optimizers are saved as directories inside the checkpoint's: "
                "leave save_distributed_checkpoint=True (the checkpoint loads at any world size; halfprec export "
                "writes an optimizer's fp32 masters as one file)"
            )
        super().__init__(data_parallel_size, tensor_parallel_size, True, **kwargs)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # save_checkpoint saves it, beside the model

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        with_optimizers = "optimizer_states" in checkpoint  # not for weights_only=True
        super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        for i, optimizer in enumerate(self.optimizers if with_optimizers else ()):
            save_optimizer(
                _unwrap(optimizer), optimizer_path(path, i), named_parameters=self.lightning_module
            )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        optimizers = self.optimizers
        self.optimizers = []  # Lightning's load would read them through set_optimizer_state_dict
        try:
            loaded = super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            self.optimizers = optimizers
        path = Path(self.broadcast(checkpoint_path))
        for i, optimizer in enumerate(optimizers):
            load_optimizer(
                _unwrap(optimizer), optimizer_path(path, i), named_parameters=self.lightning_module
            )
        return loaded


def check_trainer_strategy(strategy: Any) -> None:
    """ValueError for a Trainer strategy that brings its own masters and precision (FSDP1, DeepSpeed), or that
    cannot checkpoint a halfprec optimizer (``ModelParallelStrategy``: use ``HalfprecModelParallelStrategy``)."""
    for kind, why in _REFUSED.items():
        if isinstance(strategy, kind):
            raise ValueError(
                f"Trainer(strategy={type(strategy).__name__}) cannot take the halfprec plugin: {why}"
            )
    if isinstance(strategy, _strategies.ModelParallelStrategy) and not isinstance(
        strategy, HalfprecModelParallelStrategy
    ):
        raise ValueError(
            "Trainer(strategy=ModelParallelStrategy) saves and loads each optimizer through torch.distributed."
            "checkpoint.state_dict's get/set_optimizer_state_dict, which read torch's own optimizer format, not a "
            "halfprec optimizer's (its checkpoints would fail): use strategy=HalfprecModelParallelStrategy(...) "
            "from halfprec.integrations.lightning, which takes the same arguments, trains the same and saves the "
            "optimizers with halfprec.distributed.checkpoint"
        )


_FABRIC_SHARDING = (
    _fabric_strategies.ModelParallelStrategy,
    _fabric_strategies.FSDPStrategy,
    _fabric_strategies.DeepSpeedStrategy,
)


def check_fabric_strategy(strategy: Any) -> None:
    """ValueError for a Fabric strategy that shards the module in ``fabric.setup`` (``setup_fabric`` wraps the
    optimizer before, over the whole params, whose masters would then train nothing)."""
    if isinstance(strategy, _FABRIC_SHARDING):
        raise ValueError(
            f"Fabric(strategy={type(strategy).__name__}) shards the module inside fabric.setup, after "
            "setup_fabric has built halfprec's masters of the whole params, so the optimizer would train nothing "
            "(and Fabric saves optimizers through torch.distributed.checkpoint.state_dict, which reads torch's own "
            "optimizer format): with Fabric use DDP or one device; for FSDP2 use the Lightning Trainer with "
            "HalfprecModelParallelStrategy, or fully_shard the model in your own loop and build "
            "halfprec.MixedPrecisionOptimizer over its params (docs/distributed.md, FSDP2)"
        )
