"""Oracles: plain FP32 torch runs that halfprec must match, and helpers to drive both with the same grads."""

from __future__ import annotations

import copy

import torch

__all__ = ["make_model", "fp32_copy", "grads_like", "set_scaled_grads", "assert_same_state", "bits_equal"]


def make_model(dtype: torch.dtype, *, seed: int = 0, sizes=(9, 41, 7)) -> torch.nn.Module:
    """Odd-sized MLP; weights drawn in fp32, then cast (so the 16-bit weights are roundings of fp32 ones)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=False):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=gen) * 0.3)
            lin.bias.copy_(torch.randn(b, generator=gen) * 0.1)
        layers.append(lin)
    return torch.nn.Sequential(*layers).to(dtype)


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).float()


def grads_like(params, *, step: int, seed: int = 1, scale: float = 1e-2, dtype=None) -> list[torch.Tensor]:
    """Deterministic per-step grads in each param's dtype (or ``dtype``)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(dtype or p.dtype) for p in params]


# halfprec warns at a step after a backward that did not go through scale_loss; grads set by hand with
# set_scaled_grads are already scaled, so tests that turn warnings into errors let this one through
SCALED_BY_HAND = r"halfprec: step\(\) after a backward that was not loss-scaled"


def set_scaled_grads(params, grads, loss_scale: float) -> None:
    """What a scaled backward would leave: grad * scale in the param dtype (exact: power-of-two scale)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = (g.double() * loss_scale).to(p.dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_state(state_a: dict, state_b: dict, params_a, params_b) -> None:
    """Every state entry of every param equal bit for bit (tensors) or by value (others), same dtypes."""
    for pa, pb in zip(params_a, params_b, strict=True):
        sa, sb = state_a.get(pa, {}), state_b.get(pb, {})
        assert sa.keys() == sb.keys(), (sorted(sa), sorted(sb))
        for key in sa:
            va, vb = sa[key], sb[key]
            if torch.is_tensor(va):
                assert torch.is_tensor(vb), key
                assert va.dtype == vb.dtype, (key, va.dtype, vb.dtype)
                assert torch.equal(va.cpu(), vb.cpu()), key
            else:
                assert va == vb, (key, va, vb)
