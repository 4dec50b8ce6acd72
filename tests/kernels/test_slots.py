"""The slot tables: every slot fits its row, no two share a column, and ``hp_row`` places values by name."""

from __future__ import annotations

import pytest

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
