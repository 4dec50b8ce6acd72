"""The layout a writer records in ``manifest.json``, and how checkpoints written before it was recorded are read."""

from __future__ import annotations

import json
from pathlib import Path

from halfprec import checkpoint as ckpt
from halfprec.checkpoint.export import export
from halfprec.distributed import checkpoint as dckpt

from ..engine_util import build, train
from .test_atomic import _mp


def test_the_writer_records_the_layout_and_legacy_checkpoints_still_load(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path / "ck")
    manifest = ckpt.read_manifest(path)
    assert manifest["layout"] == ckpt.ENGINE
    # as written before the layout was recorded: no "layout" key, digest re-sealed
    manifest.pop("layout")
    manifest["manifest_sha256"] = ckpt._manifest_digest(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.layout_of(path) == ckpt.ENGINE
    build("bf16", seed=3).load_checkpoint(tmp_path / "ck")
    export(path, tmp_path / "w.safetensors")

    model, mp = _mp()
    dckpt.save(mp, tmp_path / "dcp", named_parameters=model)
    assert json.loads((tmp_path / "dcp" / "manifest.json").read_text())["format"] == ckpt.DCP_FORMAT
    assert ckpt.layout_of(tmp_path / "dcp") == ckpt.DCP
    (tmp_path / "dcp" / "manifest.json").unlink()  # a DCP checkpoint written before it had a manifest
    assert ckpt.layout_of(tmp_path / "dcp") == ckpt.DCP
    export(tmp_path / "dcp", tmp_path / "d.safetensors")
    fresh_model, fresh = _mp()
    dckpt.load(fresh, tmp_path / "dcp", named_parameters=fresh_model)
    assert ckpt.layout_of(Path(tmp_path / "nothing")) is None
