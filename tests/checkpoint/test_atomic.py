"""One crash-safe commit for both formats, leftovers removed only when no live writer holds them, one file mode.

A crash is injected at each ``os.rename``/``os.replace`` of an overwriting save in turn: a complete checkpoint
(the old one or the new one) must stay loadable, and the next save must succeed.
"""

from __future__ import annotations

import errno
import os
import shutil
import warnings

import pytest
import torch

from halfprec import MixedPrecisionOptimizer
from halfprec.checkpoint import atomic
from halfprec.checkpoint.consolidate import consolidate
from halfprec.checkpoint.export import export
from halfprec.checkpoint.read import resolve
from halfprec.distributed import checkpoint as dckpt

from ..engine_util import build, train
from .test_directory import KILL, _child


class _Crash:
    """Make the ``n``-th call of ``os.rename`` or ``os.replace`` (counted together) raise, as a crash would stop
    the save there; records whether it fired."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.n, self.calls, self.fired = n, 0, False
        for name in ("rename", "replace"):
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name)))

    def _wrap(self, real):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.n:
                self.fired = True
                raise OSError(errno.EIO, "injected crash")
            return real(*args, **kwargs)

        return call


def _crash_each_rename(tmp_path, monkeypatch, advance, save, loaded):
    """``advance()`` trains and returns what the next save holds, ``save(root)`` overwrites the one checkpoint,
    ``loaded(root)`` is what a reader finds."""
    for n in range(1, 50):
        root = tmp_path / f"crash-at-{n}"
        old = advance()
        save(root)
        new = advance()
        with monkeypatch.context() as patch:
            crash = _Crash(patch, n)
            try:
                save(root)
            except BaseException as e:  # DCP wraps it in its CheckpointException, a BaseException
                assert "injected crash" in str(e)
        got = loaded(root)
        assert got in (old, new), (n, got, old, new)
        if not crash.fired:
            assert got == new
            return n
        newer = advance()
        save(root)  # the next save recovers and succeeds
        assert loaded(root) == newer, n
    raise AssertionError("the save never finished")


def test_a_crash_at_any_rename_of_an_engine_overwrite_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    engine = build("bf16")

    def advance():
        train(engine, 1)
        return engine.global_step

    def save(root):
        engine.save_checkpoint(root, tag="t", overwrite=True)

    def loaded(root):
        fresh = build("bf16", seed=3)
        fresh.load_checkpoint(root)
        return fresh.global_step

    calls = _crash_each_rename(tmp_path, monkeypatch, advance, save, loaded)
    assert calls >= 4  # the two renames of the replace, the aside's removal, the latest pointer


def _mp():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).bfloat16()
    return model, MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _step(model, mp) -> None:
    mp.backward(model(torch.ones(4, 3, dtype=torch.bfloat16)).float().square().sum())
    mp.step()
    mp.zero_grad()


def test_a_crash_at_any_rename_of_a_dcp_overwrite_leaves_a_loadable_checkpoint(tmp_path, monkeypatch):
    model, mp = _mp()

    def advance():
        _step(model, mp)
        return tuple(m.detach().clone().reshape(-1).tolist().__repr__() for m in mp.master_params())

    def save(root):
        dckpt.save(mp, root / "ck", named_parameters=model)

    def loaded(root):
        return tuple(v.reshape(-1).tolist().__repr__() for v in consolidate(root / "ck").values())

    _crash_each_rename(tmp_path, monkeypatch, advance, save, loaded)


def test_a_replace_that_died_between_its_renames_is_found_and_restored(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    final = engine.save_checkpoint(tmp_path, tag="t")
    os.rename(final, tmp_path / ".t.replaced")  # the state between the two renames of a replace
    assert resolve(tmp_path) == tmp_path / ".t.replaced"
    build("bf16", seed=3).load_checkpoint(tmp_path)
    with pytest.raises(FileExistsError, match="immutable"):  # restored first: still a published tag
        engine.save_checkpoint(tmp_path, tag="t")
    assert final.is_dir() and not (tmp_path / ".t.replaced").exists()


def test_leftovers_of_dead_saves_are_removed_and_live_ones_kept(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    engine.save_checkpoint(tmp_path)  # step-1
    dead, live = tmp_path / ".step-9.tmp-0123abcd", tmp_path / ".step-9.tmp-89abcdef"
    dead.mkdir()
    live.mkdir()
    (tmp_path / ".latest.tmp-deadbeef").write_text("step-9\n")
    shutil.copytree(tmp_path / "step-1", tmp_path / ".step-1.unpublished-0badc0de")
    (tmp_path / ".step-1.trash-00000000").mkdir()
    (tmp_path / ".notes").write_text("mine")
    with atomic.held(live):  # another save, still running
        train(engine, 1)
        engine.save_checkpoint(tmp_path)
        hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert hidden == [".lock", ".notes", ".published", ".step-9.tmp-89abcdef"]


@pytest.mark.slow
def test_a_killed_save_leaves_nothing_after_the_next_save(tmp_path):
    proc = _child("-c", KILL, str(tmp_path), "file")  # killed while writing step-2's files
    assert proc.returncode == 9 and [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    proc = _child("-c", KILL, str(tmp_path / "b"), "latest")  # step-2 renamed, latest still step-1
    assert proc.returncode == 9
    for root in (tmp_path, tmp_path / "b"):
        engine = build("bf16", seed=3)
        engine.load_checkpoint(root)
        train(engine, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # b: step-2 moved aside
            engine.save_checkpoint(root)
        train(engine, 1)
        engine.save_checkpoint(root)  # removes what the previous save moved aside
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == [".lock", ".published"]


def test_dcp_leftover_of_a_dead_save_is_removed_and_a_live_one_refused(tmp_path):
    model, mp = _mp()
    _step(model, mp)
    tmp = tmp_path / "ck.tmp"
    tmp.mkdir()
    (tmp / "junk").write_text("x")
    dckpt.save(mp, tmp_path / "ck", named_parameters=model)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    tmp.mkdir()
    with atomic.held(tmp), pytest.raises(FileExistsError, match="ck.tmp is being written by another save"):
        dckpt.save(mp, tmp_path / "ck", named_parameters=model)


def test_export_leftover_of_a_dead_export_is_removed(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path / "ck")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".w.safetensors.tmp-0123abcd").mkdir()
    (out / ".w.safetensors.tmp-89abcdef").mkdir()
    with atomic.held(out / ".w.safetensors.tmp-89abcdef"):
        export(path, out / "w.safetensors")
    assert sorted(os.listdir(out)) == [".w.safetensors.tmp-89abcdef", "w.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_checkpoint_file_gets_the_mode_of_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        engine = build("bf16")
        train(engine, 1)
        path = engine.save_checkpoint(tmp_path / "ck")
        export(path, tmp_path / "w.safetensors")
        model, mp = _mp()
        dckpt.save(mp, tmp_path / "dcp", named_parameters=model)
    finally:
        os.umask(old)
    assert (path / "optimizer").is_dir()  # the engine's optimizer part, a DCP directory: its files count too
    entries = [
        path,
        *path.rglob("*"),
        tmp_path / "w.safetensors",
        tmp_path / "dcp",
        *(tmp_path / "dcp").rglob("*"),
    ]
    files = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in entries if p.is_file()}
    dirs = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in entries if p.is_dir()}
    written = {"ck/step-1/optimizer/.metadata", "ck/step-1/optimizer/__0_0.distcp", "dcp/.metadata"}
    assert written <= set(files), files
    assert set(files.values()) == {oct(0o666 & ~umask)}, files
    assert set(dirs.values()) == {oct(0o777 & ~umask)}, dirs
