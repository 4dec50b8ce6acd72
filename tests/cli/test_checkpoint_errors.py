"""Damaged checkpoints and failing writes give one-line errors that name the file.

``halfprec inspect``/``export`` print what the readers under them raise (a damaged safetensors file, DCP metadata
that is not DCP's, DCP data files cut short) as one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.engine_util import build, train

from halfprec.checkpoint.directory import LATEST
from halfprec.checkpoint.manifest import MANIFEST, CheckpointError, file_digest, manifest_digest
from halfprec.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _dcp(path: Path) -> Path:
    from halfprec import MixedPrecisionOptimizer
    from halfprec.distributed import checkpoint

    model = torch.nn.Linear(64, 32).bfloat16()
    mp = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.25))
    mp.backward(model(torch.ones(4, 64, dtype=torch.bfloat16)).float().sum())
    mp.step()
    return checkpoint.save(mp, path, named_parameters=model)


def _cut_data(path: Path) -> None:
    data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])


def _cut_metadata(path: Path) -> None:
    meta = path / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])


def _foreign_metadata(path: Path) -> None:
    (path / ".metadata").write_bytes(pickle.dumps(print))


@pytest.mark.parametrize("damage", [_cut_data, _cut_metadata, _foreign_metadata])
@pytest.mark.parametrize("command", ["inspect", "export"])
def test_a_damaged_dcp_checkpoint_is_one_line_exit_2(tmp_path, capsys, damage, command):
    damage(_dcp(tmp_path / "ck"))
    argv = [command, str(tmp_path / "ck")] + (
        ["--out", str(tmp_path / "w.safetensors")] if command == "export" else []
    )
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"halfprec {command}: error: ") and err.count("\n") == 1, err


def _reseal(path: Path, name: str, data: bytes) -> None:
    (path / name).write_bytes(data)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][name] = {"size": len(data), "sha256": file_digest(path / name)}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("command", ["inspect", "export"])
def test_a_damaged_safetensors_file_is_one_line_exit_2(tmp_path, capsys, command):
    engine = build("bf16")
    train(engine, 1)
    path = engine.save_checkpoint(tmp_path / "ck")
    _reseal(path, "model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")  # digests re-sealed
    argv = [command, str(path)] + (["--out", str(tmp_path / "w.safetensors")] if command == "export" else [])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "model.safetensors" in err and err.count("\n") == 1, err
    with pytest.raises(CheckpointError, match="cannot read .*model.safetensors"):
        build("bf16").load_checkpoint(path)


def test_a_binary_latest_pointer_is_named_as_damaged(tmp_path, capsys):
    engine = build("bf16")
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="a")
    (tmp_path / LATEST).write_bytes(b"\xff\xfe\x00\x81step")
    with pytest.raises(CheckpointError, match=r"latest is damaged.*pass tag= with one of: a"):
        build("bf16").load_checkpoint(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 2
    assert "latest is damaged" in capsys.readouterr().err
    engine.save_checkpoint(tmp_path, tag="b")  # a save replaces the damaged pointer
    assert (tmp_path / LATEST).read_text() == "b\n"


_SAVE_OVER_LIMIT = """
import resource, signal, sys
from tests.engine_util import build, train
engine = build("fp16")
train(engine, 1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000))  # the optimizer's data file (written first) does not fit
try:
    engine.save_checkpoint(sys.argv[1])
except Exception as e:
    print(type(e).__name__, e)
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_save_over_the_file_size_limit_names_the_file_and_the_os_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _SAVE_OVER_LIMIT, str(tmp_path / "ck")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("CheckpointError cannot write checkpoint file "), proc.stdout
    assert "/__0_0.distcp" in proc.stdout and "File too large" in proc.stdout, proc.stdout
    assert not (tmp_path / "ck" / "step-1").exists()
