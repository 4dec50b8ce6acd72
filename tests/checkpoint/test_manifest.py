"""``manifest.json``: the layout a writer records (and how checkpoints written before it was recorded are read), and
the files a reader may open."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from halfprec.checkpoint.export import export
from halfprec.checkpoint.manifest import (
    DCP,
    DCP_FORMAT,
    ENGINE,
    ENGINE_SHARDED,
    MANIFEST,
    CheckpointError,
    layout_of,
    manifest_digest,
    read_manifest,
)
from halfprec.distributed import checkpoint as dckpt

from ..engine_util import build, legacy_checkpoint, train
from .test_atomic import _mp


def test_the_writer_records_the_layout_and_legacy_checkpoints_still_load(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    # the engine's checkpoint (optimizer/, a DCP directory), and one of the layout written before it (optimizer.pt)
    for root, layout in ((tmp_path / "ck", ENGINE_SHARDED), (tmp_path / "legacy", ENGINE)):
        path = engine.save_checkpoint(root) if layout == ENGINE_SHARDED else legacy_checkpoint(engine, root)
        manifest = read_manifest(path)
        assert manifest["layout"] == layout
        # as written before the layout was recorded: no "layout" key, digest re-sealed
        manifest.pop("layout")
        manifest["manifest_sha256"] = manifest_digest(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
        assert layout_of(path) == layout
        build("bf16", seed=3).load_checkpoint(root)
        export(path, tmp_path / f"{root.name}.safetensors")

    model, mp = _mp()
    dckpt.save(mp, tmp_path / "dcp", named_parameters=model)
    assert json.loads((tmp_path / "dcp" / "manifest.json").read_text())["format"] == DCP_FORMAT
    assert layout_of(tmp_path / "dcp") == DCP
    (tmp_path / "dcp" / "manifest.json").unlink()  # a DCP checkpoint written before it had a manifest
    assert layout_of(tmp_path / "dcp") == DCP
    export(tmp_path / "dcp", tmp_path / "d.safetensors")
    fresh_model, fresh = _mp()
    dckpt.load(fresh, tmp_path / "dcp", named_parameters=fresh_model)
    assert layout_of(Path(tmp_path / "nothing")) is None


def test_a_dcp_data_file_the_manifest_does_not_list_is_refused(tmp_path):
    model, mp = _mp()
    path = dckpt.save(mp, tmp_path / "dcp", named_parameters=model)
    data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"][data.name]
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    fresh_model, fresh = _mp()
    with pytest.raises(CheckpointError, match=re.escape(f"{data} is not listed in {path / MANIFEST}")):
        dckpt.load(fresh, path, named_parameters=fresh_model)
