"""The oracle every integration test compares against: the plain halfprec loop on the same model and data.

The model is a tiny fp32 MLP with odd sizes, cast by ``MixedPrecisionOptimizer(param_dtype=...)`` (the masters
start from the fp32 weights); the loss is computed in fp32 from the 16-bit output. fp16 uses a small dynamic
scale that grows every 2 clean steps, so the scaler state changes during a run and must survive a resume.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import halfprec

from ..tolerances import approx, tol

__all__ = [
    "DTYPES",
    "FUSED_PATHS",
    "fused_oracle",
    "InfInjector",
    "Record",
    "assert_same_weights",
    "loss_fn",
    "make_batches",
    "make_loader",
    "make_model",
    "make_optimizer",
    "make_scheduler",
    "plain_loop",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH = 5
LR = 1e-2
CLIP = 0.05  # small enough that every step of the run is clipped

# (device, impl) of the fused-path tests: the interpreter (TRITON_INTERPRET=1, tests/conftest.py) runs the kernels
# on CPU when asked for explicitly; on CUDA "auto" must pick them, as users get them
FUSED_PATHS = [
    pytest.param("cpu", "triton", id="interpreter"),
    pytest.param("cuda", "auto", id="cuda", marks=pytest.mark.gpu),
]


def make_model(seed: int = 0, device: str = "cpu") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3)).to(device)


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(n)]


def make_loader(batches) -> torch.utils.data.DataLoader:
    xs = torch.cat([x for x, _ in batches])
    ys = torch.cat([y for _, y in batches])
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xs, ys), batch_size=BATCH, shuffle=False
    )


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # both in fp32: CUDA's mse_loss backward refuses mixed dtypes (Lightning casts the targets to 16 bits)
    return nn.functional.mse_loss(out.float(), y.float())


def make_scaler(dtype: torch.dtype):
    if dtype == torch.float16:
        return halfprec.DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
    return None


def make_optimizer(
    model: nn.Module,
    dtype: torch.dtype,
    max_grad_norm: float | None = CLIP,
    impl: str = "torch",
    grad_accum_dtype: str = "param",
):
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return halfprec.MixedPrecisionOptimizer(
        inner,
        loss_scaler=make_scaler(dtype),
        max_grad_norm=max_grad_norm,
        param_dtype=dtype,
        impl=impl,
        grad_accum_dtype=grad_accum_dtype,
    )


def make_scheduler(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)


class InfInjector:
    """Puts an inf into one element of ``param``'s gradient on the given backward calls (0-based)."""

    def __init__(self, param: torch.Tensor, at: tuple[int, ...] = ()) -> None:
        self.at = set(at)
        self.calls = 0
        self.handle = param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        if call in self.at:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad


@dataclasses.dataclass
class Record:
    losses: list[float] = dataclasses.field(default_factory=list)  # per micro-batch, unscaled, undivided
    lrs: list[float] = dataclasses.field(default_factory=list)  # after each optimizer step
    skipped: list[bool] = dataclasses.field(default_factory=list)
    grad_norms: list[float | None] = dataclasses.field(default_factory=list)
    scales: list[float] = dataclasses.field(default_factory=list)
    clipped_norms: list[float] = dataclasses.field(default_factory=list, compare=False)  # after clipping


def plain_loop(
    dtype,
    batches,
    *,
    accum=1,
    inf_at=(),
    max_grad_norm=CLIP,
    model=None,
    mp=None,
    sched=None,
    cast_targets=False,
    impl="torch",
    device="cpu",
    grad_accum_dtype="param",
    gradient_sync=True,
):
    """The reference: ``mp.backward(loss / accum)`` per micro-batch, ``mp.step()`` at each boundary.

    ``cast_targets``: round the targets to ``dtype`` too, as Lightning's ``convert_input`` does to the batch.
    ``gradient_sync=False``: an FSDP2 model reduce-scatters the last micro-batch of each step only (the others run
    under ``set_requires_gradient_sync(False)``, as Accelerate's ``accumulate()`` runs them).
    """
    if model is None:
        model = make_model(device=device)
        mp = make_optimizer(model, dtype, max_grad_norm, impl, grad_accum_dtype)
        sched = make_scheduler(mp)
    injector = InfInjector(model[0].weight, inf_at)
    rec = Record()
    device = model[0].weight.device
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        if not gradient_sync:
            model.set_requires_gradient_sync((i + 1) % accum == 0)
        loss = loss_fn(model(x.to(dtype)), y.to(dtype) if cast_targets else y)
        rec.losses.append(loss.item())
        mp.backward(loss / accum)
        if (i + 1) % accum == 0:
            ref = _clip_reference(mp, max_grad_norm)
            mp.step()
            if ref is not None and not mp.step_was_skipped:
                _check_clipped(mp, ref, rec)
            if not mp.step_was_skipped:
                sched.step()
            mp.zero_grad()
            rec.lrs.append(sched.get_last_lr()[0])
            rec.skipped.append(mp.step_was_skipped)
            rec.grad_norms.append(mp.grad_norm)
            rec.scales.append(mp.loss_scale)
    injector.handle.remove()
    return model, mp, sched, rec


def _clip_reference(mp, max_grad_norm):
    """fp32 copies of the unscaled master grads, clipped by ``torch.nn.utils.clip_grad_norm_`` (the oracle of
    halfprec's clipping): ``(total norm, clipped grads)``, or None without clipping or on the fused path (whose
    grads are never unscaled in place; tests/optim checks its clipping)."""
    if max_grad_norm is None or mp.impl != "torch":
        return None
    mp.unscale_()
    copies = [torch.nn.Parameter(m.detach().clone()) for m in mp.master_params() if m.grad is not None]
    for c, m in zip(copies, [m for m in mp.master_params() if m.grad is not None], strict=True):
        c.grad = m.grad.detach().clone()
    total = torch.nn.utils.clip_grad_norm_(copies, max_grad_norm)
    return float(total), [c.grad for c in copies]


def _check_clipped(mp, ref, rec) -> None:
    """halfprec's reported norm is the unscaled norm before clipping, and the grads it stepped with are
    clip_grad_norm_'s, bit for bit."""
    total, clipped = ref
    assert mp.grad_norm == total, (mp.grad_norm, total)
    used = [m.grad for m in mp.master_params() if m.grad is not None]
    for got, want in zip(used, clipped, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    rec.clipped_norms.append(
        float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in used])))
    )


def assert_same_weights(model_a, mp_a, model_b, mp_b) -> None:
    """Model weights, masters and every optimizer state tensor identical (bit for bit)."""
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert a.dtype == b.dtype
        # the Lightning Trainer's teardown moves the module back to the CPU after fit
        torch.testing.assert_close(a.to(b.device), b, rtol=0, atol=0)
    for a, b in zip(mp_a.master_params(), mp_b.master_params(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        for key, value in mp_a.state[a].items():
            torch.testing.assert_close(value, mp_b.state[b][key], rtol=0, atol=0)
    assert mp_a.loss_scale == mp_b.loss_scale
    assert mp_a.skipped_steps == mp_b.skipped_steps


def fused_oracle(dtype, batches, *, device, impl, accum=2, inf_at=(), cast_targets=False):
    """The plain loop on the fused path (``impl`` on ``device``), the oracle of an integration on that path, after
    checking it against the plain loop on the exact path: the same skips, schedule and loss scales; the reported
    unscaled pre-clip norms and the masters within the fused path's tolerances (tests/tolerances.py)."""
    kw = dict(accum=accum, inf_at=inf_at, cast_targets=cast_targets, device=device)
    fused = plain_loop(dtype, batches, impl=impl, **kw)
    _, exact_mp, _, exact = plain_loop(dtype, batches, impl="torch", **kw)
    _, mp, _, rec = fused
    assert mp.impl == "triton" and exact_mp.impl == "torch"
    assert (rec.skipped, rec.lrs, rec.scales) == (exact.skipped, exact.lrs, exact.scales)
    for got, want, skipped in zip(rec.grad_norms, exact.grad_norms, rec.skipped, strict=True):
        assert skipped or got == approx(want, "grad_norm")
    assert all(n > CLIP for n, skipped in zip(rec.grad_norms, rec.skipped, strict=True) if not skipped)
    for got, want in zip(mp.master_params(), exact_mp.master_params(), strict=True):
        torch.testing.assert_close(got, want, **tol("fused_master", dtype))
    return fused
