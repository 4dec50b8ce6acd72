"""The torchrun command of docs/distributed.md runs (CPU, gloo, 2 processes), and its checkpoint resumes at
another ZeRO stage, saved under the step reached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"


def _torchrun(*args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_train_ddp_zero2_then_resume_at_zero1_saves_under_the_step_reached(tmp_path):
    ckpt = tmp_path / "ck"
    out = _torchrun("--zero", "2", "--steps", "3", "--width", "32", "--ckpt", str(ckpt))
    assert "step    2" in out and f"saved {ckpt / 'step-3'}" in out
    first = _files(ckpt / "step-3")
    out = _torchrun("--zero", "1", "--steps", "2", "--width", "32", "--ckpt", str(ckpt))
    assert f"resumed from {ckpt / 'step-3'} (step 3)" in out and "step    4" in out
    assert f"saved {ckpt / 'step-5'}" in out
    # the loaded checkpoint still holds the 3 steps it was named after (a resumed run must not overwrite it)
    assert sorted(os.listdir(ckpt)) == ["step-3", "step-5"] and _files(ckpt / "step-3") == first
