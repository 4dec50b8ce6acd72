"""The fused optimizers' flat grad buffers (optim/fused/grads.py) live from a step's first grad to its zero_grad.

Oracle: the same loop on a twin whose buffers stay (``model.zero_grad()`` where the subject calls
``zero_grad(set_to_none=True)``: it clears ``.grad`` as that call did before the buffers were freed) must give
the same masters, params and state bit for bit. Memory is counted as ``torch.cuda.memory_allocated`` counts it:
the bytes of the storages that live tensors hold (on CPU too), and whether a storage is still alive at all.
"""

from __future__ import annotations

import copy
import gc
from collections import Counter

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdamW, FusedLamb, FusedSGD
from halfprec.optim.chunk import chunk_params
from halfprec.optim.fused.grads import GradViews

from ..helpers import DEVICE, AtenOps, warm_up_on_side_stream

FP32 = "fp32"  # grad_accum_dtype: fp32 sums
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


def grads_of_step(model, opt, step: int, backwards: int, by_hand, overflow: bool) -> None:
    """A step's grads as ``STEPS`` gives them: its backwards (an inf loss in the second one on an overflow), then the
    grads assigned by hand."""
    for j in range(backwards):
        bad = overflow and j == 1
        opt.backward(model(batch(step, j)).float().pow(2).mean() * (float("inf") if bad else 1.0))
    set_by_hand(model, by_hand, step, opt.loss_scale)


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cls", "accum"),
    [
        (FusedAdamW, "param"),
        (FusedAdamW, FP32),
        (FusedSGD, "param"),
        (FusedLamb, FP32),
        (FusedAdagrad, "param"),
    ],
)
@pytest.mark.parametrize("batch_bytes", [None, 1], ids=["batched", "a-copy-per-grad"])
def test_freed_buffers_give_the_kept_buffers_results_bit_for_bit(cls, accum, batch_bytes, monkeypatch):
    if batch_bytes is not None:  # the held-back grads flushed at every hook (as when they reach the bound)
        monkeypatch.setattr("halfprec.optim.fused.grads._BATCH_BYTES", batch_bytes)
    (model, mp), (twin, ref) = build(cls, accum)
    for step, (backwards, by_hand, overflow, steps, then) in enumerate(STEPS):
        for m, opt in ((model, mp), (twin, ref)):
            grads_of_step(m, opt, step, backwards, by_hand, overflow)
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


def test_a_hook_after_the_optimizers_reads_and_edits_the_fresh_grad():
    # post-accumulate-grad hooks registered after the optimizer run after its own, before the batched copy: they
    # read the backward's grad, an in-place edit reaches the step, and a replaced .grad is the one it adopts
    (model, mp), (twin, ref) = build(FusedAdamW, "param")
    seen = []

    def halve(p):
        seen.append(p.grad.clone())
        p.grad.mul_(0.5)

    model.a.weight.register_post_accumulate_grad_hook(halve)
    model.b.bias.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", p.grad * 2))
    mp.backward(model(batch(0, 0)).float().pow(2).mean())
    ref.backward(twin(batch(0, 0)).float().pow(2).mean())
    assert same_bits(seen[0], twin.a.weight.grad)
    twin.a.weight.grad.mul_(0.5)
    twin.b.bias.grad = twin.b.bias.grad * 2
    mp.step()
    ref.step()
    assert_same_bits(mp, ref, model, twin)


def test_a_held_back_grad_counts_its_whole_storage_against_the_bound(monkeypatch):
    # autograd may keep a slice of a larger tensor as .grad (here: trainable rows joined to a frozen table); the
    # bound on what held-back grads keep alive counts the storage, so that grad is copied at once and freed
    monkeypatch.setattr("halfprec.optim.fused.grads._BATCH_BYTES", 2**20)
    torch.manual_seed(0)
    rows = torch.nn.Parameter(torch.randn(16, 64).to(torch.bfloat16))
    frozen = torch.randn(20_000, 64).to(torch.bfloat16)  # the joined table's grad: 2.6 MB, rows' slice 2 KB
    pre = torch.nn.Linear(64, 64).to(torch.bfloat16)
    fresh = {}  # registered before the optimizer's hook: sees the fresh grad
    rows.register_post_accumulate_grad_hook(
        lambda p: fresh.update(s=StorageWeakRef(p.grad.untyped_storage()))
    )
    mp = FusedAdamW([rows, *pre.parameters()], lr=1e-3)  # kept: its hooks hold it weakly
    alive = []
    pre.weight.register_post_accumulate_grad_hook(lambda p: alive.append(not fresh["s"].expired()))
    h = pre(torch.randn(64, 64).to(torch.bfloat16))
    ids = torch.randint(0, 20_016, (64,), generator=torch.Generator().manual_seed(1))
    emb = torch.nn.functional.embedding(ids, torch.cat([frozen, rows]))  # made last, its grads come first
    (emb + h).float().pow(2).mean().backward()
    assert alive == [False]  # freed before the backward went on to pre's grads
    mp.step()
    assert float(mp.state_dict()["optimizer"]["state"][0]["step"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("accum", ["param", FP32])
def test_zero_grad_frees_the_buffers_and_the_next_grad_makes_them(accum):
    (model, mp), _ = build(FusedAdamW, accum)
    mp.backward(model(batch(0, 0)).float().pow(2).mean())
    buffers = storages(grads_held(model, mp))  # (with fp32 accumulation the masters' .grad until the step)
    mp.step()
    # a 16-bit chunk (9*41, 41, 3*5 and 5 params, each padded to 16) and an fp32 one (41*7 and 7): 2 or 4 B/param
    assert sorted(buffers.values()) == sorted(
        [(384 + 48 + 16 + 16) * (4 if accum == FP32 else 2), (288 + 16) * 4]
    )
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


def _three_params():
    params = [torch.nn.Parameter(torch.randn(n).to(DEVICE, torch.float16)) for n in (9, 41, 5)]
    [(chunk, idx)] = chunk_params(params, [p.detach().float() for p in params], flat_params=True)
    return params, chunk, GradViews(params, [(chunk, k) for k in idx], torch.device(DEVICE))


def _loss(params) -> torch.Tensor:
    return params[0].float().sum() + params[1].float().pow(2).sum()  # the third param gets no grad


def test_a_backward_writes_the_device_marks_once_at_its_end():
    # a write per param was a launch per param on CUDA; the finalize program reads the device's marks
    params, chunk, grads = _three_params()
    for writes_expected in (1, 0):  # the second backward changes no mark: nothing to write
        with AtenOps(grads.flags) as writes:
            _loss(params).backward()
        assert writes.count == writes_expected
        assert grads.flags.tolist() == [1, 1, 0]
    grads.flags.zero_()  # what the finalize program does
    grads.consumed()
    with AtenOps(grads.flags) as writes:
        params[2].float().sum().backward()
    assert writes.count == 1 and grads.flags.tolist() == [0, 0, 1]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_backward_adds_one_batched_grad_copy_and_one_marks_write(set_to_none):
    # what the fused optimizer adds to a backward, against the same backward without it: on CUDA each op is a
    # launch, and at ~150 params a step is paced by the host (benchmarks/RESULTS.md)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 41), torch.nn.Tanh(), torch.nn.Linear(41, 7)).to(
        torch.bfloat16
    )
    plain = copy.deepcopy(model)
    mp = FusedAdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 9).to(torch.bfloat16)

    def added() -> Counter[str]:
        counts = []
        for m in (model, plain):
            loss = m(x).float().pow(2).mean()  # bf16: the loss scale is 1, backward needs no scaled loss
            with AtenOps() as ops:
                loss.backward()
            counts.append(ops.names)
        assert not counts[1] - counts[0]
        return counts[0] - counts[1]

    for step in range(3):
        first, again = added(), added()  # the second backward of a step adds into the marked grads
        if set_to_none or step == 0:
            # the freed flat buffer made (zeroed), the 4 fresh grads copied in by one multi-tensor copy at the end
            # of the backward (one per chunk; a copy per param before), the marks written once
            assert first == Counter(zeros=1, _foreach_copy_=1, copy_=1)
        else:  # the kept buffer is .grad: autograd adds into it; the step cleared the marks
            assert first == Counter(copy_=1)
        assert again == Counter()
        mp.step()
        mp.zero_grad(set_to_none=set_to_none)
        plain.zero_grad(set_to_none=set_to_none)


def test_a_step_after_a_raised_backward_writes_its_marks_and_a_captured_one_refuses():
    params, chunk, grads = _three_params()
    failing = _Raise.apply(params[1].float()).sum()
    loss = failing + params[0].float().sum()  # made last, run first
    with pytest.raises(RuntimeError, match="backward failed midway"):
        loss.backward()  # params[0]'s hook ran; the end-of-backward write did not
    assert grads.flags.tolist() == [0, 0, 0]
    with pytest.raises(RuntimeError, match="the last backward raised before its end"):
        grads.ready([chunk], capturing=True)
    grads.ready([chunk], capturing=False)  # an eager step writes them
    assert grads.flags.tolist() == [1, 0, 0]
    _loss(params).backward()  # the next backward queues its own write
    assert grads.flags.tolist() == [1, 1, 0]


class _Raise(torch.autograd.Function):
    """Identity forward; its backward raises, after the layers above it got their grads (a backward that fails
    midway, e.g. out of memory)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed midway")


def _raised_backward(model, mp) -> None:
    loss = model.b(_Raise.apply(model.a(batch(9, 0).half()).float())).pow(2).mean()
    with pytest.raises(RuntimeError, match="backward failed midway"):
        mp.backward(loss)


def _backward(model, mp) -> None:
    mp.backward(model(batch(9, 1)).float().pow(2).mean())


def _set_to_none(model, name: str) -> None:
    model.get_parameter(name).grad = None


# what runs before a step, and the params it updates (of a.weight, a.bias, b.weight, b.bias, unused.weight,
# unused.bias): the marks the hooks, step() and zero_grad() keep
MARKS = {
    "three backwards": ([_backward] * 3, {0, 1, 2, 3}),
    ".grad = None after the backward": ([_backward, lambda m, o: _set_to_none(m, "b.bias")], {0, 1, 2}),
    "a grad assigned by hand": (
        [_backward, lambda m, o: set_by_hand(m, ["unused.weight"], 0, 1.0)],
        {0, 1, 2, 3, 4},
    ),
    "zero_grad()": ([_backward, lambda m, o: o.zero_grad()], set()),
    # zeroed grads are grads: torch steps those params (AdamW's count and decay move them)
    "zero_grad(set_to_none=False)": ([_backward, lambda m, o: o.zero_grad(set_to_none=False)], {0, 1, 2, 3}),
    "a backward after zero_grad(set_to_none=False)": (
        [_backward, lambda m, o: o.zero_grad(set_to_none=False), _backward],
        {0, 1, 2, 3},
    ),
    "a raised backward": ([_raised_backward], {2, 3}),  # b's hooks ran, a's did not
    "a backward after a raised one": ([_raised_backward, _backward], {0, 1, 2, 3}),
}


@pytest.mark.parametrize("accum", ["param", FP32])
@pytest.mark.parametrize("case", MARKS)
def test_a_step_updates_the_params_marked_since_the_last_one(case, accum):
    (model, mp), _ = build(FusedAdamW, accum)

    def steps() -> list[float]:
        state = mp.state_dict()["optimizer"]["state"]
        return [float(state.get(k, {}).get("step", 0.0)) for k in range(6)]

    actions, updated = MARKS[case]
    for action in actions:
        action(model, mp)
    mp.step()
    assert steps() == [1.0 if k in updated else 0.0 for k in range(6)]
    mp.step()  # the step consumed the marks: the grads it keeps are not new
    assert steps() == [1.0 if k in updated else 0.0 for k in range(6)]


def _grads_at_step(model, mp) -> list[torch.Tensor]:
    """Per param, in fp64, the grad the step reads: its ``.grad``, which with fp32 sums a step adds to the sum the
    hooks moved into its master's ``.grad`` (fp32 params are their own masters)."""
    grads = []
    for p, m in zip(model.parameters(), mp.master_params(), strict=True):
        held = [g.double() for g in {id(t): t.grad for t in (p, m) if t.grad is not None}.values()]
        if held:
            grads.append(sum(held))
    return grads


def _edit_in_place(model, name: str) -> None:
    model.get_parameter(name).grad.mul_(3.0)


# edits after a backward that ran to its end: step() launches its norm pass once, after its host checks took them
EDITS = {
    "none": lambda m: None,
    "edited in place": lambda m: _edit_in_place(m, "b.weight"),  # fp32: its own .grad in both modes
    ".grad = None": lambda m: _set_to_none(m, "b.bias"),
    "a grad assigned by hand": lambda m: set_by_hand(m, ["a.bias"], 0, 50.0),
    "a grad assigned where none came": lambda m: set_by_hand(m, ["unused.weight"], 0, 50.0),
}


@pytest.mark.parametrize("accum", ["param", FP32])
@pytest.mark.parametrize("edit", EDITS)
def test_the_norm_pass_reads_the_grads_the_host_checks_leave(edit, accum, monkeypatch):
    from halfprec.kernels import norm

    (model, mp), _ = build(FusedAdamW, accum)
    launches = []
    sumsq = norm.sumsq
    monkeypatch.setattr(norm, "sumsq", lambda *a, **k: launches.append(1) or sumsq(*a, **k))
    _backward(model, mp)
    EDITS[edit](model)
    want = (
        torch.linalg.vector_norm(torch.stack([g.norm() for g in _grads_at_step(model, mp)])) / mp.loss_scale
    )
    mp.step()
    # a pass is one kernel per chunk (Net has an fp16 and an fp32 one). The first runs before the host's checks;
    # when they change a grad or a mark it runs again with them (b.bias is fp32: its .grad set to None unmarks it)
    changed = edit in (".grad = None", "a grad assigned by hand", "a grad assigned where none came")
    assert len(launches) == 2 * (1 + changed)
    assert mp.grad_norm == pytest.approx(float(want), rel=1e-5)


def _norm_and_checks(monkeypatch) -> list[str]:
    """The order of the step's norm kernels ("norm", one per chunk) and host checks ("checks"), as they run."""
    from halfprec.kernels import norm

    order = []
    sumsq, adopt = norm.sumsq, GradViews.adopt
    monkeypatch.setattr(norm, "sumsq", lambda *a, **k: order.append("norm") or sumsq(*a, **k))
    monkeypatch.setattr(GradViews, "adopt", lambda self, owner: order.append("checks") or adopt(self, owner))
    return order


@pytest.mark.parametrize("edit", ["none", "a grad assigned by hand"])
def test_the_norm_pass_runs_before_the_checks_and_again_after_a_change(edit, monkeypatch):
    (model, mp), _ = build(FusedAdamW, "param")
    order = _norm_and_checks(monkeypatch)
    _backward(model, mp)
    EDITS[edit](model)
    mp.step()
    again = ["norm", "norm"] if edit != "none" else []
    assert order == ["norm", "norm", "checks", *again]  # a kernel per chunk: Net has an fp16 and an fp32 one
    # a backward that did not reach the step's buffers (zero_grad(set_to_none=True), grads by hand): checks first
    order.clear()
    mp.zero_grad()
    set_by_hand(model, ["a.bias"], 0, 1.0)
    mp.step()
    assert order == ["checks", "norm", "norm"]


@pytest.mark.parametrize(("cls", "accum"), [(FusedAdamW, "param"), (FusedAdamW, FP32), (FusedLamb, "param")])
def test_the_norm_pass_before_the_checks_gives_the_single_replays_results_bit_for_bit(cls, accum):
    (model, mp), (twin, ref) = build(cls, accum)
    ref._grads.on_device = lambda chunks: False  # the twin always runs its norm pass after the checks
    mp.max_grad_norm = ref.max_grad_norm = 0.05  # clipped at every step: the norm reaches the update
    edits = [*EDITS.values(), EDITS["none"], EDITS["none"]]
    for step, (backwards, by_hand, overflow, _, then) in enumerate(STEPS):
        for m, opt in ((model, mp), (twin, ref)):
            grads_of_step(m, opt, step, backwards, by_hand, overflow)
            edits[step % len(edits)](m)
            opt.step()
            opt.zero_grad(set_to_none=then == "none")
        assert mp.step_was_skipped is ref.step_was_skipped
        assert repr(mp.grad_norm) == repr(ref.grad_norm)  # the same float (nan at the overflow)
        assert_same_bits(mp, ref, model, twin)


def test_after_checks_that_changed_a_grad_the_norm_pass_waits_for_the_checks(monkeypatch):
    (model, mp), _ = build(FusedAdamW, "param")
    order = _norm_and_checks(monkeypatch)
    runs = []
    for edit in [
        "a grad assigned by hand",
        "a grad assigned by hand",
        "none",
        "none",
    ]:  # as DDP's bucket views
        order.clear()
        _backward(model, mp)
        EDITS[edit](model)
        mp.step()
        runs.append(order.index("checks"))  # norm kernels (one per chunk) before the checks
    assert runs == [2, 0, 0, 2]  # wasted once, then after the checks until they change nothing


def test_the_norm_pass_before_the_checks_keeps_its_own_launch_keys(monkeypatch):
    from halfprec.kernels import launch as launch_mod

    class Graph:  # a capture keeps the launches; a replay runs them again
        def __init__(self, run):
            self.replay = run

    monkeypatch.setattr(launch_mod, "_replayable", lambda device: True)
    monkeypatch.setattr(launch_mod, "_capture", Graph)
    monkeypatch.setattr(launch_mod, "_sites", {})
    (model, mp), _ = build(FusedAdamW, "param")
    for _ in range(3):
        _backward(model, mp)
        mp.step()
        mp.zero_grad(set_to_none=False)  # the buffers stay: the same keys each step
    sites = {site: len(keys) for site, keys in launch_mod._sites.items()}
    assert sites == {"fused norm pass": 1, "together": 1}  # one key each: the early pass and the rest


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_a_create_graph_backward_leaves_the_grad_buffers_out_of_autograd():
    # the hooks run with grad mode on in a create_graph=True backward: their copies must not be recorded (the
    # flat buffers would require grad and hold the graph)
    (model, mp), (twin, ref) = build(FusedAdamW, "param")
    for _ in range(2):
        mp.backward(model(batch(0, 0)).float().pow(2).mean(), create_graph=True)
        ref.backward(twin(batch(0, 0)).float().pow(2).mean())
    assert not any(g.requires_grad for g in grads_held(model, mp))
    mp.step()
    ref.step()
    assert_same_bits(mp, ref, model, twin)


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["param", FP32])
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
    assert buffer == 4 * (1024 * 1024 + 1024) * (4 if accum == FP32 else 2)
    assert kept - freed == buffer


@pytest.mark.gpu
def test_a_captured_step_needs_the_buffers_and_then_keeps_them():
    model, mp, x = _warmed_up(backward_after=False)
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


def _warmed_up(backward_after: bool = True):
    """A model and its optimizer warmed up on a side stream (as torch.cuda.graphs asks): a backward and a step
    (kernels compiled, state made), then a backward whose grads and marks stay (``backward_after``)."""
    model = torch.nn.Linear(64, 64).cuda().half()
    mp = FusedAdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"))
    x = torch.randn(8, 64, device="cuda", dtype=torch.float16)

    def warm_up():
        mp.backward(model(x).float().pow(2).mean())
        mp.step()
        if backward_after:
            mp.backward(model(x).float().pow(2).mean())

    warm_up_on_side_stream(warm_up)
    return model, mp, x


@pytest.mark.gpu
@pytest.mark.parametrize("captured", ["backward", "zero_grad(set_to_none=False)"])
def test_buffers_a_captured_backward_or_zero_grad_writes_stay(captured):
    # the grad buffers exist before the capture, so the captured code makes none: it still writes them
    model, mp, x = _warmed_up()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if captured == "backward":
            mp.backward(model(x).float().pow(2).mean())
        else:
            mp.zero_grad(set_to_none=False)
    held = [StorageWeakRef(p.grad.untyped_storage()) for p in model.parameters()]
    mp.zero_grad()
    gc.collect()
    assert not any(ref.expired() for ref in held)  # the graph writes these addresses


@pytest.mark.gpu
def test_a_captured_backward_marks_its_params_at_every_replay():
    # the warm-up's last backward leaves the params marked on the host when the capture starts: the captured
    # hooks must write the marks all the same, since each replay's step clears them
    model, mp, x = _warmed_up()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mp.backward(model(x).float().pow(2).mean())
        mp.step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    state = mp.state_dict()["optimizer"]["state"]
    assert [float(state[k]["step"]) for k in (0, 1)] == [4.0, 4.0]  # the warm-up's step and 3 replays
