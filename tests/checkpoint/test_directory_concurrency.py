"""Concurrent saves and loads of one checkpoint directory: processes, not threads.

Each case forks a few processes that meet at a barrier, then save (or load) at once, many rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import traceback

import pytest
import torch

from halfprec.checkpoint.directory import locked, saving, stage
from halfprec.checkpoint.manifest import CheckpointError, peek_manifest, seal

from ..engine_util import build, train

_FORK = mp.get_context("fork")


def _outcome(fn) -> str:
    """``"ok"``, or the exception as ``"Type: message"`` (a traceback for anything but the expected kinds)."""
    try:
        fn()
    except (FileExistsError, FileNotFoundError, CheckpointError) as e:
        return f"{type(e).__name__}: {e}"
    except BaseException:
        return "UNEXPECTED " + traceback.format_exc()
    return "ok"


def _run(targets) -> None:
    procs = [_FORK.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, p.exitcode


def _same_tag_saver(engine, root, writer, barrier, results):
    torch.set_num_threads(1)
    barrier.wait()
    results.put(
        (writer, _outcome(lambda: engine.save_checkpoint(root, tag="t", client_state={"writer": writer})))
    )


@pytest.mark.slow
def test_concurrent_same_tag_saves_exactly_one_wins(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    for round_ in range(12):
        root = tmp_path / f"r{round_}"
        barrier, results = _FORK.Barrier(3), _FORK.Queue()
        _run([(_same_tag_saver, (engine, root, w, barrier, results)) for w in range(3)])
        outcomes = dict(results.get(timeout=10) for _ in range(3))
        winners = [w for w, o in outcomes.items() if o == "ok"]
        assert len(winners) == 1, outcomes
        for w, o in outcomes.items():
            if w != winners[0]:
                assert o.startswith("FileExistsError:") and "already exists and tags are immutable" in o, o
        assert build("bf16", seed=5).load_checkpoint(root) == {"writer": winners[0]}


@pytest.mark.slow
def test_a_same_tag_save_during_another_is_refused_and_the_first_stays(tmp_path):
    """Deterministic: the second save starts while the first holds its temporary directory (before its commit).
    Without the lock both returned and the first's commit deleted the second's published checkpoint."""
    engine = build("bf16")
    train(engine, 1)
    root = tmp_path / "ck"
    results = _FORK.Queue()
    with saving(root, "t", overwrite=False, keep_last=None) as tmp:
        stage(tmp, weights=engine.module.state_dict(), files={})
        second = _FORK.Process(target=_same_tag_saver, args=(engine, root, 1, _FORK.Barrier(1), results))
        second.start()
        second.join(3.0)  # with the lock it waits for this save to finish
        seal(tmp, "t", {"global_step": 0})
    second.join(30)
    writer, outcome = results.get(timeout=10)
    assert outcome.startswith("FileExistsError:") and "already exists and tags are immutable" in outcome, (
        outcome
    )
    assert peek_manifest(root / "t")["global_step"] == 0 and sorted(
        p.name for p in (root / "t").iterdir()
    ) == [
        "manifest.json",
        "model.safetensors",
    ]


def _pruning_saver(engine, root, writer, saves, barrier, results):
    torch.set_num_threads(1)
    barrier.wait()
    for n in range(saves):
        tag = f"w{writer}-{n}"
        results.put(
            ("save", tag, _outcome(lambda tag=tag: engine.save_checkpoint(root, tag=tag, keep_last=1)))
        )


def _reader(root, loads, barrier, results):
    torch.set_num_threads(1)
    engine = build("bf16", seed=7)
    barrier.wait()
    for _ in range(loads):
        results.put(("load", None, _outcome(lambda: engine.load_checkpoint(root))))


@pytest.mark.slow
def test_concurrent_writers_with_keep_last_never_fail_after_publishing(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    root = tmp_path / "ck"
    engine.save_checkpoint(root, tag="first")
    writers, saves, loads = 3, 12, 60
    barrier, results = _FORK.Barrier(writers + 1), _FORK.Queue()
    targets = [(_pruning_saver, (engine, root, w, saves, barrier, results)) for w in range(writers)]
    _run([*targets, (_reader, (root, loads, barrier, results))])
    outcomes = [results.get(timeout=10) for _ in range(writers * saves + loads)]
    assert [o for kind, _, o in outcomes if kind == "save" and o != "ok"] == []
    published = (root / ".published").read_text().split()
    kept = sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p.name != "latest")
    assert kept == published[-1:] and len(published) == 1 + writers * saves
    for kind, _, o in outcomes:
        if kind == "load" and o != "ok":  # only a checkpoint pruned while it was read is not found
            tags = re.findall(r"\bw\d-\d+\b", o)
            assert (
                o.startswith(("CheckpointError:", "FileNotFoundError:"))
                and tags
                and not set(tags) & set(kept)
            ), o


def test_a_save_into_a_locked_directory_waits_for_the_lock(tmp_path):
    engine = build("bf16")
    train(engine, 1)
    root = tmp_path / "ck"
    root.mkdir()
    started, done = _FORK.Event(), _FORK.Event()

    def save():
        started.set()
        engine.save_checkpoint(root, tag="b")
        done.set()

    with locked(root):
        proc = _FORK.Process(target=save)
        proc.start()
        assert started.wait(20)
        assert not done.wait(1.0) and not (root / "b").exists()  # blocked behind the holder
    proc.join(30)
    assert proc.exitcode == 0 and done.is_set() and (root / "b").is_dir()


def test_the_lock_of_a_killed_save_does_not_block(tmp_path):
    root = tmp_path / "ck"
    held = _FORK.Event()

    def hold_forever():
        with locked(root):
            held.set()
            while True:
                pass

    proc = _FORK.Process(target=hold_forever)
    proc.start()
    assert held.wait(20)
    proc.kill()
    proc.join(10)
    engine = build("bf16")
    train(engine, 1)
    assert engine.save_checkpoint(root, tag="a") == root / "a"  # the kernel dropped the dead holder's flock
    assert sorted(p.name for p in root.iterdir()) == [".lock", ".published", "a", "latest"]


def test_a_load_waits_for_a_running_save(tmp_path):
    # a load verifies the digests, then reads the files; a save (an overwrite, a prune) running
    # in between could swap them. Loads hold the directory's lock as saves do: a load meets a locked directory
    # and waits (deterministic, unlike the race itself)
    engine = build("bf16")
    train(engine, 1)
    root = tmp_path / "ck"
    engine.save_checkpoint(root, tag="a")
    started, done = _FORK.Event(), _FORK.Event()

    def load():
        started.set()
        build("bf16").load_checkpoint(root, tag="a")
        done.set()

    with locked(root):
        proc = _FORK.Process(target=load)
        proc.start()
        assert started.wait(20)
        assert not done.wait(1.0)  # blocked behind the save holding the lock
    proc.join(30)
    assert proc.exitcode == 0 and done.is_set()


def _overwriter(engines, root, rounds, barrier):
    torch.set_num_threads(1)
    barrier.wait()
    for i in range(rounds):
        which = i % 2
        engines[which].save_checkpoint(root, tag="t", overwrite=True, client_state={"which": which})


def _overwrite_reader(expected, root, loads, barrier, results):
    torch.set_num_threads(1)
    reader = build("bf16")
    barrier.wait()
    for _ in range(loads):

        def check():
            which = reader.load_checkpoint(root, tag="t")["which"]
            state = reader.module.state_dict()
            if any(not torch.equal(state[k], v) for k, v in expected[which].items()):
                raise AssertionError(f"a load of checkpoint {which} mixed in the other's weights")
            if reader.global_step != which + 1:
                raise AssertionError(f"checkpoint {which} loaded with global_step {reader.global_step}")

        results.put(_outcome(check))


@pytest.mark.slow
def test_a_load_racing_overwrites_sees_one_checkpoint_whole(tmp_path):
    # two states saved alternately under one tag with overwrite=True while a reader loads it: every load is
    # one of the two, whole (weights and counters of the same save)
    engines = [build("bf16"), build("bf16")]
    train(engines[0], 1)
    train(engines[1], 2)
    expected = [{k: v.clone() for k, v in e.module.state_dict().items()} for e in engines]
    root = tmp_path / "ck"
    engines[0].save_checkpoint(root, tag="t", client_state={"which": 0})
    barrier, results, loads = _FORK.Barrier(2), _FORK.Queue(), 30
    _run(
        [
            (_overwriter, (engines, root, 30, barrier)),
            (_overwrite_reader, (expected, root, loads, barrier, results)),
        ]
    )
    outcomes = [results.get(timeout=10) for _ in range(loads)]
    assert outcomes == ["ok"] * loads, [o for o in outcomes if o != "ok"][:3]
