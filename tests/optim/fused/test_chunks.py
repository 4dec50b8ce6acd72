"""A fused optimizer over several chunks per dtype (``chunk_elements``, kernels/settings.py): the same update as over
one, and a backward that holds only the grad buffers of the chunks it has reached."""

from __future__ import annotations

import copy

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdamW, FusedLamb, FusedSGD

from ...tolerances import approx, tol
from ..helpers import DEVICE

SMALL = "chunk_elements=4096"  # Chain's layers are 1,040 elements each (padded): about four to a chunk
ALGORITHMS = [
    (FusedAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
    (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (FusedAdagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    (FusedLamb, dict(lr=1e-2, weight_decay=0.05)),
]


class Chain(torch.nn.Module):
    def __init__(self, layers: int = 12, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _build(cls, hp, monkeypatch, launch: str | None, **options):
    """(model, optimizer) over a fp16 Chain, built with ``HALFPREC_LAUNCH=launch``."""
    if launch is None:
        monkeypatch.delenv("HALFPREC_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("HALFPREC_LAUNCH", launch)
    model = Chain().to(DEVICE, torch.float16)
    return model, cls(model.parameters(), **hp, **options)


def _train(model, opt, steps: int = 3) -> list[float | None]:
    norms = []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).to(DEVICE, torch.float16)
        opt.backward(model(x).float().mean())
        opt.step()
        norms.append(opt.grad_norm)
        opt.zero_grad()
    return norms


def _state(opt) -> list[torch.Tensor]:
    """Every tensor of the optimizer's checkpoint state, in order (masters, moments, sums, step counters)."""
    return _state_of(opt.state_dict())


def _state_of(sd) -> list[torch.Tensor]:
    state = sd["optimizer"]["state"]
    masters = [sd["masters"][k] for k in sorted(sd["masters"])]
    return masters + [v for k in sorted(state) for _, v in sorted(state[k].items()) if torch.is_tensor(v)]


@pytest.mark.parametrize("cls,hp", ALGORITHMS, ids=[c.__name__ for c, _ in ALGORITHMS])
def test_a_step_over_many_chunks_equals_the_step_over_one_bit_for_bit(cls, hp, monkeypatch):
    # without clipping each element's update is its own, wherever its chunk starts
    one = _build(cls, hp, monkeypatch, None)
    many = _build(cls, hp, monkeypatch, SMALL)
    assert len(many[1]._chunks) > 2 and len(one[1]._chunks) == 1
    _train(*one), _train(*many)
    for a, b in zip(one[0].parameters(), many[0].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_state(one[1]), _state(many[1]), strict=True):
        assert torch.equal(a, b)


def test_the_global_norm_and_clipping_span_every_chunk(monkeypatch):
    # the norm's partial sums are added in another order: equal to fp32 rounding, and clipping scales alike
    cls, hp = ALGORITHMS[0]
    one = _build(cls, hp, monkeypatch, None, max_grad_norm=1e-3)
    many = _build(cls, hp, monkeypatch, SMALL, max_grad_norm=1e-3)
    norms_one, norms_many = _train(*one), _train(*many)
    assert all(n > 1e-3 for n in norms_one)  # every step clipped
    assert norms_many == approx(norms_one, "grad_norm")
    for a, b in zip(_state(one[1]), _state(many[1]), strict=True):  # masters, moments, counters
        torch.testing.assert_close(b, a, **tol("fused_master", torch.float16))


def test_an_overflow_in_one_chunk_skips_the_step_in_every_chunk(monkeypatch):
    model, opt = _build(
        FusedAdamW, dict(lr=1e-2), monkeypatch, SMALL, loss_scaler=halfprec.DynamicLossScaler()
    )
    _train(model, opt, steps=1)
    before = copy.deepcopy(opt.state_dict())
    assert len(_state_of(before)) > 24
    weights = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.ones(8, 32, device=DEVICE, dtype=torch.float16)).float().mean())
    next(model.parameters()).grad[0, 0] = float("inf")  # the first layer: the first chunk only
    opt.step()
    assert opt.step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    for a, b in zip(_state_of(before), _state(opt), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("accum", ["param", "fp32"], ids=["16-bit grads", "fp32 sums"])
def test_the_backward_holds_the_grad_buffers_of_the_chunks_it_reached(accum, monkeypatch):
    model, opt = _build(FusedAdamW, dict(lr=1e-2), monkeypatch, SMALL, grad_accum_dtype=accum)
    _train(model, opt, steps=1)  # state made; zero_grad() freed the grad buffers
    chunks = opt._chunks
    assert [len(c.params) for c in chunks] == [6, 6, 6, 6]  # three layers each
    made = {}

    def at(name):
        return lambda _: made.__setitem__(name, [c.grad is not None for c in chunks])

    layers = list(model.layers)
    x = torch.randn(8, 32, device=DEVICE, dtype=torch.float16)
    h = torch.nn.Sequential(*layers[:3])(x)
    h.register_hook(at("first chunk's layers"))  # before the first chunk's params get their grads
    out = torch.nn.Sequential(*layers[3:])(h)
    out.register_hook(at("start"))
    opt.backward(out.float().mean())
    assert made == {"start": [False] * 4, "first chunk's layers": [False, True, True, True]}
    size = 2 if accum == "param" else 4
    assert [c.grad.nbytes for c in chunks] == [c.numel * size for c in chunks]
