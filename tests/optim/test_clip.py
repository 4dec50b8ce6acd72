"""The clip coefficient is torch's: grads scaled by it equal torch's clipping bit for bit, clamped at 1."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.clip import clip_coefficient


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e6])
@pytest.mark.parametrize("sizes", [(9,), (41, 3), (341,), (4231, 2)])
def test_scaling_by_the_coefficient_is_torchs_clipping(max_norm, sizes):
    g = torch.Generator().manual_seed(len(sizes))
    grads = [torch.randn(n, generator=g) for n in sizes]
    ours = [t.clone() for t in grads]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads, strict=True):
        p.grad = t.clone()
    norm = torch.nn.utils.get_total_norm(grads)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    torch._foreach_mul_(ours, clip_coefficient(max_norm, norm))
    for p, t in zip(params, ours, strict=True):
        assert torch.equal(p.grad, t)


def test_the_coefficient_is_clamped_at_one():
    assert clip_coefficient(10.0, torch.tensor(1.0)).item() == 1.0
    assert clip_coefficient(1.0, torch.tensor(4.0)).item() == pytest.approx(0.25, rel=1e-6)
