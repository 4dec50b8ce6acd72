"""``halfprec export`` and ``halfprec inspect`` (``halfprec.cli.export``): the fp32 masters of an engine checkpoint
written as safetensors, a checkpoint described line by line, one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from safetensors.torch import load_file
from tests.engine_util import build, train

from halfprec.cli import export as cli_export
from halfprec.cli.main import main


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    engine = build("fp16")
    train(engine, 2)
    path = tmp_path_factory.mktemp("ck")
    engine.save_checkpoint(path)
    return path, {n: p.detach().clone() for n, p in engine.module.state_dict().items()}  # tied names too


@pytest.mark.parametrize("add", [cli_export.add_export_arguments, cli_export.add_inspect_arguments])
def test_every_option_has_help(add):
    parser = argparse.ArgumentParser()
    add(parser)
    assert [a.option_strings for a in parser._actions if not a.help] == []


def test_export_writes_the_fp32_masters(checkpoint, tmp_path, capsys):
    path, params = checkpoint
    out = tmp_path / "w.safetensors"
    assert main(["export", str(path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    written = load_file(str(out))
    assert sorted(written) == sorted(params)
    for name, p in params.items():
        assert written[name].dtype == torch.float32, name
        assert torch.equal(written[name].to(p.dtype), p), name  # the fp16 weights are these masters rounded
    assert any(
        not torch.equal(written[n], p.float()) for n, p in params.items()
    )  # the masters, not the weights


def test_inspect_prints_aligned_rows(checkpoint, capsys):
    path, _ = checkpoint
    assert main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and all("  " in line for line in lines)


@pytest.mark.parametrize("command", ["export", "inspect"])
def test_a_missing_checkpoint_is_one_line_exit_2(command, tmp_path, capsys):
    extra = ["--out", str(tmp_path / "w.safetensors")] if command == "export" else []
    assert main([command, str(tmp_path / "nothing"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"halfprec {command}: error: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("existing", [False, True])
def test_export_out_naming_a_directory_is_one_line_exit_2(checkpoint, tmp_path, capsys, existing):
    # Path("newdir/") drops the separator: the weights would have become a file named newdir.
    path, _ = checkpoint
    target = tmp_path / "newdir"
    if existing:
        target.mkdir()
        out, match = (
            str(target),
            r"it is a directory; pass the path of the file to write, e.g. .*model.safetensors",
        )
    else:
        out, match = f"{target}/", r"ends in a path separator, .* e.g. --out .*newdir/model.safetensors"
    assert main(["export", str(path), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("halfprec export: error: --out" if not existing else "halfprec export: error: ")
    assert re.search(match, err) and err.count("\n") == 1, err
    assert (target.is_dir() and not any(target.iterdir())) if existing else not target.exists()


def test_export_into_a_directory_by_file_name(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    out = tmp_path / "newdir" / "model.safetensors"
    assert main(["export", str(path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}" and out.is_file()
