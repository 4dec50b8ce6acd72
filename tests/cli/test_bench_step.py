"""The bench's result table (the measurement itself needs a GPU: tests/optim/test_gpu.py runs it there)."""

from __future__ import annotations


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
