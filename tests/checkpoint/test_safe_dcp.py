"""Loading a checkpoint runs no code from it: a planted ``.metadata`` pickle and a planted byte item."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from halfprec.distributed import consolidate, read_checkpoint


class _Plant:
    """Unpickling this runs ``open(marker, 'w')``: the file appearing proves code ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint(path, **extra) -> None:
    items = {"format/version": torch.tensor(1), "master/w": torch.ones(4), "shape/w": torch.tensor([2, 2])}
    items.update(extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(items, checkpoint_id=str(path), no_dist=True)


def test_clean_checkpoint_reads(tmp_path):
    _checkpoint(tmp_path / "ok")
    assert torch.equal(consolidate(tmp_path / "ok")["w"], torch.ones(2, 2))


def test_planted_metadata_pickle_does_not_run(tmp_path):
    _checkpoint(tmp_path / "ck")
    marker = tmp_path / "metadata-ran"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_Plant(str(marker))))
    # the plant is real: plain pickle (what DCP's own reader uses) runs it
    pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    assert marker.exists()
    marker.unlink()
    with pytest.raises(pickle.UnpicklingError, match="refusing to load io.open"):
        read_checkpoint(tmp_path / "ck")
    assert not marker.exists()


def test_planted_byte_item_is_never_unpickled(tmp_path):
    marker = tmp_path / "item-ran"
    _checkpoint(tmp_path / "ck", **{"counters/skipped_steps": _Plant(str(marker))})
    assert not marker.exists()
    # the plant is real: DCP's default load of that item runs it (torch.load(weights_only=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"counters/skipped_steps": None}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(ValueError, match="pickled Python object"):
        read_checkpoint(tmp_path / "ck")
    assert not marker.exists()


def test_sharded_load_refuses_byte_items_before_reading(tmp_path):
    from halfprec import MixedPrecisionOptimizer
    from halfprec.distributed import checkpoint

    marker = tmp_path / "item-ran"
    _checkpoint(tmp_path / "ck", **{"counters/skipped_steps": _Plant(str(marker))})
    model = torch.nn.Linear(2, 2, bias=False).bfloat16()
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="pickled Python object"):
        checkpoint.load(mp, tmp_path / "ck", named_parameters=[("w", model.weight)])
    assert not marker.exists()


def test_incomplete_checkpoint_is_refused(tmp_path):
    from halfprec import MixedPrecisionOptimizer
    from halfprec.distributed import checkpoint

    (tmp_path / "ck.tmp").mkdir()
    model = torch.nn.Linear(2, 2).bfloat16()
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()))
    with pytest.raises(FileNotFoundError, match="no .metadata"):
        checkpoint.load(mp, tmp_path / "ck.tmp", named_parameters=model)
