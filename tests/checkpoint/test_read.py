"""Reading a checkpoint: every file verified against the manifest before use, damage named, no code run."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil

import pytest
import torch

from halfprec.checkpoint.manifest import MANIFEST, CheckpointError, file_digest, manifest_digest
from halfprec.cli.main import main

from ..engine_util import build, legacy_checkpoint, train


def _resealed(path, edit) -> None:
    """Apply ``edit`` to ``path``'s manifest and re-seal it, as someone editing the checkpoint would: its digests
    are then consistent, so only the loader's own checks can refuse it."""
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("damage", "name"),
    [
        *itertools.product(("truncate", "flip", "delete"), ("optimizer/__0_0.distcp", "optimizer/.metadata")),
        ("manifest", "manifest.json"),
        ("flip", "optimizer.pt"),  # a checkpoint of the legacy layout
    ],
)
def test_damaged_files_are_named(tmp_path, damage, name):
    engine = build("bf16")
    train(engine, 1)
    save = legacy_checkpoint if name == "optimizer.pt" else lambda engine, root: engine.save_checkpoint(root)
    path = save(engine, tmp_path)
    target = path / name
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
    with pytest.raises(CheckpointError, match=re.escape(str(target))):
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


def _swap_two_stored_values(metadata, a: str, b: str) -> None:
    """Point DCP's ``.metadata`` at each other's bytes for the items ``a`` and ``b`` (of one size): the
    checkpoint still loads, with the two values exchanged."""
    import pickle

    with open(metadata, "rb") as f:
        meta = pickle.load(f)
    index = {key.fqn: key for key in meta.storage_data}
    ka, kb = index[a], index[b]
    assert meta.storage_data[ka].length == meta.storage_data[kb].length
    meta.storage_data[ka], meta.storage_data[kb] = meta.storage_data[kb], meta.storage_data[ka]
    with open(metadata, "wb") as f:
        pickle.dump(meta, f)


def _unlist_dcp_metadata(path) -> None:
    """Remove ``optimizer/.metadata`` from both manifests that list it (the optimizer part's own and the
    checkpoint's), each re-sealed, and change what it says: no digest covers it any more."""
    _resealed(path / "optimizer", lambda m: m["files"].pop(".metadata"))
    _swap_two_stored_values(path / "optimizer" / ".metadata", "master/mix.weight", "state/mix.weight/exp_avg")
    own = path / "optimizer" / MANIFEST

    def edit(manifest) -> None:
        del manifest["files"]["optimizer/.metadata"]
        manifest["files"]["optimizer/manifest.json"] = {
            "size": own.stat().st_size,
            "sha256": file_digest(own),
        }

    _resealed(path, edit)


@pytest.mark.parametrize(
    ("layout", "name"), [("engine-sharded", "optimizer/.metadata"), ("engine", "optimizer.pt")]
)
def test_a_needed_file_the_manifest_does_not_list_is_refused_by_load_and_inspect(
    tmp_path, capsys, layout, name
):
    engine = build("bf16")
    train(engine, 2)
    if layout == "engine":  # the legacy layout
        path = legacy_checkpoint(engine, tmp_path)
        _resealed(path, lambda m: m["files"].pop("optimizer.pt"))
        _flip_a_stored_value(path / "optimizer.pt")  # covered by no digest now
    else:
        path = engine.save_checkpoint(tmp_path)
        _unlist_dcp_metadata(path)
    message = f"{path / MANIFEST} does not list {name}, which a checkpoint of layout '{layout}' needs"
    fresh = build("bf16", seed=1)
    with pytest.raises(CheckpointError, match=re.escape(message) + ".*load an intact copy"):
        fresh.load_checkpoint(tmp_path)
    assert fresh.global_step == 0
    assert main(["inspect", str(path)]) == 2 and message in capsys.readouterr().err


def test_a_file_read_when_present_that_the_manifest_does_not_list_is_refused(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path)
    # its entry removed, and other bytes: the engine would restore this rank's RNG from it
    _resealed(path, lambda m: m["files"].pop("rng-0.pt"))
    torch.save(torch.get_rng_state(), path / "rng-0.pt")
    # a file the DCP reader would open if the metadata named it (another rank's part)
    shutil.copyfile(path / "optimizer" / "__0_0.distcp", path / "optimizer" / "__1_0.distcp")
    for name in ("rng-0.pt", "optimizer/__1_0.distcp"):
        message = re.escape(f"{path / name} is not listed in {path / MANIFEST}") + ".*delete it"
        with pytest.raises(CheckpointError, match=message):
            build("bf16", seed=1).load_checkpoint(tmp_path)
        (path / name).unlink()
    (path / "notes.txt").write_text("a file no reader opens")
    with pytest.warns(RuntimeWarning, match="has no RNG state for rank 0"):
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
