"""The README's torchrun command runs (CPU, gloo, 2 processes), and its checkpoint resumes at another stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_train_ddp_zero2_then_resume_at_zero1(tmp_path):
    ckpt = str(tmp_path / "ck")
    out = _torchrun("--zero", "2", "--steps", "3", "--width", "32", "--ckpt", ckpt)
    assert "step    2" in out and "saved" in out
    out = _torchrun("--zero", "1", "--steps", "2", "--width", "32", "--ckpt", ckpt)
    assert "resumed from" in out and "step    1" in out
