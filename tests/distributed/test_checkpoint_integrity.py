"""DCP checkpoints carry the engine's SHA-256 manifest: a flipped byte in any rank's ``.distcp``
file or in ``.metadata``, a shard swap between ranks, a renamed or linked directory and a downgraded format are
refused at load and at export, naming the file; checkpoints written before the manifest had digests still load,
with a warning. The engine's format gets the same name and downgrade checks, and ``inspect`` shows counters read
from the verified files, refusing a manifest edited to say otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import pytest
import torch
from _worker import make_model, make_optimizer, make_scaler
from tests.engine_util import build, train

from conftest import CKPT
from halfprec import MixedPrecisionOptimizer
from halfprec.checkpoint import manifest as ckpt
from halfprec.checkpoint.dcp import seal
from halfprec.cli.main import main
from halfprec.distributed import checkpoint, consolidate, read_checkpoint

FILES = [".metadata", "__0_0.distcp", "__1_0.distcp"]  # what 2 ranks write


@pytest.fixture
def two_rank(runs, tmp_path):
    """A private copy of a checkpoint written by 2 gloo ranks (``A0``: fp16 AdamW, ZeRO-2), under its own name."""
    runs.two()
    shutil.copytree(runs.root / "A0", tmp_path / "A0")
    return tmp_path / "A0"


def _fresh():
    model = make_model(torch.float16)
    return model, MixedPrecisionOptimizer(make_optimizer(model, "adamw"), loss_scaler=make_scaler(CKPT[0]))


def _load(path):
    model, opt = _fresh()
    checkpoint.load(opt, path, named_parameters=model)
    return model, opt


def _refused_everywhere(path, capsys, match: str) -> None:
    """Load raises CheckpointError matching ``match``; export and inspect exit 2 with one line, writing nothing."""
    with pytest.raises(ckpt.CheckpointError, match=match):
        _load(path)
    with pytest.raises(ckpt.CheckpointError, match=match):
        consolidate(path)
    out = path.parent / "w.safetensors"
    listing = sorted(os.listdir(path.parent))
    for command in (["export", str(path), "--out", str(out)], ["inspect", str(path)]):
        assert main(command) == 2
        stdout, err = capsys.readouterr()
        assert stdout == "" and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"halfprec {command[0]}: error: ") and re.search(match, err)
    assert sorted(os.listdir(path.parent)) == listing and not out.exists()


@pytest.mark.slow
def test_the_manifest_covers_every_ranks_files_and_an_unmodified_checkpoint_loads_bit_for_bit(
    two_rank, capsys
):
    manifest = json.loads((two_rank / ckpt.MANIFEST).read_text())
    assert manifest["format"] == ckpt.DCP_FORMAT and manifest["tag"] == "A0"
    assert sorted(manifest["files"]) == FILES
    model, opt = _load(two_rank)
    checkpoint.save(opt, two_rank.parent / "again", named_parameters=model)  # loaded, saved: the same items
    before, after = read_checkpoint(two_rank), read_checkpoint(two_rank.parent / "again")
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert value.dtype == after[key].dtype and torch.equal(value, after[key]), key
    assert main(["export", str(two_rank), "--out", str(two_rank.parent / "w.safetensors")]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_flipped_byte_in_any_file_is_refused(two_rank, capsys, name, where):
    file = two_rank / name
    data = bytearray(file.read_bytes())
    at = min(int(len(data) * where), len(data) - 1)
    data[at] ^= 0x01
    file.write_bytes(bytes(data))
    _refused_everywhere(two_rank, capsys, rf"{name} is corrupted")


@pytest.mark.slow
def test_a_shard_swap_between_ranks_is_refused(two_rank, capsys):
    a, b = two_rank / "__0_0.distcp", two_rank / "__1_0.distcp"
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    _refused_everywhere(two_rank, capsys, r"__0_0.distcp is (corrupted|truncated or extended)")


@pytest.mark.slow
def test_a_renamed_or_linked_directory_is_refused(two_rank, capsys):
    (two_rank.parent / "A1").symlink_to(two_rank)
    _refused_everywhere(two_rank.parent / "A1", capsys, "written as 'A0'.*rename it back")
    (two_rank.parent / "A1").unlink()
    two_rank.rename(two_rank.parent / "A2")
    _refused_everywhere(two_rank.parent / "A2", capsys, "written as 'A0'")


@pytest.mark.slow
def test_a_downgraded_format_is_refused(two_rank, capsys):
    manifest = json.loads((two_rank / ckpt.MANIFEST).read_text())
    manifest["format"] = "halfprec-dcp/1"  # the old format had no self-digest to check
    (two_rank / ckpt.MANIFEST).write_text(json.dumps(manifest))
    _refused_everywhere(two_rank, capsys, "claims format 'halfprec-dcp/1' but carries")


@pytest.mark.slow
def test_a_resealed_checkpoint_loads_and_an_old_one_warns_once(runs, two_rank, recwarn):
    seal(two_rank, "A0")  # what an editor would do: the digests cannot tell, the loader's checks must
    _load(two_rank)
    saved = consolidate(runs.root / "A0")  # the checkpoint as the ranks sealed it
    (two_rank / ckpt.MANIFEST).write_text(json.dumps({"format": "halfprec-dcp/1", "format_version": 1}))
    with pytest.warns(RuntimeWarning, match="without a manifest of digests"):
        _load(two_rank)
    (two_rank / ckpt.MANIFEST).unlink()  # older still: no manifest at all
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per checkpoint and process
        model, opt = _load(two_rank)
        weights = consolidate(two_rank)
    # read without digests, through the export path and the load path: the masters the ranks sealed
    assert saved and sorted(weights) == sorted(saved)
    assert all(torch.equal(weights[name], saved[name]) for name in saved)
    names = {p: n for n, p in model.named_parameters()}
    trained = [p for p in opt.model_params() if p.requires_grad]  # frozen params have no master
    loaded = {names[p]: m for p, m in zip(trained, opt.master_params(), strict=True)}
    assert all(torch.equal(loaded[name].reshape(saved[name].shape), saved[name]) for name in saved)


# --- the engine's format: names, downgrades, counters ---------------------------------------------------------
def _engine_checkpoint(root):
    engine = build("fp16")
    train(engine, 3)
    return engine.save_checkpoint(root)  # root/step-3


def _edit(path, **changes) -> None:
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest.update(changes)
    manifest["manifest_sha256"] = ckpt.manifest_digest(manifest)  # re-sealed: consistent-looking
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _cli_refuses(argv, capsys, match: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and match in err, err


def test_engine_tag_renamed_or_linked_to_another_is_refused(tmp_path, capsys):
    path = _engine_checkpoint(tmp_path)
    os.symlink(path, tmp_path / "step-9")
    with pytest.raises(ckpt.CheckpointError, match="written as 'step-3'"):
        build("fp16", seed=3).load_checkpoint(tmp_path, tag="step-9")
    _cli_refuses(["inspect", str(tmp_path), "--tag", "step-9"], capsys, "written as 'step-3'")
    os.rename(path, tmp_path / "step-7")
    _cli_refuses(
        ["export", str(tmp_path / "step-7"), "--out", str(tmp_path / "w.safetensors")], capsys, "written as"
    )
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize(
    "changes", [{"global_step": 999}, {"skipped_steps": 5}, {"loss_scale": 2.0}, {"precision": "bf16"}]
)
def test_engine_counters_edited_in_the_manifest_are_refused(tmp_path, capsys, changes):
    path = _engine_checkpoint(tmp_path)
    _edit(path, **changes)
    (key,) = changes
    _cli_refuses(["inspect", str(path)], capsys, f"says {key} is")
    _cli_refuses(["export", str(path), "--out", str(tmp_path / "w.safetensors")], capsys, f"says {key} is")
    assert not (tmp_path / "w.safetensors").exists()


def test_engine_inspect_shows_the_files_counters(tmp_path, capsys):
    path = _engine_checkpoint(tmp_path)
    assert main(["inspect", str(path)]) == 0
    rows = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines() if " " in line)
    assert rows["global_step"].strip() == "3"


def test_engine_format_downgraded_to_1_is_refused(tmp_path, capsys):
    path = _engine_checkpoint(tmp_path)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["format"], manifest["global_step"] = "halfprec-checkpoint/1", 999  # /1 skips the self-digest
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="claims format 'halfprec-checkpoint/1' but carries"):
        build("fp16", seed=3).load_checkpoint(tmp_path)
    _cli_refuses(["inspect", str(path)], capsys, "claims format")
