"""The bench's result table, and its as-called timing run on CPU under Triton's interpreter (the measurement itself
needs a GPU: tests/optim/test_gpu.py runs it there)."""

from __future__ import annotations

import pytest
import torch

import halfprec


def _row(**extra):
    return dict(
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
        **extra,
    )


def _table(row) -> str:
    from halfprec.cli.bench_step import format_table

    return format_table(
        dict(device="H200", torch="2.11", triton="3.6", workload="268M", copy_gbps=4250.0, rows=[row])
    )


def test_format_table():
    text = _table(_row())
    assert "| fused | adamw | float16 | 268.5M | 2.000 | 1.905 | 1.05 |" in text
    assert text.splitlines()[-1].endswith("| 0.200 |  |  |  |  |")  # no as-called timing: blank cells


def test_format_table_gives_the_as_called_step_against_the_floor():
    text = _table(_row(user_ms=2.5, user_skipped_ms=0.8, user_host_ms=0.4))
    # 2.5 ms against the floor of 2.0 / 1.05 = 1.905 ms: 1.31x
    assert text.splitlines()[-1].endswith("| 0.200 | 2.500 | 1.31 | 0.800 | 0.400 |")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's CPU run; the GPU bench times the real one"
)
@pytest.mark.parametrize("overflow", [False, True])
def test_time_as_users_call_runs_zero_grad_a_backward_and_the_step(overflow):
    from halfprec.cli.bench_step import time_as_users_call
    from halfprec.optim import FusedAdamW

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).half()) for s in [(33, 7), (5,)]]
    grads = [(torch.randn(p.shape, generator=g) * 1e-3).half() for p in params]
    opt = FusedAdamW(params, lr=1e-2, loss_scaler=halfprec.StaticLossScaler(2.0**4))
    before = [p.detach().clone() for p in params]
    ms, host_ms = time_as_users_call(opt, params, grads, warmup=1, iters=2, overflow=overflow)
    assert ms > 0 and host_ms > 0
    # three steps, each from grads backward produced (loss-scaled, unscaled by the step), or all skipped
    assert opt.skipped_steps == (3 if overflow else 0)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)) == overflow
    # the grads were the given ones: the masters' first-moment state is their (1 - beta1)-weighted sum
    if not overflow:
        exp_avg = opt.state_dict()["optimizer"]["state"][0]["exp_avg"]
        expected = grads[0].float() * (1 - 0.9**3)
        torch.testing.assert_close(exp_avg, expected, rtol=1e-5, atol=1e-8)
