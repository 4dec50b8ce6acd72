"""Both halves of the fresh-process resume tests: the parent trains N steps and saves, a child process resumes.

``python -m tests.integrations._resume_child OUT SPEC...`` (cwd: the repository root), each ``SPEC`` being
``framework:precision:checkpoint`` with framework one of ``accelerate``, ``fabric``, ``lightning``. For each
spec the child builds everything anew with another init seed (123), loads the checkpoint, snapshots the loaded
state, continues to the end of the run and snapshots again; ``OUT`` receives ``{"framework/precision":
{"loaded": ..., "final": ...}}`` as plain tensors, lists and numbers (``torch.load(weights_only=True)``).
One child serves every spec, so the import cost of Accelerate and Lightning is paid once.

The run (same for the three tools): accumulation 2, ``FIRST`` optimizer steps before the checkpoint and
``TOTAL`` in all. Infs are injected into both micro-batches of step 1 (before the checkpoint) and of step
``FIRST`` (the child's first step): in fp16 the first spends one unit of the scaler's hysteresis, so the second
backs off only if that spent unit travelled in the checkpoint; the growth tracker is 1 at the checkpoint
(growth every 2 clean steps), so the grown scale later also depends on it.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from ._oracle import DTYPES, Record, make_batches

__all__ = [
    "CHILD_INF_AT",
    "FIRST",
    "FIRST_INF_AT",
    "REF_INF_AT",
    "TOTAL",
    "accelerate_batches",
    "lightning_batches",
    "main",
    "snapshot",
]

FIRST, TOTAL = 3, 6  # optimizer steps before the checkpoint / in the whole run (accumulation 2)
FIRST_INF_AT = (2, 3)  # the parent's micro-batches (step 1)
CHILD_INF_AT = (0, 1)  # the child's micro-batches, counted from its own first backward (step FIRST)
REF_INF_AT = FIRST_INF_AT + tuple(2 * FIRST + i for i in CHILD_INF_AT)  # the uninterrupted run's
SEED = 123  # the child's init seed: only the checkpoint can make its weights right


def accelerate_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole run's micro-batches (Accelerate and Fabric: one pass over 2 * TOTAL batches)."""
    return make_batches(2 * TOTAL)


def lightning_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch's micro-batches (Lightning: the checkpoint is the end of epoch 1 of 2)."""
    return make_batches(2 * FIRST)


def snapshot(module: torch.nn.Module, mp: Any, sched: Any = None, rec: Record | None = None) -> dict:
    """Everything a resume must restore, as plain data: weights, masters, optimizer and scaler state."""
    masters = list(mp.master_params())
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "masters": [m.detach().clone() for m in masters],
        "state": [{k: torch.as_tensor(v).clone() for k, v in mp.state[m].items()} for m in masters],
        "scaler": mp.loss_scaler.state_dict(),
        "skipped_steps": mp.skipped_steps,
        "lrs": [g["lr"] for g in mp.param_groups],
        "sched": None if sched is None else sched.state_dict(),
        "record": None if rec is None else dataclasses.asdict(rec),
    }


def _accelerate(name: str, ckpt: str) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from .test_accelerate import _setup, _train

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    dtype = DTYPES[name]
    acc, model, mp, opt, loader, sched = _setup(dtype, accelerate_batches(), 2, seed=SEED)
    acc.load_state(ckpt)
    loaded = snapshot(model, mp, sched)
    rec = Record()
    _train(acc, model, mp, opt, acc.skip_first_batches(loader, 2 * FIRST), sched, dtype, rec, CHILD_INF_AT)
    return {"loaded": loaded, "final": snapshot(model, mp, sched, rec)}


def _fabric(name: str, ckpt: str) -> dict:
    from .test_fabric import _setup, _train

    fabric, model, opt, sched = _setup(name, seed=SEED)
    fabric.load(ckpt, {"model": model, "optimizer": opt, "scheduler": sched})
    loaded = snapshot(model.module, opt.optimizer, sched)
    rec = Record()
    _train(fabric, model, opt, sched, accelerate_batches()[2 * FIRST :], rec, inf_at=CHILD_INF_AT)
    return {"loaded": loaded, "final": snapshot(model.module, opt.optimizer, sched, rec)}


def _lightning(name: str, ckpt: str) -> dict:
    import lightning.pytorch as L

    from .test_lightning import _fit

    loaded: dict = {}

    class Loaded(L.Callback):
        # Runs after fit(ckpt_path=...) restored weights, optimizer and scheduler, before the first batch.
        def on_train_start(self, trainer, pl_module):
            loaded.update(snapshot(pl_module.net, trainer.optimizers[0], _scheduler(trainer)))

    trainer, model = _fit(
        name,
        lightning_batches(),
        epochs=2,
        seed=SEED,
        inf_at=CHILD_INF_AT,
        ckpt_path=ckpt,
        callbacks=[Loaded()],
    )
    rec = Record(model.losses, model.lrs, model.skipped, model.grad_norms, model.scales)
    return {"loaded": loaded, "final": snapshot(model.net, trainer.optimizers[0], _scheduler(trainer), rec)}


def _scheduler(trainer: Any) -> Any:
    return trainer.lr_scheduler_configs[0].scheduler


_CONTINUE = {"accelerate": _accelerate, "fabric": _fabric, "lightning": _lightning}


def main(argv: list[str]) -> None:
    out, specs = argv[0], argv[1:]
    results = {}
    for spec in specs:
        framework, name, ckpt = spec.split(":", 2)
        results[f"{framework}/{name}"] = _CONTINUE[framework](name, ckpt)
    torch.save(results, Path(out))


if __name__ == "__main__":
    main(sys.argv[1:])
