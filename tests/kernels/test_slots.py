"""The slot tables: every slot fits its row, no two share a column, ``hp_row`` places values by name, and
``HyperTable`` uploads the rows (plain values when one changes, 0-d tensors every time, no change in capture)."""

from __future__ import annotations

import pytest
import torch

from halfprec.kernels import slots


@pytest.mark.parametrize(
    ("table", "width"),
    [(t, slots.HP_WIDTH) for t in set(slots.HP_SLOTS.values())]
    + [(t, slots.PSCAL_WIDTH) for t in set(slots.PSCAL_SLOTS.values())],
)
def test_slots_are_distinct_and_fit_the_row(table, width):
    assert len(set(table)) == len(table)
    assert all(0 <= s < width for s in table)


def test_every_pscal_table_starts_with_active():
    # the update kernels' early exit reads ACTIVE before knowing more than the param's row
    assert all(t.ACTIVE == 0 for t in slots.PSCAL_SLOTS.values())


def test_every_kind_has_its_tables():
    assert set(slots.HP_SLOTS) == set(slots.Kind) == set(slots.PSCAL_SLOTS)


def test_hp_row_places_values_by_name():
    row = slots.hp_row(slots.SGD_HP, LR=0.5, NESTEROV=1.0)
    assert len(row) == slots.HP_WIDTH
    assert row[slots.SGD_HP.LR] == 0.5 and row[slots.SGD_HP.NESTEROV] == 1.0
    assert sum(row) == 1.5
    with pytest.raises(AttributeError):
        slots.hp_row(slots.SGD_HP, BETA1=0.9)


def _row(*values):
    return [*values] + [0.0] * (slots.HP_WIDTH - len(values))


def test_rows_land_in_float64_with_zero_padding():
    hyper = slots.HyperTable(2, torch.device("cpu"))
    hyper.upload([_row(0.5, True), _row(torch.tensor(0.25), 3)])
    assert hyper.table.shape == (2, slots.HP_WIDTH) and hyper.table.dtype == torch.float64
    assert hyper.table[:, :2].tolist() == [[0.5, 1.0], [0.25, 3.0]]
    assert not hyper.table[:, 2:].any()


def test_tensor_values_are_copied_at_every_upload_and_plain_changes_refused_in_capture():
    hyper = slots.HyperTable(1, torch.device("cpu"))
    lr = torch.tensor(0.5)
    hyper.upload([_row(lr, 2.0)])
    lr.fill_(0.125)
    hyper.upload([_row(lr, 2.0)], capturing=True)  # same plain values: allowed while capturing
    assert hyper.table[0, :2].tolist() == [0.125, 2.0]
    with pytest.raises(RuntimeError, match="changed while a CUDA graph was being captured"):
        hyper.upload([_row(lr, 3.0)], capturing=True)
