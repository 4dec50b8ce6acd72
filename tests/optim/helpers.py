"""Run the fused path and the exact torch path side by side on the same grads and compare everything."""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import halfprec

from ..tolerances import tol

# the interpreter on CPU; the GPU when there is one (the interpreter is off there)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_params(sizes, dtype, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(n if isinstance(n, tuple) else (n,), generator=g) for n in sizes]
    a = [torch.nn.Parameter(t.to(device=device, dtype=dtype)) for t in init]
    b = [torch.nn.Parameter(t.to(device=device, dtype=dtype)) for t in init]
    return a, b


def pair(
    torch_cls, fused_cls, sizes, dtype, hp, *, device=DEVICE, max_grad_norm=None, scaler=None, groups=None
):
    """(reference MixedPrecisionOptimizer, fused optimizer, ref params, fused params)."""
    a, b = make_params(sizes, dtype, device)
    if groups is None:
        ga, gb = a, b
    else:  # groups: list of (index list, group kwargs)
        ga = [{"params": [a[i] for i in idx], **kw} for idx, kw in groups]
        gb = [{"params": [b[i] for i in idx], **kw} for idx, kw in groups]
    ref = halfprec.MixedPrecisionOptimizer(
        torch_cls(ga, **hp),
        loss_scaler=scaler() if scaler else None,
        max_grad_norm=max_grad_norm,
        impl="torch",
    )
    fused = fused_cls(gb, **hp, loss_scaler=scaler() if scaler else None, max_grad_norm=max_grad_norm)
    return ref, fused, a, b


def random_grads(params, seed, scale=1.0, none=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, p in enumerate(params):
        if i in none:
            out.append(None)
        else:
            out.append((torch.randn(p.shape, generator=g) * scale).to(device=p.device, dtype=p.dtype))
    return out


def set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.clone()


def run_both(ref, fused, a, b, steps, *, scale=1.0, none_at=None, seed=0):
    """``steps`` steps of both paths on the same grads (step ``s``: seed ``seed + s``; ``none_at(s)``: the indices
    of the params that get no grad)."""
    for s in range(steps):
        grads = random_grads(a, seed + s, scale=scale, none=none_at(s) if none_at else ())
        set_grads(a, grads)
        set_grads(b, grads)
        ref.step()
        fused.step()
        ref.zero_grad()
        fused.zero_grad()


def assert_same_state(ref, fused, dtype):
    """Compare masters, every state tensor and counters of the two paths' (same-format) state dicts."""
    sr, sf = ref.state_dict(), fused.state_dict()
    assert sr["params"] == sf["params"]
    assert sorted(sr["masters"]) == sorted(sf["masters"])
    for k in sr["masters"]:
        torch.testing.assert_close(
            sf["masters"][k].cpu(), sr["masters"][k].cpu(), **tol("fused_master", dtype)
        )
    str_, stf = sr["optimizer"]["state"], sf["optimizer"]["state"]
    assert sorted(str_) == sorted(stf), (sorted(str_), sorted(stf))
    for k in str_:
        assert sorted(str_[k]) == sorted(stf[k]), (k, sorted(str_[k]), sorted(stf[k]))
        for name, v in str_[k].items():
            w = stf[k][name]
            if name == "step":
                assert float(w) == float(v), (k, float(w), float(v))
            else:
                torch.testing.assert_close(w.cpu(), v.cpu(), **tol("fused_state", dtype))
    # fp32 params (own masters): compare the params themselves
    for p, q in zip(ref.model_params(), fused.model_params(), strict=True):
        if p.dtype == torch.float32:
            torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), **tol("fused_master", dtype))
    assert sr["skipped_steps"] == sf["skipped_steps"]
    assert sr["scaler"] == sf["scaler"]


def assert_params_are_rounded_masters(fused):
    trained = [p for p in fused.model_params() if p.requires_grad]
    for p, m in zip(trained, fused.master_params(), strict=True):
        if p.dtype != torch.float32:
            want = m.to(p.dtype)
            assert torch.equal(p.detach().view(torch.int16), want.view(torch.int16))


def small_mlp(dtype=torch.float32) -> torch.nn.Sequential:
    """64 -> 257 -> 3 on CUDA, seeded: the GPU tests' model for engine steps and graph captures."""
    torch.manual_seed(0)
    return (
        torch.nn.Sequential(torch.nn.Linear(64, 257), torch.nn.Tanh(), torch.nn.Linear(257, 3))
        .cuda()
        .to(dtype)
    )


def warm_up_on_side_stream(fn) -> None:
    """Run ``fn`` (the steps before a capture; they compile the kernels) on a side stream, as torch.cuda.graphs
    asks, and make the current stream wait for it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)


class AtenOps(TorchDispatchMode):
    """Counts the torch ops run under it that are not views or profiler markers (on CUDA, each is a launch: the
    host's cost), by name; with ``target``, only the in-place ones on its storage. Triton launches do not go
    through the dispatcher and are not counted."""

    def __init__(self, target: torch.Tensor | None = None) -> None:
        super().__init__()
        self.ptr = None if target is None else target.untyped_storage().data_ptr()
        self.names: Counter[str] = Counter()

    @property
    def count(self) -> int:
        return self.names.total()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, first = func.overloadpacket.__name__, args[0] if args else None
        if self.ptr is None:
            counted = not func.is_view and func.namespace != "profiler"
        else:  # fill_, copy_, zero_ on the target
            on_target = isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() == self.ptr
            counted = name.endswith("_") and on_target
        if counted:
            self.names[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def world_of_one(store):
    """This process as rank 0 of a gloo world of size 1 (``store``: a file for the rendezvous): the sharded
    strategy's whole protocol on one CPU process."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def mesh_of_one(store):
    """A one-rank CPU device mesh over ``world_of_one(store)``: FSDP2's ``fully_shard`` in one process."""
    from torch.distributed.device_mesh import init_device_mesh

    with world_of_one(store):
        yield init_device_mesh("cpu", (1,))
