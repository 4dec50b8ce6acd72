"""Reading a checkpoint: every file verified against the manifest before use, damage named, no code run."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from halfprec.checkpoint.manifest import MANIFEST, CheckpointError, file_digest, manifest_digest
from halfprec.cli.main import main

from ..engine_util import build, train


def _resealed(path, edit) -> None:
    """Apply ``edit`` to ``path``'s manifest and re-seal it, as someone editing the checkpoint would: its digests
    are then consistent, so only the loader's own checks can refuse it."""
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_files_are_named(tmp_path, damage):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path)
    target = path / ("manifest.json" if damage == "manifest" else "optimizer.pt")
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0x01
        target.write_bytes(data)
    elif damage == "delete":
        target.unlink()
    else:
        target.write_text("{not json")
    with pytest.raises(CheckpointError, match=str(target).replace(".", "\\.")):
        build("bf16").load_checkpoint(tmp_path)


def test_code_running_pickle_is_refused_without_running(tmp_path):
    engine = build("bf16")
    path = engine.save_checkpoint(tmp_path)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"client_state": Payload()}, path / "engine.pt")
    entry = {"size": (path / "engine.pt").stat().st_size, "sha256": file_digest(path / "engine.pt")}
    # an attacker can re-seal it all: the digests cannot save us, weights_only must
    _resealed(path, lambda m: m["files"].update({"engine.pt": entry}))
    with pytest.raises(CheckpointError, match="engine.pt with weights_only=True"):
        build("bf16").load_checkpoint(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.update(global_step=m["global_step"] + 1),  # still valid JSON, wrong counter
        lambda m: m["ties"].update({"head.weight": "mix.weight"}),  # a tie pointing elsewhere
        lambda m: m.pop("manifest_sha256"),
    ],
)
def test_an_edited_manifest_is_named_as_corrupted(tmp_path, edit):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"manifest.json is corrupted"):
        build("bf16").load_checkpoint(tmp_path)


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]


def _flip_a_stored_value(file) -> None:
    """Flip one bit of the largest tensor that ``file`` stores: the file still loads, with another value."""
    largest = max(_tensors(torch.load(file, weights_only=True)), key=torch.Tensor.numel)
    data = bytearray(file.read_bytes())
    at = data.find(largest.numpy().tobytes())
    assert at >= 0
    data[at + 1] ^= 0x01
    file.write_bytes(data)


def test_a_needed_file_the_manifest_does_not_list_is_refused_by_load_and_inspect(tmp_path, capsys):
    engine = build("bf16")
    train(engine, 2)
    path = engine.save_checkpoint(tmp_path)
    _resealed(path, lambda m: m["files"].pop("optimizer.pt"))
    _flip_a_stored_value(path / "optimizer.pt")  # covered by no digest now
    message = f"{path / MANIFEST} does not list optimizer.pt, which a checkpoint of layout 'engine' needs"
    fresh = build("bf16", seed=1)
    with pytest.raises(CheckpointError, match=re.escape(message) + ".*load an intact copy"):
        fresh.load_checkpoint(tmp_path)
    assert fresh.global_step == 0
    assert main(["inspect", str(path)]) == 2 and message in capsys.readouterr().err


def test_a_file_read_when_present_that_the_manifest_does_not_list_is_refused(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path)
    torch.save(torch.get_rng_state(), path / "rng-0.pt")  # the engine would restore this rank's RNG from it
    with pytest.raises(CheckpointError, match=r"rng-0\.pt is not listed in .*manifest\.json.*delete it"):
        build("bf16", seed=1).load_checkpoint(tmp_path)
    (path / "notes.txt").write_text("a file no reader opens")
    (path / "rng-0.pt").unlink()
    build("bf16", seed=1).load_checkpoint(tmp_path)


def test_an_engine_pt_of_a_later_step_is_refused_by_load_as_by_inspect(tmp_path, capsys):
    engine = build("bf16")
    train(engine, 3)
    path = engine.save_checkpoint(tmp_path, tag="a")  # step 3
    train(engine, 2)
    later = engine.save_checkpoint(tmp_path, tag="b")  # step 5
    shutil.copyfile(later / "engine.pt", path / "engine.pt")
    entry = {"size": (path / "engine.pt").stat().st_size, "sha256": file_digest(path / "engine.pt")}
    _resealed(path, lambda m: m["files"].update({"engine.pt": entry}))
    message = f"{path / MANIFEST} says global_step is 3 but {path / 'engine.pt'} holds 5"
    assert main(["inspect", str(path)]) == 2 and message in capsys.readouterr().err
    fresh = build("bf16", seed=1)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        fresh.load_checkpoint(tmp_path, tag="a")
    assert fresh.global_step == 0
