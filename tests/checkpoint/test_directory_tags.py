"""Checkpoint tags are plain names, and a save never moves or replaces a directory that halfprec did not write."""

from __future__ import annotations

import json
import os

import pytest

from halfprec.checkpoint.manifest import FORMAT, CheckpointError
from halfprec.checkpoint.read import resolve

from ..engine_util import build, train

_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit"


@pytest.fixture(scope="module")
def engine():
    engine = build("bf16")
    train(engine, 1)
    return engine


@pytest.mark.parametrize(
    "tag,pattern",
    [
        ("run 1 ", "invalid checkpoint tag 'run 1 ': a tag is a str of at most 200 " + _RULE),
        (" run", "tag ' run'"),
        ("a/b", "tag 'a/b'"),
        ("../up", "tag '../up'"),
        ("*", "tag '\\*'"),
        ("step-[1]", "tag 'step-\\[1\\]'"),
        ("s?", "tag 's\\?'"),
        ("..", "tag '\\.\\.'"),
        (".hidden", "tag '\\.hidden'"),
        ("-x", "tag '-x'"),
        ("latest", "tag 'latest'.*not 'latest'"),
        ("", "tag ''"),
        ("a" * 201, "tag 'aaaa"),
        (0, "invalid checkpoint tag 0 of type int: .*tag=f'step-\\{n\\}'"),
        (100, "tag 100 of type int"),
        (b"x", "tag b'x' of type bytes"),
    ],
)
def test_invalid_tags_are_refused_before_anything_is_written(tmp_path, engine, tag, pattern):
    with pytest.raises(ValueError, match=pattern):
        engine.save_checkpoint(tmp_path / "ck", tag=tag)
    assert not (tmp_path / "ck").exists()
    with pytest.raises(ValueError, match=pattern):
        resolve(tmp_path, tag)


@pytest.mark.parametrize("tag", ["0", "step-1", "v1.0_final", "A", "a" * 200])
def test_plain_names_are_tags(tmp_path, engine, tag):
    assert engine.save_checkpoint(tmp_path, tag=tag) == tmp_path / tag
    assert (tmp_path / "latest").read_text().strip() == tag
    assert resolve(tmp_path) == tmp_path / tag


def test_a_damaged_latest_pointer_is_named(tmp_path, engine):
    engine.save_checkpoint(tmp_path, tag="good")
    (tmp_path / "latest").write_text("../elsewhere\n")
    with pytest.raises(CheckpointError, match="latest is damaged: .*pass tag= with one of: good"):
        build("bf16").load_checkpoint(tmp_path)


def _listing(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", ["folder", "file", "foreign-manifest", "other-tag"])
def test_a_directory_halfprec_did_not_write_is_left_alone(tmp_path, engine, kind, overwrite):
    target = tmp_path / "step-1"  # the engine's default tag
    if kind == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    if kind == "foreign-manifest":
        (target / "manifest.json").write_text(json.dumps({"format": "other/1", "global_step": 9}))
    if kind == "other-tag":  # a halfprec checkpoint copied here under another name
        (target / "manifest.json").write_text(json.dumps({"format": FORMAT, "tag": "x", "global_step": 9}))
    before = _listing(tmp_path)
    with pytest.raises(
        FileExistsError, match=f"{target} exists and is not a halfprec checkpoint.*choose another"
    ):
        engine.save_checkpoint(tmp_path, overwrite=overwrite)
    assert _listing(tmp_path) == before
    assert (target.read_text() if kind == "file" else (target / "notes.txt").read_text()) == "mine"


def test_prune_keeps_directories_halfprec_did_not_write(tmp_path):
    engine = build("bf16")
    mine = tmp_path / "step-0"
    mine.mkdir()
    (mine / "manifest.json").write_text(json.dumps({"global_step": 0}))
    for _ in range(3):
        train(engine, 1)
        engine.save_checkpoint(tmp_path, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == [".lock", ".published", "latest", "step-0", "step-3"]


def test_missing_pointer_lists_the_checkpoints_there(tmp_path, engine):
    engine.save_checkpoint(tmp_path, tag="b")
    engine.save_checkpoint(tmp_path, tag="a")
    (tmp_path / "latest").unlink()
    with pytest.raises(CheckpointError, match="latest does not exist; pass tag= with one of: a, b"):
        resolve(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint .*/c does not exist; checkpoints in .*: a, b"):
        resolve(tmp_path, "c")
    with pytest.raises(CheckpointError, match="the directory does not exist"):
        resolve(tmp_path / "nowhere")
