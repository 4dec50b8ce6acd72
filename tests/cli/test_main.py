"""The ``halfprec`` command itself: --version, help text for every option, one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import halfprec
from halfprec.cli import bench, demo
from halfprec.cli.main import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"halfprec {halfprec.__version__}"


@pytest.mark.parametrize("module", [demo, bench], ids=["demo", "bench"])
def test_every_option_has_help(module):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    missing = [a.option_strings for a in parser._actions if not a.help]
    assert not missing


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--iters", "0"], "halfprec bench: --iters must be >= 1, got 0"),
        (["--warmup", "-1"], "halfprec bench: --warmup must be >= 0, got -1"),
    ],
)
def test_bench_bad_counts_exit_2_in_one_line(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert capsys.readouterr().err.strip() == message


def test_a_bad_demo_flag_through_the_entry_point_is_one_line_without_traceback(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "halfprec.cli.main", "demo", "--n-embd", "130", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "halfprec demo: --n-embd 130: must be a multiple of 4 (the heads)"
    assert done.stdout == "" and not out.exists()
