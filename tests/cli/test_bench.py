"""`halfprec bench` argument mapping (the measurement itself needs a GPU and is not a test)."""

from __future__ import annotations

import argparse

import pytest
import torch

from halfprec.cli import bench


def test_arguments_and_no_cuda_exit_code(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--optimizers", "adamw,sgd", "--dtypes", "bfloat16", "--iters", "3"])
    assert args.optimizers == "adamw,sgd" and args.dtypes == "bfloat16" and args.iters == 3
    if torch.cuda.is_available():
        pytest.skip("the no-CUDA message is for machines without a GPU")
    assert bench.run(args) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
