"""The engine's checkpoint directory: bit-exact resume in a fresh process, atomicity under kills, ties, immutable
tags, the publication log."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import halfprec
from halfprec.checkpoint.directory import write_checkpoint
from halfprec.checkpoint.manifest import CheckpointError, file_digest, manifest_digest, peek_manifest

from ..engine_util import TiedLM, build, legacy_checkpoint, snapshot, train

ROOT = Path(__file__).resolve().parents[2]


def _child(*args, **kwargs):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, **kwargs
    )


def _assert_same(a: dict, b: dict) -> None:
    for key in ("weights",):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), k
    for x, y in zip(a["masters"], b["masters"], strict=True):
        assert torch.equal(x, y)
    for sa, sb in zip(a["state"], b["state"], strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], k
    for key in ("scaler", "counters", "lr", "sched"):
        assert a[key] == b[key], key
    assert torch.equal(a["rng"], b["rng"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,gas,first",
    [("fp16", 1, 0), ("fp16", 1, 4), ("bf16", 2, 3)],
    ids=["fp16-N0", "fp16-scale-change", "bf16-accum"],
)
def test_resume_in_fresh_process_is_bit_exact(tmp_path, precision, gas, first):
    total = 8
    full = build(precision, gas)
    full_losses = train(full, total)
    expected = snapshot(full)

    part = build(precision, gas)
    train(part, first)
    part.save_checkpoint(tmp_path / "ckpt")
    if precision == "fp16" and first:
        assert part.optimizer.loss_scale != 2.0**14  # the scale already changed before the save
    out = tmp_path / "resumed.pt"
    proc = _child(
        "-m", "tests.engine_util", str(tmp_path / "ckpt"), str(total - first), str(out), precision, str(gas)
    )
    assert proc.returncode == 0, proc.stderr
    resumed = torch.load(out, weights_only=True)
    assert resumed["losses"] == full_losses[first * gas :]
    _assert_same(resumed, expected)


def test_layout_ties_latest_and_client_state(tmp_path):
    engine = build("bf16")
    train(engine, 2)
    path = engine.save_checkpoint(tmp_path, client_state={"epoch": 1, "offset": torch.tensor(7)})
    assert path == tmp_path / "step-2" and (tmp_path / "latest").read_text().strip() == "step-2"
    assert sorted(p.name for p in path.iterdir()) == [
        "engine.pt",
        "manifest.json",
        "model.safetensors",
        "optimizer",
        "rng-0.pt",
    ]
    assert sorted(p.name for p in (path / "optimizer").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "manifest.json",
    ]
    assert peek_manifest(path)["layout"] == "engine-sharded"
    stored = load_file(str(path / "model.safetensors"))
    assert "head.weight" not in stored and "emb.weight" in stored  # the shared tensor is stored once
    fresh = build("bf16", seed=9)
    client = fresh.load_checkpoint(tmp_path)
    assert client["epoch"] == 1 and int(client["offset"]) == 7
    assert fresh.module.head.weight is fresh.module.emb.weight
    assert torch.equal(fresh.module.emb.weight, engine.module.emb.weight)


def test_tags_are_immutable_and_keep_last_prunes(tmp_path):
    engine = build("bf16")
    for _ in range(3):
        train(engine, 1)
        engine.save_checkpoint(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", ".published", "latest", "step-2", "step-3"]
    with pytest.raises(FileExistsError, match="step-3 already exists and tags are immutable"):
        engine.save_checkpoint(tmp_path)
    engine.save_checkpoint(tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="invalid checkpoint tag 'latest'"):
        engine.save_checkpoint(tmp_path, tag="latest")
    with pytest.raises(ValueError, match="client_state\\['f'\\] is a function"):
        engine.save_checkpoint(tmp_path, tag="x", client_state={"f": len.__call__.__class__ and (lambda: 0)})


def test_weights_only_load_refreshes_masters(tmp_path):
    engine = build("bf16")
    train(engine, 3)
    engine.save_checkpoint(tmp_path)
    fresh = build("bf16", seed=5)
    fresh.load_checkpoint(tmp_path, load_optimizer_states=False)
    for m, p in zip(fresh.optimizer.master_params(), fresh.module.parameters(), strict=True):
        assert torch.equal(m, p.float())  # not the stale masters of seed 5
    assert len(fresh.optimizer.state) == 0


def test_other_model_names_first_mismatch(tmp_path):
    build("bf16").save_checkpoint(tmp_path)
    other = build("fp16")
    with pytest.raises(
        CheckpointError,
        match="at 'emb.weight': saved shape \\[37, 24\\] torch.bfloat16, model shape \\[37, 24\\] torch.float16",
    ):
        other.load_checkpoint(tmp_path)


KILL = textwrap.dedent(
    """
    import os, sys, torch
    from tests.engine_util import build, train
    point = sys.argv[2]
    engine = build("bf16")
    train(engine, 1)
    engine.save_checkpoint(sys.argv[1])          # the good checkpoint: step-1
    train(engine, 1)
    if point == "file":                          # during the second torch.save of the new checkpoint
        real, calls = torch.save, []
        def save(*a, **k):
            calls.append(1)
            if len(calls) == 2: os._exit(9)
            return real(*a, **k)
        torch.save = save
    elif point == "rename":                      # everything written, before the directory rename
        os.rename = lambda *a: os._exit(9)
    elif point == "latest":                      # directory renamed, before the pointer is replaced
        os.replace = lambda *a: os._exit(9)
    engine.save_checkpoint(sys.argv[1])
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["file", "rename", "latest"])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, point):
    proc = _child("-c", KILL, str(tmp_path), point)
    assert proc.returncode == 9, proc.stderr
    assert (tmp_path / "latest").read_text().strip() == "step-1"
    fresh = build("bf16", seed=3)
    fresh.load_checkpoint(tmp_path)
    assert fresh.global_step == 1


@pytest.mark.parametrize(
    ("save", "message"),
    [
        (
            lambda engine, root: engine.save_checkpoint(root),
            "step-0/optimizer has 1 param groups, this optimizer 2",
        ),
        (legacy_checkpoint, "step-0/optimizer.pt: state dict has param groups of sizes"),
    ],
    ids=["reshardable", "legacy"],
)
def test_failed_optimizer_load_leaves_the_model_untouched(tmp_path, save, message):
    save(build("bf16"), tmp_path)
    torch.manual_seed(0)
    model = TiedLM()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-3)  # other groups
    engine = halfprec.initialize(model, opt, precision="bf16")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_unpublished_checkpoint_of_a_killed_save_does_not_block_the_rerun(tmp_path):
    proc = _child("-c", KILL, str(tmp_path), "latest")  # step-2 renamed, latest still step-1
    assert proc.returncode == 9 and (tmp_path / "step-2").exists()
    engine = build("bf16", seed=3)
    engine.load_checkpoint(tmp_path)
    train(engine, 1)
    with pytest.warns(RuntimeWarning, match="did not finish"):
        engine.save_checkpoint(tmp_path)
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    build("bf16").load_checkpoint(tmp_path)


def test_a_published_tag_stays_immutable_after_a_rewind(tmp_path):
    engine = build("bf16")
    for _ in range(3):
        train(engine, 1)
        engine.save_checkpoint(tmp_path)  # step-1, step-2, step-3
    engine.load_checkpoint(tmp_path, tag="step-1")
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="rewind-2")  # latest now names an older step than step-3
    train(engine, 1)
    before = {p: file_digest(p) for p in (tmp_path / "step-3").rglob("*") if p.is_file()}
    assert tmp_path / "step-3" / "optimizer" / "__0_0.distcp" in before
    with pytest.raises(FileExistsError, match="step-3 already exists and tags are immutable"):
        engine.save_checkpoint(tmp_path)  # step-3 again: published, so never moved aside
    assert {p: file_digest(p) for p in (tmp_path / "step-3").rglob("*") if p.is_file()} == before
    assert not [p for p in tmp_path.iterdir() if "unpublished" in p.name]
    engine.save_checkpoint(tmp_path, tag="rewind-3", keep_last=2)  # the two most recent saves stay
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "latest",
        "rewind-2",
        "rewind-3",
    ]


def _make_legacy(root: Path) -> None:
    """Turn ``root`` into what the code before the publication log and the manifest's self-digest wrote."""
    (root / ".published").unlink()
    for manifest_path in root.glob("*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        manifest.pop("manifest_sha256")
        manifest["format"] = "halfprec-checkpoint/1"
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_checkpoints_written_before_the_log_and_the_self_digest_still_load_and_stay_immutable(tmp_path):
    engine = build("bf16")
    for _ in range(3):
        train(engine, 1)
        engine.save_checkpoint(tmp_path)  # step-1, step-2, step-3
    _make_legacy(tmp_path)
    fresh = build("bf16", seed=3)
    fresh.load_checkpoint(tmp_path)  # no self-digest: format /1 loads as before
    assert fresh.global_step == 3
    fresh.load_checkpoint(tmp_path, tag="step-1")
    with pytest.raises(FileExistsError, match="step-2 already exists and tags are immutable"):
        train(fresh, 1)
        fresh.save_checkpoint(tmp_path)  # step-2 was published by the old code: never moved aside
    fresh.save_checkpoint(tmp_path, tag="branch-2", keep_last=2)  # the log is seeded in step order
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "branch-2",
        "latest",
        "step-3",
    ]
    assert (tmp_path / ".published").read_text().split() == ["step-1", "step-2", "step-3", "branch-2"]


def test_int_keys_in_the_manifest_info_do_not_break_its_digest(tmp_path):
    write_checkpoint(tmp_path, "t", weights=None, files={"x": {"a": 1}}, info={"sizes": {3: 1, 10: 2}})
    manifest = peek_manifest(tmp_path / "t")
    assert manifest["sizes"] == {"3": 1, "10": 2} and manifest["manifest_sha256"] == manifest_digest(manifest)


def test_a_torn_log_line_is_ended_before_the_next_append(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    engine.save_checkpoint(tmp_path)
    with open(tmp_path / ".published", "a") as f:
        f.write("step-")  # a write cut short
    train(engine, 1)
    engine.save_checkpoint(tmp_path)
    assert (tmp_path / ".published").read_text().split("\n") == ["step-1", "step-", "step-2", ""]
