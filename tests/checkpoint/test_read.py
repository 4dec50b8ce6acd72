"""Reading a checkpoint: every file verified against the manifest before use, damage named, no code run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from halfprec.checkpoint.manifest import CheckpointError, file_digest, manifest_digest

from ..engine_util import build, train


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
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["engine.pt"] = {
        "size": (path / "engine.pt").stat().st_size,
        "sha256": file_digest(path / "engine.pt"),
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)  # an attacker can re-seal it all:
    (path / "manifest.json").write_text(json.dumps(manifest))  # the digests cannot save us, weights_only must
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
