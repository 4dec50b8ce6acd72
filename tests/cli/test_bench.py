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


def test_format_table():
    from halfprec.cli.bench_step import format_table

    row = dict(
        impl="fused",
        optimizer="adamw",
        dtype="float16",
        n_params=268_500_000,
        ms=2.0,
        gbps=4000.0,
        pct_copy_bw=94.0,
        x_floor=1.05,
        vs_plain=2.3,
        extra_mib=0.0,
        skipped_ms=0.3,
        graph_ms=1.9,
        graph_skipped_ms=0.2,
    )
    text = format_table(
        dict(device="H200", torch="2.11", triton="3.6", workload="268M", copy_gbps=4250.0, rows=[row])
    )
    assert "| fused | adamw | float16 | 268.5M | 2.000 | 1.905 | 1.05 |" in text
