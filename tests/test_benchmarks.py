"""``benchmarks/bench_train.py --smoke`` on the CPU: every system the device runs that a CPU can (the fused kernels
and split masters under the Triton interpreter, FSDP2 on a one-rank gloo mesh, torch.compile, torchao's float8), so that a broken
system fails here and not in the device's scarce minutes; after the same steps on the same batches, every
system's loss is autocast's to within bf16's rounding."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = [
    "autocast", "halfprec", "halfprec-split", "halfprec-keep", "fsdp2", "fsdp2-halfprec", "fsdp2-halfprec-split",
    "fsdp2-halfprec-exact", "autocast-compiled", "halfprec-compiled", "fsdp2-halfprec-compiled",
]  # fmt: skip
# torchao's float8 recipe and halfprec over it: with the [float8] extra (CI installs it)
FLOAT8 = ["torchao-float8", "halfprec-float8", "halfprec-float8-compiled", "torchao-float8-compiled"]


def test_bench_train_smoke_runs_every_cpu_system(tmp_path):
    systems = SYSTEMS + (FLOAT8 if importlib.util.find_spec("torchao") else [])
    out = tmp_path / "runs.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2"}
    command = [sys.executable, "benchmarks/bench_train.py", "--smoke", "--systems", ",".join(systems)]
    done = subprocess.run(
        [*command, "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    saved = json.loads(out.read_text())
    assert saved["failures"] == []
    # the raw file carries its provenance: when, what was run, from which source, with which packages
    assert saved["command"][1:3] == ["--smoke", "--systems"] and saved["date"].endswith("Z")
    assert saved["versions"]["torch"] == torch.__version__ and "triton" in saved["versions"]
    assert saved["commit"] is None or len(saved["commit"]) >= 7
    losses = {run["system"]: run["final_loss"] for run in saved["runs"]}
    assert sorted(losses) == sorted(systems)
    reference = losses["autocast"]
    assert all(abs(loss - reference) < 0.02 for loss in losses.values()), losses
