"""The scalar slots the fused kernels share: what each column of ``hp`` and ``pscal`` holds, per algorithm.

Legend (one row of each table per group or per param):

- ``hp``, fp64 [groups, HP_WIDTH]: a group's hyper-parameters, written on the host (``hp_row``) and copied to
  the device before each step (``HyperTable``); read only by the finalize program (``norm.py``).
- ``pscal``, fp32 [params, PSCAL_WIDTH]: a param's scalars for this step, written by the finalize program from
  its group row and step count (LAMB's trust pass writes ``AdamScalars.TRUST``); read by the update kernels.

Columns a table does not name stay 0. The kernels receive a table as a ``tl.constexpr`` argument, so
``ps + S.EPS`` folds to the same constant offset a literal would, and since a table's repr lists every slot
number, renumbering a slot changes Triton's cache key. No Triton import: the optimizer classes use this module
at import time.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import torch

__all__ = [
    "Kind", "HyperTable", "ALIGN", "HP_WIDTH", "PSCAL_WIDTH", "HP_SLOTS", "PSCAL_SLOTS", "hp_row",
    "AdamHp", "SgdHp", "AdagradHp", "ADAM_HP", "SGD_HP", "ADAGRAD_HP",
    "AdamScalars", "SgdScalars", "AdagradScalars", "ADAM_PSCAL", "SGD_PSCAL", "ADAGRAD_PSCAL",
]  # fmt: skip


class Kind(IntEnum):
    """The algorithm a fused optimizer runs: picks the finalize program's branch and the slot tables."""

    ADAM = 0  # Adam and AdamW
    SGD = 1
    ADAGRAD = 2
    LAMB = 3


# Elements. Each param of the fused layout starts and ends at a multiple of ALIGN, so ``ALIGNED`` rows may tell
# Triton so and get vectorised loads and stores (``optim/layout.py`` pads to the same 16).
ALIGN = 16
HP_WIDTH = 8
PSCAL_WIDTH = 16


# --- hp: fp64, written by ``hp_row`` on the host, read by the finalize program ---------------------------------
class AdamHp(NamedTuple):
    """Adam, AdamW and LAMB."""

    LR: int = 0
    BETA1: int = 1
    BETA2: int = 2
    EPS: int = 3
    WEIGHT_DECAY: int = 4
    DECOUPLED: int = 5  # 1.0: AdamW's decay of the master by 1 - lr * wd; 0.0: L2 decay added to the grad


class SgdHp(NamedTuple):
    LR: int = 0
    MOMENTUM: int = 1
    DAMPENING: int = 2
    WEIGHT_DECAY: int = 3
    NESTEROV: int = 4  # 1.0 or 0.0


class AdagradHp(NamedTuple):
    LR: int = 0
    LR_DECAY: int = 1
    WEIGHT_DECAY: int = 2
    EPS: int = 3


# --- pscal: fp32, written by the finalize program, read by the update kernels ----------------------------------
# ``t`` is the param's step count after this step; bc1 = 1 - beta1**t and bc2 = 1 - beta2**t are computed in fp64
# and cast once, as torch does with its Python-double scalars.
class AdamScalars(NamedTuple):
    """Adam, AdamW (``update.py``) and LAMB (``lamb.py``)."""

    ACTIVE: int = 0  # 1.0 when the param got a grad and the step is not skipped, else 0.0 (every algorithm)
    STEP_SIZE: int = 1  # Adam: lr / bc1; LAMB: 1 / bc1 (LAMB applies lr after the trust ratio)
    BC2_SQRT: int = 2  # sqrt(bc2)
    DECAY: int = 3  # decoupled: 1 - lr * wd (multiplies the master); L2: 1
    WD: int = 4  # L2: wd (adds wd * p to the grad); decoupled: 0
    OMB1: int = 5  # 1 - beta1, the weight of m's lerp towards g
    BETA2: int = 6
    OMB2: int = 7  # 1 - beta2
    EPS: int = 8
    LR: int = 9  # LAMB's apply pass
    WD_RAW: int = 10  # the group's weight_decay whatever its kind (LAMB's update term wd * p)
    TRUST: int = 11  # LAMB only: ||p|| / ||u||, written by lamb._lamb_trust_kernel


class SgdScalars(NamedTuple):
    ACTIVE: int = 0
    LR: int = 1
    MOMENTUM: int = 2
    OMD: int = 3  # 1 - dampening
    WD: int = 4
    FIRST: int = 5  # 1.0 at the param's first step: the momentum buffer starts as the grad itself
    NESTEROV: int = 6  # 1.0 or 0.0
    HAS_MOMENTUM: int = 7  # 1.0 when momentum != 0 (the buffer exists), else 0.0


class AdagradScalars(NamedTuple):
    ACTIVE: int = 0
    CLR: int = 1  # lr / (1 + (t - 1) * lr_decay)
    WD: int = 2
    EPS: int = 3


ADAM_HP, SGD_HP, ADAGRAD_HP = AdamHp(), SgdHp(), AdagradHp()
ADAM_PSCAL, SGD_PSCAL, ADAGRAD_PSCAL = AdamScalars(), SgdScalars(), AdagradScalars()
HP_SLOTS = {Kind.ADAM: ADAM_HP, Kind.SGD: SGD_HP, Kind.ADAGRAD: ADAGRAD_HP, Kind.LAMB: ADAM_HP}
PSCAL_SLOTS = {Kind.ADAM: ADAM_PSCAL, Kind.SGD: SGD_PSCAL, Kind.ADAGRAD: ADAGRAD_PSCAL, Kind.LAMB: ADAM_PSCAL}


def hp_row(table: NamedTuple, **values: Any) -> list[Any]:
    """One group's ``hp`` row: ``values`` keyed by ``table``'s slot names (a float or a 0-d tensor), 0.0 elsewhere."""
    row: list[Any] = [0.0] * HP_WIDTH
    for name, value in values.items():
        row[getattr(table, name)] = value
    return row


class HyperTable:
    """The ``hp`` table on the device (``table``), for the fused optimizers and the sharded fused local step. Plain
    values are uploaded when one changes; 0-d tensor values are copied at every upload."""

    def __init__(self, n_groups: int, device: torch.device) -> None:
        self.table = torch.zeros(n_groups, HP_WIDTH, dtype=torch.float64, device=device)
        self._key: Any = None

    def upload(self, rows: list[list[Any]], capturing: bool = False) -> None:
        tensor = torch.Tensor
        rows = [[v if isinstance(v, tensor) else float(v) for v in row] for row in rows]
        key = tuple([tuple([None if isinstance(v, tensor) else v for v in row]) for row in rows])
        if key != self._key:
            if capturing:
                raise RuntimeError(
                    "a param group's hyper-parameters changed while a CUDA graph was being captured; run one "
                    "eager step first, and use 0-d device tensors for values that change between replays "
                    "(group['lr'] = torch.tensor(lr, device='cuda'))"
                )
            cpu = torch.tensor([[0.0 if v is None else v for v in row] for row in key], dtype=torch.float64)
            self.table.copy_(cpu, non_blocking=True)
            self._key = key
        for gi, row in enumerate(rows):
            for k, v in enumerate(row):
                if isinstance(v, tensor):
                    self.table[gi, k].copy_(v, non_blocking=True)
