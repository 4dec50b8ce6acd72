"""The fused optimizers' flat grad buffers (optim/fused/grads.py) live from a step's first grad to its zero_grad.

Oracle: the same loop on a twin whose buffers stay (``model.zero_grad()`` where the subject calls
``zero_grad(set_to_none=True)``: it clears ``.grad`` as that call did before the buffers were freed) must give
the same masters, params and state bit for bit. Memory is counted as ``torch.cuda.memory_allocated`` counts it:
the bytes of the storages that live tensors hold (on CPU too), and whether a storage is still alive at all.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdamW, FusedLamb, FusedSGD
from halfprec.optim.fused.grads import GradViews
from halfprec.optim.layout import chunk_params

from ..helpers import DEVICE

FP32 = torch.float32
_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


class Net(torch.nn.Module):
    """A 16-bit layer, an fp32 layer (two chunks: two grad buffers) and a 16-bit layer that never gets a grad."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(9, 41).half()
        self.b = torch.nn.Linear(41, 7)
        self.unused = torch.nn.Linear(3, 5).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x.half()).float())


def build(cls, accum):
    model = Net().to(DEVICE)
    twin = copy.deepcopy(model)
    hp = dict(lr=1e-2, momentum=0.9) if cls is FusedSGD else dict(lr=1e-2)

    def opt(m):
        scaler = halfprec.DynamicLossScaler(init_scale=2.0**8, hysteresis=1)
        return cls(m.parameters(), **hp, loss_scaler=scaler, max_grad_norm=1.0, grad_accum_dtype=accum)

    return (model, opt(model)), (twin, opt(twin))


def grads_held(model, mp) -> list[torch.Tensor]:
    """The grads the kernels will read: the params' ``.grad`` and, with fp32 accumulation, the masters'."""
    return [t.grad for t in [*model.parameters(), *mp.master_params()] if t.grad is not None]


def storages(tensors) -> dict[int, int]:
    """``{storage address: bytes}`` of the storages behind ``tensors``."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def live_bytes() -> int:
    """What ``torch.cuda.memory_allocated`` would count, on any device: the bytes of every live tensor's storage."""
    gc.collect()
    live = (o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.layout == torch.strided)
    return sum(storages(live).values())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.detach().view(_INT[a.dtype]), b.detach().view(_INT[b.dtype]))


def assert_same_bits(mp, ref, model, twin) -> None:
    for a, b in zip(
        [*mp.master_params(), *model.parameters()], [*ref.master_params(), *twin.parameters()], strict=True
    ):
        assert same_bits(a, b)
    sa, sb = mp.state_dict()["optimizer"]["state"], ref.state_dict()["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for k, entry in sa.items():
        for name, v in entry.items():
            assert same_bits(v, sb[k][name]), (k, name)


def batch(step: int, j: int) -> torch.Tensor:
    return torch.randn(4, 9, generator=torch.Generator().manual_seed(10 * step + j)).to(DEVICE)


def set_by_hand(model, names, step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for name in names:
        p = model.get_parameter(name)
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2 * scale).to(DEVICE, p.dtype)


# per step: (backwards, params whose .grad is assigned by hand, overflow in the second backward, steps, then)
STEPS = [
    (2, (), False, 1, "none"),  # accumulation
    (2, (), False, 1, "zeros"),
    (1, ("a.bias",), False, 1, "none"),  # a backward's grad replaced by hand on a zeroed, kept buffer
    (0, ("a.weight", "b.bias"), False, 1, "zeros"),  # hand-set grads only, after the buffers were freed
    (2, ("b.weight",), False, 1, "none"),
    (2, (), True, 1, "none"),  # an overflow: the step is skipped
    (1, (), False, 2, "none"),  # step() twice without zero_grad: the grads and their buffers stay
    (2, (), False, 1, "none"),
]


@pytest.mark.parametrize(
    ("cls", "accum"),
    [(FusedAdamW, None), (FusedAdamW, FP32), (FusedSGD, None), (FusedLamb, FP32), (FusedAdagrad, None)],
)
def test_freed_buffers_give_the_kept_buffers_results_bit_for_bit(cls, accum):
    (model, mp), (twin, ref) = build(cls, accum)
    for step, (backwards, by_hand, overflow, steps, then) in enumerate(STEPS):
        for m, opt in ((model, mp), (twin, ref)):
            for j in range(backwards):
                bad = overflow and j == 1
                opt.backward(m(batch(step, j)).float().pow(2).mean() * (float("inf") if bad else 1.0))
            set_by_hand(m, by_hand, step, opt.loss_scale)
            opt.step()
            if steps == 2:  # a second step() without zero_grad finds no new grad: nothing moves
                stepped = [t.clone() for t in opt.master_params()]
                opt.step()
                assert all(same_bits(a, b) for a, b in zip(opt.master_params(), stepped, strict=True))
        assert mp.step_was_skipped is ref.step_was_skipped is overflow
        held = [StorageWeakRef(t.untyped_storage()) for t in grads_held(model, mp)]
        assert held and not any(w.expired() for w in held)  # kept by the step(s)
        mp.zero_grad(set_to_none=then == "none")
        if then == "none":
            twin.zero_grad()  # clears .grad only: the twin's buffers stay
        else:
            ref.zero_grad(set_to_none=False)
        gc.collect()
        assert all(w.expired() for w in held) is (then == "none"), step
        assert_same_bits(mp, ref, model, twin)
    assert mp.skipped_steps == ref.skipped_steps == 1
    unused = mp.state_dict()["optimizer"]["state"].get(4, {})
    assert float(unused.get("step", 0.0)) == 0.0  # the unused layer's weight: never updated


@pytest.mark.parametrize("accum", [None, FP32])
def test_zero_grad_frees_the_buffers_and_the_next_grad_makes_them(accum):
    (model, mp), _ = build(FusedAdamW, accum)
    mp.backward(model(batch(0, 0)).float().pow(2).mean())
    buffers = storages(grads_held(model, mp))  # (with fp32 accumulation the masters' .grad until the step)
    mp.step()
    # a 16-bit chunk (9*41, 41, 3*5 and 5 params, each padded to 16) and an fp32 one (41*7 and 7): 2 or 4 B/param
    assert sorted(buffers.values()) == sorted([(384 + 48 + 16 + 16) * (4 if accum else 2), (288 + 16) * 4])
    before = live_bytes()
    mp.zero_grad(set_to_none=False)
    assert live_bytes() == before  # zeroed and kept
    mp.zero_grad()
    assert before - live_bytes() == sum(buffers.values())
    assert all(p.grad is None for p in model.parameters()) and all(m.grad is None for m in mp.master_params())
    mp.backward(model(batch(0, 1)).float().pow(2).mean())
    assert sorted(storages(grads_held(model, mp)).values()) == sorted(buffers.values())  # made again
    assert live_bytes() == before


def test_a_captured_step_needs_the_buffer_and_pins_it():
    # what step() asks of the grad views, eagerly and in capture (the capture itself: the GPU test below)
    params = [torch.nn.Parameter(torch.randn(n).to(DEVICE, torch.float16)) for n in (9, 41)]
    [(chunk, idx)] = chunk_params(params, [p.detach().float() for p in params], flat_params=True)
    grads = GradViews(params, [(chunk, k) for k in idx], torch.device(DEVICE))
    with pytest.raises(RuntimeError, match="torch.float16 params was freed by zero_grad"):
        grads.ready([chunk], capturing=True)
    grads.ready([chunk], capturing=False)  # an eager step makes it, zero
    assert chunk.grad is not None and not chunk.grad.any()
    grads.clear([chunk], set_to_none=True)
    assert chunk.grad is None and chunk.grad_views == []
    grads.ready([chunk], capturing=False)
    grads.ready([chunk], capturing=True)
    buffer = chunk.grad
    grads.clear([chunk], set_to_none=True)
    assert chunk.grad is buffer  # the graph reads its address: kept for good


@pytest.mark.gpu
@pytest.mark.parametrize("accum", [None, FP32])
def test_the_forward_peak_drops_by_the_grad_buffer(accum):
    def forward_peak(set_to_none: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda().half()
        mp = FusedAdamW(model.parameters(), lr=1e-3, grad_accum_dtype=accum)
        x = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
        mp.backward(model(x).float().pow(2).mean())
        # the caching allocator rounds every block up to 512 bytes
        buffer = sum(-(-n // 512) * 512 for n in storages(grads_held(model, mp)).values())
        mp.step()
        held = torch.cuda.memory_allocated()
        mp.zero_grad(set_to_none=set_to_none)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model(x).float().pow(2).mean()
        return torch.cuda.max_memory_allocated() - held, buffer

    kept, buffer = forward_peak(False)
    freed, _ = forward_peak(True)
    assert buffer == 4 * (1024 * 1024 + 1024) * (4 if accum else 2)
    assert kept - freed == buffer


@pytest.mark.gpu
def test_a_captured_step_needs_the_buffers_and_then_keeps_them():
    model = torch.nn.Linear(64, 64).cuda().half()
    mp = FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: kernels compiled, state made
        mp.backward(model(x).float().pow(2).mean())
        mp.step()
    torch.cuda.current_stream().wait_stream(side)
    mp.zero_grad()
    with (
        pytest.raises(RuntimeError, match="torch.float16 params was freed by zero_grad"),
        torch.cuda.graph(torch.cuda.CUDAGraph()),
    ):
        mp.step()
    mp.backward(model(x).float().pow(2).mean())
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        mp.step()
    held = [StorageWeakRef(p.grad.untyped_storage()) for p in model.parameters()]
    mp.zero_grad()
    gc.collect()
    assert not any(ref.expired() for ref in held)  # the graph reads these addresses
