"""Save at step N, resume in a fresh process, continue: equals the uninterrupted run bit for bit.

For Accelerate (``save_state``/``load_state``), Lightning (``.ckpt`` and ``fit(ckpt_path=...)``) and Fabric
(``fabric.save``/``fabric.load``), in bf16 and fp16: this process trains ``FIRST`` steps through the tool and
saves; one child process (``_resume_child``, shared by all six cases to pay the import cost once) rebuilds
everything with another init seed, loads, and continues to ``TOTAL`` steps. The child's state right after the
load must equal the state this process saved, and its continuation (losses, learning rates, skips, grad norms,
scales, weights, masters, every optimizer state tensor, scaler state, skip counter, scheduler state) must equal
the uninterrupted plain halfprec loop of ``_oracle``. The run has an overflow before the checkpoint and one
right after it, so in fp16 the scaler's hysteresis and growth tracker have to travel (see ``_resume_child``).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from ._oracle import DTYPES, Record, plain_loop  # noqa: E402
from ._resume_child import (  # noqa: E402
    FIRST,
    FIRST_INF_AT,
    REF_INF_AT,
    accelerate_batches,
    lightning_batches,
    snapshot,
)

CASES = [(fw, name) for fw in ("accelerate", "fabric", "lightning") for name in ("bf16", "fp16")]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _save_accelerate(name: str, path: pathlib.Path) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from .test_accelerate import _setup, _train

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    dtype = DTYPES[name]
    acc, model, mp, opt, loader, sched = _setup(dtype, accelerate_batches(), 2)
    _train(acc, model, mp, opt, loader, sched, dtype, Record(), FIRST_INF_AT, stop_after=2 * FIRST)
    acc.save_state(path)
    saved = snapshot(model, mp, sched)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return saved


def _save_fabric(name: str, path: pathlib.Path) -> dict:
    from .test_fabric import _setup, _train

    fabric, model, opt, sched = _setup(name)
    _train(fabric, model, opt, sched, accelerate_batches()[: 2 * FIRST], Record(), inf_at=FIRST_INF_AT)
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched})
    return snapshot(model.module, opt.optimizer, sched)


def _save_lightning(name: str, path: pathlib.Path) -> dict:
    from .test_lightning import _fit

    trainer, model = _fit(name, lightning_batches(), epochs=1, inf_at=FIRST_INF_AT)
    trainer.save_checkpoint(path)
    return snapshot(model.net, trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler)


_SAVE = {"accelerate": _save_accelerate, "fabric": _save_fabric, "lightning": _save_lightning}


def _reference(framework: str, name: str) -> dict:
    """The uninterrupted run: the plain halfprec loop over all TOTAL steps (Lightning rounds its targets)."""
    if framework == "lightning":
        batches, cast = lightning_batches() * 2, True
    else:
        batches, cast = accelerate_batches(), False
    model, mp, sched, rec = plain_loop(DTYPES[name], batches, accum=2, inf_at=REF_INF_AT, cast_targets=cast)
    tail = Record(
        rec.losses[2 * FIRST :],
        rec.lrs[FIRST:],
        rec.skipped[FIRST:],
        rec.grad_norms[FIRST:],
        rec.scales[FIRST:],
    )
    return snapshot(model, mp, sched, tail)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Saves the six checkpoints here, runs the one child; gives (child results, saved snapshots)."""
    tmp = tmp_path_factory.mktemp("resume")
    saved, specs = {}, []
    for framework, name in CASES:
        path = tmp / f"{framework}-{name}" / ("state" if framework == "accelerate" else "state.ckpt")
        path.parent.mkdir()
        saved[framework, name] = _SAVE[framework](name, path)
        specs.append(f"{framework}:{name}:{path}")
    out = tmp / "child.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations._resume_child", str(out), *specs],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True), saved


def _assert_equal(got, want, where: str) -> None:
    """Recursive bit-for-bit equality of snapshots: tensors by dtype and bits, everything else by ==."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype, where
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_equal(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "name"), CASES)
def test_resume_in_a_fresh_process_bit_exact(resumed, framework, name):
    child, saved = resumed
    result = child[f"{framework}/{name}"]
    ref = _reference(framework, name)

    _assert_equal(result["loaded"], saved[framework, name], "loaded")
    _assert_equal(result["final"], ref, "final")
    # The checks have teeth: the child's own init differs, the run skipped before and right after the
    # checkpoint, and in fp16 the scale moved (back off at step FIRST, since hysteresis was spent at step 1).
    assert ref["record"]["skipped"][0] and ref["skipped_steps"] == 2
    if name == "fp16":
        assert saved[framework, name]["scaler"]["growth_tracker"] == 1
        assert saved[framework, name]["scaler"]["hysteresis_left"] == 1
        assert ref["record"]["scales"][0] == saved[framework, name]["scaler"]["scale"] / 2
        assert len(set(ref["record"]["scales"])) > 1
