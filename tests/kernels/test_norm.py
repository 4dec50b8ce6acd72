"""The norm / non-finite pass and the finalize pass, on odd sizes, against an fp64 reference."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.layout import build_table

from ..optim.helpers import DEVICE
from ..tolerances import tol

SIZES = [1, 127, 4097, 2**16 + 3]


def _run(grads, flags, scale, max_norm, check=True, keep=None):
    from halfprec.kernels import norm
    from halfprec.kernels.settings import settings

    dtype = grads[0].dtype
    offsets, total = [], 0
    for g in grads:
        offsets.append(total)
        total += (g.numel() + 15) // 16 * 16
    flat = torch.zeros(total, dtype=dtype)  # padding is zero (and read)
    for g, o in zip(grads, offsets, strict=True):
        flat[o : o + g.numel()] = g
    n = len(grads)
    table = build_table(
        offsets, [g.numel() for g in grads], list(range(n)), settings().norm_block, flat.device
    )
    sq = torch.zeros(table.shape[0])
    bad = torch.zeros(table.shape[0])
    scalars = torch.zeros(8)
    steps = torch.zeros(n)
    pscal = torch.zeros(n, 16)
    flags_t = torch.tensor(flags, dtype=torch.int32)
    scale_t = torch.tensor(scale)
    flat, table, sq, bad, scalars, steps, pscal, flags_t, scale_t = (
        t.to(DEVICE) for t in (flat, table, sq, bad, scalars, steps, pscal, flags_t, scale_t)
    )
    norm.sumsq(flat, table, flags_t, scale_t, sq, bad)
    norm.finalize(
        sq,
        bad,
        scale_t,
        scalars,
        max_norm,
        flags_t,
        steps,
        torch.zeros(n, dtype=torch.int32, device=DEVICE),
        torch.tensor([[1e-3, 0.9, 0.99, 1e-8, 0.0, 1.0, 0, 0]], dtype=torch.float64, device=DEVICE),
        pscal,
        check=check,
        kind=0,
    )
    if keep is not None:
        keep["flags"] = flags_t.cpu()
    return scalars.cpu(), steps.cpu()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_norm_and_clip_coefficient(dtype):
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=g) * 64).to(dtype) for n in SIZES]
    flags = [1, 0, 1, 1]  # the second param got no grad: excluded
    scalars, steps = _run(grads, flags, 64.0, 1.0)
    want = torch.sqrt(sum((x.double() / 64).pow(2).sum() for x, f in zip(grads, flags, strict=True) if f))
    assert scalars[0] == 0.0
    torch.testing.assert_close(scalars[1].double(), want, **tol("grad_norm"), check_dtype=False)
    coef = (1.0 / (scalars[1] + 1e-6)).clamp(max=1.0) / 64
    assert scalars[2] == coef
    assert steps.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert scalars[4] == 64.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_skips_and_keeps_counters(bad):
    grads = [torch.randn(n).half() for n in SIZES[:3]]
    grads[2][100] = bad
    scalars, steps = _run(grads, [1, 1, 1], 1.0, None)
    assert scalars[0] == 1.0 and scalars[3] == 1.0
    assert steps.tolist() == [0.0, 0.0, 0.0]


def test_nonfinite_in_a_param_without_grad_is_ignored():
    grads = [torch.randn(n).half() for n in SIZES[:2]]
    grads[1][5] = float("inf")  # a stale view: the param got no grad this step
    scalars, _ = _run(grads, [1, 0], 1.0, None)
    assert scalars[0] == 0.0


def test_no_check_means_no_skip():
    grads = [torch.randn(9).half()]
    grads[0][0] = float("inf")
    scalars, steps = _run(grads, [1], 1.0, None, check=False)
    assert scalars[0] == 0.0 and steps.tolist() == [1.0]


def test_finalize_consumes_the_marks_and_reports_the_scale_after():
    grads = [torch.randn(n).half() for n in SIZES[:3]]
    keep = {}
    scalars, _ = _run(grads, [1, 0, 1], 8.0, None, keep=keep)
    assert keep["flags"].tolist() == [0, 0, 0]
    assert scalars[4] == 8.0 and scalars[5] == 8.0  # no scaler given: the scale stays
