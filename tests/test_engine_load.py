"""Loads that apply completely or change nothing, and refuse another optimizer's state.

Every failing load is checked the same way: snapshot every tensor and counter, make the load fail, compare.
"""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.checkpoint.manifest import MANIFEST, CheckpointError, file_digest, manifest_digest
from halfprec.checkpoint.read import load_pt

from .engine_util import TiedLM, build, legacy_checkpoint, train


def copy_tree(value):
    """A deep copy of nested dicts/lists/tuples of tensors and plain values."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copy_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copy_tree(v) for v in value)
    return value


def assert_same_tree(a, b, where="") -> None:
    """Equal structure, tensors equal in dtype and bits, plain values equal."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_refused_unchanged(snapshot, load, error, match: str) -> None:
    """``load()`` raises ``error`` matching ``match``, and ``snapshot()`` is the same after as before."""
    before = snapshot()
    with pytest.raises(error, match=match):
        load()
    assert_same_tree(before, snapshot())


def engine_snapshot(engine) -> dict:
    """Everything a load may change: weights, grads, the optimizer's state dict (masters, state, groups,
    scaler, skipped steps), counters, scheduler and RNG."""
    mp = engine.optimizer
    return copy_tree(
        {
            "weights": engine.module.state_dict(),
            "grads": [p.grad for p in engine.module.parameters()],
            "optimizer": mp.state_dict(),
            "masters": mp.master_params(),
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in mp.param_groups],
            "counters": [engine.global_step, engine.micro_step, engine.skipped_steps],
            "sched": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )


def _reseal(path, name: str, obj, **recorded) -> None:
    """Replace ``<path>/<name>.pt`` and re-seal the manifest with the counters ``recorded``, as someone editing
    both would (a manifest whose counters differ from the files' is refused before any part is loaded)."""
    import json

    torch.save(obj, path / f"{name}.pt")
    manifest = json.loads((path / MANIFEST).read_text())
    file = path / f"{name}.pt"
    manifest["files"][f"{name}.pt"] = {"size": file.stat().st_size, "sha256": file_digest(file)}
    manifest.update(recorded)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


# --- MixedPrecisionOptimizer.load_state_dict ---------------------------------------------------------------
def _mp(cls=torch.optim.AdamW, seed=0, **kw):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).half()
    mp = halfprec.MixedPrecisionOptimizer(cls(model.parameters(), lr=1e-2, **kw))
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).half()
        mp.backward(model(x).float().square().mean())
        mp.step()
        mp.zero_grad()
    return model, mp


def _mp_snapshot(model, mp) -> dict:
    return copy_tree(
        {"weights": model.state_dict(), "optimizer": mp.state_dict(), "masters": mp.master_params()}
    )


@pytest.mark.parametrize("other", [torch.optim.SGD, torch.optim.Adagrad])
def test_plain_load_of_another_optimizers_state_is_refused_naming_both(other):
    _, adamw = _mp()
    model, mp = _mp(other, seed=1)
    assert_refused_unchanged(
        lambda: _mp_snapshot(model, mp),
        lambda: mp.load_state_dict(adamw.state_dict()),
        ValueError,
        rf"saved by AdamW, this optimizer is {other.__name__}",
    )


def _bad_master(sd):
    sd["masters"][0] = sd["masters"][0][:2]


def _bad_scale(sd):
    sd["scaler"]["scale"] = 3.0


def _bad_skipped(sd):
    sd["skipped_steps"] = -1


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_bad_master, r"master of param 0 is \[2, 4\], expected a floating tensor of shape \[6, 4\]"),
        (_bad_scale, "power of two"),
        (_bad_skipped, "skipped_steps must be a non-negative int"),
    ],
)
def test_plain_load_with_a_bad_value_changes_nothing(damage, message):
    _, saved = _mp()
    sd = saved.state_dict()
    damage(sd)
    model, mp = _mp(seed=1)
    assert_refused_unchanged(
        lambda: _mp_snapshot(model, mp), lambda: mp.load_state_dict(sd), ValueError, message
    )


# --- Engine.load_checkpoint --------------------------------------------------------------------------------
def _sgd_engine():
    torch.manual_seed(0)
    model = TiedLM()
    return halfprec.initialize(
        model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), precision="bf16"
    )


def test_engine_load_of_another_optimizers_checkpoint_is_refused_naming_both(tmp_path):
    engine = build("bf16")
    train(engine, 2)
    engine.save_checkpoint(tmp_path)
    other = _sgd_engine()
    train(other, 1)
    assert_refused_unchanged(
        lambda: engine_snapshot(other),
        lambda: other.load_checkpoint(tmp_path),
        CheckpointError,
        "saved by AdamW, this optimizer is SGD",
    )


@pytest.mark.parametrize(
    ("name", "edit", "recorded", "message"),
    [
        ("optimizer", lambda s: s["scaler"].update(scale=3.0), {"loss_scale": 3.0}, "power of two"),
        ("optimizer", lambda s: s.update(skipped_steps="2"), {"skipped_steps": "2"}, "skipped_steps must be"),
        ("engine", lambda s: s.update(global_step=-3), {"global_step": -3}, "global_step must be a non-neg"),
        ("engine", lambda s: s.update(micro_step=1.5), {}, "micro_step must be a non-negative int"),
    ],
)
def test_engine_load_that_fails_in_a_later_part_changes_nothing(tmp_path, name, edit, recorded, message):
    """The weights (read first) must not be loaded when the optimizer or counters part then fails. The optimizer
    cases edit optimizer.pt: a checkpoint of the legacy layout, which must still be refused this way."""
    engine = build("fp16")
    train(engine, 3)
    path = legacy_checkpoint(engine, tmp_path) if name == "optimizer" else engine.save_checkpoint(tmp_path)
    state = load_pt(path, name)
    edit(state)
    _reseal(path, name, state, **recorded)
    other = build("fp16", seed=5)
    train(other, 1)
    assert_refused_unchanged(
        lambda: engine_snapshot(other),
        lambda: other.load_checkpoint(tmp_path),
        (CheckpointError, ValueError),
        message,
    )


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_load_in_the_middle_of_an_accumulation_equals_a_clean_resume(tmp_path, precision):
    engine = build(precision, gas=2)
    train(engine, 2)
    engine.save_checkpoint(tmp_path)

    clean = build(precision, gas=2, seed=7)
    clean.load_checkpoint(tmp_path)
    train(clean, 2)

    stale = build(precision, gas=2, seed=7)
    train(stale, 1)
    x = torch.randint(0, 37, (4, 9))
    stale.backward(stale(x[:, :-1]).float().square().mean())  # one micro-batch of an accumulation: grads left
    assert stale.micro_step % 2 == 1
    stale.load_checkpoint(tmp_path)
    assert all(p.grad is None for p in stale.module.parameters())
    train(stale, 2)
    assert_same_tree(engine_snapshot(clean), engine_snapshot(stale))


# --- inputs that would be accepted silently -------------------------------------------------------------------
def test_a_scheduler_built_on_another_optimizer_is_refused():
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stray = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(stray, lambda s: 0.5)
    with pytest.raises(ValueError, match="LambdaLR was built on another optimizer"):
        halfprec.initialize(model, opt, lr_scheduler=sched, precision="bf16")


def test_save_checkpoint_to_an_empty_directory_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    engine = build("bf16")
    train(engine, 1)
    with pytest.raises(ValueError, match="checkpoint directory is ''"):
        engine.save_checkpoint("")
    assert list(tmp_path.iterdir()) == []
