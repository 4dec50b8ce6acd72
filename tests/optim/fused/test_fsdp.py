"""The fused optimizers over FSDP2 shards (``fully_shard``: DTensor params) in one process (a gloo world of one,
Triton's interpreter): 16-bit local shards written in place by the update kernel (``chunk.py``), the norm and skip
reduced over the mesh (``mesh.py``), DTensor grads taken into the flat grad buffer (``fused/grads.py``).

The oracle is the same fused optimizer over the same model unsharded: at world size 1 FSDP2's reduce-scatter of a
grad is the grad, and the update is elementwise, so masters, state and params agree bit for bit, fp32 or split
masters. The norm is summed in another order (fp64 partial sums over the mesh), so a clipped step agrees to
fp32's rounding of the coefficient only. Several ranks: ``tests/distributed/test_fsdp.py``'s fused cases."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import halfprec
from halfprec.optim import FusedAdagrad, FusedAdam, FusedAdamW, FusedLamb, FusedSGD
from halfprec.optim.exact import ExactMixedPrecisionOptimizer
from halfprec.optim.mesh import is_dtensor, local
from halfprec.optim.split import split_master

from ..helpers import mesh_of_one

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU, Triton's interpreter")

ALGORITHMS = [
    (FusedAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)),
    (FusedAdam, dict(lr=1e-2, weight_decay=0.05)),
    (FusedSGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (FusedAdagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
]
_IDS = [cls.__name__ for cls, _ in ALGORITHMS]


@pytest.fixture
def mesh(tmp_path):
    with mesh_of_one(tmp_path / "store") as one:
        yield one


def _model(mesh=None, dtype=torch.bfloat16) -> torch.nn.Module:
    """Odd widths (7, 9, 1 rows); per block, then the root, as torchtitan shards."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1)
    ).to(dtype)
    if mesh is not None:
        for block in (m[0], m[2], m[4]):
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m


def _loss(model, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(4, 5, generator=g).to(next(model.parameters()).dtype), torch.randn(4, 1, generator=g)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _train(mp, model, steps: int, micro: int = 1, inf_at: int | None = None) -> list:
    norms = []
    for step in range(steps):
        for k in range(micro):
            mp.backward(_loss(model, step, k))
        if step == inf_at:
            with torch.no_grad():
                local(next(model.parameters()).grad)[0, 0] = float("inf")
        mp.step()
        norms.append((mp.step_was_skipped, mp.grad_norm))
        mp.zero_grad()
    return norms


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def _assert_same(a, b, model_a, model_b) -> None:
    """Masters, every state tensor and the params of two optimizers, bit for bit."""
    for m, n in zip(a.master_params(), b.master_params(), strict=True):
        assert torch.equal(m, n)
    sa, sb = a.state_dict()["optimizer"]["state"], b.state_dict()["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        for key in sa[k]:
            assert torch.equal(_whole(sa[k][key]), _whole(sb[k][key])), (k, key)
    for p, q in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert torch.equal(_whole(p.detach()), _whole(q.detach()))


@pytest.mark.parametrize("masters", ["fp32", "split"])
@pytest.mark.parametrize(("cls", "hp"), ALGORITHMS, ids=_IDS)
def test_steps_over_shards_equal_the_same_optimizer_on_the_unsharded_model(mesh, cls, hp, masters):
    sharded, plain = _model(mesh), _model()
    a = cls(sharded.parameters(), **hp, masters=masters)
    b = cls(plain.parameters(), **hp, masters=masters)
    skipped = _train(a, sharded, 4, inf_at=2)
    assert skipped == _train(b, plain, 4, inf_at=2)
    assert [s for s, _ in skipped] == [False, False, True, False]
    _assert_same(a, b, sharded, plain)
    # the params are still FSDP2's DTensors, in its own storage, and the model computes with the new values
    assert all(is_dtensor(p) and p.dtype == torch.bfloat16 for p in sharded.parameters())
    assert torch.equal(_loss(sharded, 9), _loss(plain, 9))


def _held_bytes(opt) -> int:
    """What the optimizer's chunks hold: params, masters, grads and state buffers."""
    chunks = {id(chunk): chunk for chunk, _ in opt._where}.values()
    held = [t for c in chunks for t in (c.param, c.data, c.low, c.grad, *c.state.values()) if t is not None]
    return sum(t.numel() * t.element_size() for t in held)


IN_PLACE = [
    (FusedAdamW, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1), 8),
    (FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01), 4),
]


@pytest.mark.parametrize(
    ("dtype", "masters"),
    [(torch.bfloat16, "fp32"), (torch.bfloat16, "split"), (torch.float16, "fp32")],
    ids=["bf16-fp32", "bf16-split", "fp16-fp32"],
)
@pytest.mark.parametrize(("cls", "hp", "state_bytes"), IN_PLACE, ids=[c.__name__ for c, _, _ in IN_PLACE])
def test_the_update_writes_the_16_bit_shards_in_place(mesh, cls, hp, state_bytes, dtype, masters):
    """The kernel writes FSDP2's own storage (no flat 16-bit copy of the shards, no copy after the step), and the
    results are the unsharded run's, bit for bit: 2 bytes per param less than that run holds."""
    sharded, plain = _model(mesh, dtype), _model(dtype=dtype)
    ptrs = [local(p).data_ptr() for p in sharded.parameters()]
    a = cls(sharded.parameters(), **hp, masters=masters)
    b = cls(plain.parameters(), **hp, masters=masters)
    assert _train(a, sharded, 4, inf_at=2) == _train(b, plain, 4, inf_at=2)
    _assert_same(a, b, sharded, plain)
    assert [local(p).data_ptr() for p in sharded.parameters()] == ptrs
    assert all(chunk.param is None and chunk.in_place for chunk, _ in a._where)
    numel = a._where[0][0].numel  # padded: the same layout as the unsharded run's
    master_bytes = 2 if masters == "split" else 4
    assert _held_bytes(a) == (master_bytes + state_bytes) * numel  # grads freed by zero_grad
    assert _held_bytes(b) == _held_bytes(a) + 2 * numel  # the unsharded params' flat buffer


@pytest.mark.parametrize("masters", ["fp32", "split"])
def test_a_shard_given_new_storage_is_refused_until_a_load_takes_it(mesh, masters):
    """``model.to_empty()`` gives the shards new storage, which the kernel would not write: the step refuses;
    ``load_state_dict`` (like ``refresh_masters``) takes the shards where they are now and writes them, and
    training resumes as if nothing had happened."""
    sharded, again = _model(mesh), _model(mesh)
    a = FusedAdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1, masters=masters)
    b = FusedAdamW(again.parameters(), lr=1e-2, weight_decay=0.1, masters=masters)
    _train(a, sharded, 2)
    _train(b, again, 1)
    saved = b.state_dict()
    again.to_empty(device="cpu")
    b.backward(_loss(again, 1))
    with pytest.raises(
        RuntimeError,
        match=r"FSDP2 shard of the param of shape \(7, 5\) no longer lives where FusedAdamW writes it.*refresh_masters",
    ):
        b.step()
    b.zero_grad()
    b.load_state_dict(saved)
    b.backward(_loss(again, 1))
    b.step()
    b.zero_grad()
    _assert_same(a, b, sharded, again)


def test_a_shard_cast_to_another_dtype_is_refused_when_taken(mesh):
    """``refresh_masters`` takes moved shards only as the kernel writes them: a cast shard is refused, naming it."""
    sharded = _model(mesh)
    opt = FusedAdamW(sharded.parameters(), lr=1e-2)
    _train(opt, sharded, 1)
    sharded.float()
    with pytest.raises(
        RuntimeError, match=r"shard of the param of shape \(7, 5\) is now 35 torch.float32 elements"
    ):
        opt.refresh_masters()


@pytest.mark.parametrize("clip", [None, 0.05])
def test_fp32_sums_and_clipping_over_shards(mesh, clip):
    """Three micro-batches summed in fp32 (FSDP2 delivers each reduced shard to the hooks); with clipping the
    norms agree to fp32 rounding, and so do the masters."""
    sharded, plain = _model(mesh), _model()
    options = dict(grad_accum_dtype="fp32", max_grad_norm=clip)
    a = FusedAdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1, **options)
    b = FusedAdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, **options)
    na, nb = _train(a, sharded, 3, micro=3), _train(b, plain, 3, micro=3)
    if clip is None:
        assert na == nb
        _assert_same(a, b, sharded, plain)
        return
    for (sa, x), (sb, y) in zip(na, nb, strict=True):
        assert sa == sb and x == pytest.approx(y, rel=1e-6)
    for m, n in zip(a.master_params(), b.master_params(), strict=True):
        torch.testing.assert_close(m, n, rtol=1e-6, atol=1e-7)


def test_a_backward_without_gradient_sync_is_refused_with_fp32_sums(mesh):
    sharded = _model(mesh)
    mp = FusedAdamW(sharded.parameters(), lr=1e-2, grad_accum_dtype="fp32")
    sharded.set_requires_gradient_sync(False)
    mp.backward(_loss(sharded, 0, 0))
    sharded.set_requires_gradient_sync(True)
    mp.backward(_loss(sharded, 0, 1))
    with pytest.raises(
        RuntimeError, match="2 backward\\(\\) calls since the last step, and FSDP2 delivered.* of 1"
    ):
        mp.step()


def test_the_factory_picks_the_strategy_over_shards_as_for_unsharded_params(mesh, monkeypatch):
    """impl='auto' takes the fused strategy over shards wherever it can run (CUDA params: faked here by the
    policy's answer), else the exact one (CPU params without an explicit impl='triton'); impl='triton' (and
    masters='split') asks for the fused one (here under the interpreter, which an explicit impl='triton'
    accepts); masters='split' with impl='auto' is refused on this CPU machine as for an unsharded model."""
    from halfprec.optim import select

    auto = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_model(mesh).parameters()))
    assert isinstance(auto, ExactMixedPrecisionOptimizer)
    for masters in ("fp32", "split"):
        mp = halfprec.MixedPrecisionOptimizer(
            torch.optim.AdamW(_model(mesh).parameters()), impl="triton", masters=masters
        )
        assert isinstance(mp, FusedAdamW) and mp.masters == masters and mp.collective  # saved by every rank
    with pytest.raises(ValueError, match="the fused kernels need CUDA params"):
        halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_model(mesh).parameters()), masters="split")
    asked = []
    resolved = {"auto": "triton", "torch": "torch"}  # select_impl's answers where the fused kernels can run
    monkeypatch.setattr(select, "select_impl", lambda opt, impl, **kw: asked.append(impl) or resolved[impl])
    where_it_runs = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_model(mesh).parameters()))
    exact = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_model(mesh).parameters()), impl="torch")
    assert asked == ["auto", "torch"]
    assert isinstance(where_it_runs, FusedAdamW) and where_it_runs.collective
    assert isinstance(exact, ExactMixedPrecisionOptimizer)
    with pytest.raises(
        ValueError, match="FusedLamb's trust ratio needs each whole param's norm.*FSDP2 shards"
    ):
        FusedLamb(_model(mesh).parameters())
    with pytest.raises(ValueError, match="process_group=.*leave process_group=None"):
        FusedAdamW(_model(mesh).parameters(), grad_accum_dtype="fp32", process_group=dist.group.WORLD)


@pytest.mark.parametrize("masters", ["fp32", "split"])
def test_state_dicts_move_between_the_fused_and_exact_strategies_over_shards(mesh, masters):
    sharded = _model(mesh)
    a = FusedAdamW(sharded.parameters(), lr=1e-2, masters=masters)
    _train(a, sharded, 2)
    saved = a.state_dict()
    # the masters and elementwise state laid out like the shards (DTensors): torch.distributed.checkpoint saves them
    params = list(sharded.parameters())
    assert [e["shape"] for e in saved["params"]] == [list(p.shape) for p in params]
    laid_out = [saved["masters"][k] for k in saved["masters"]]
    laid_out += [v for entry in saved["optimizer"]["state"].values() for v in entry.values() if v.dim()]
    assert laid_out and all(isinstance(v, DTensor) and v.placements == params[0].placements for v in laid_out)
    fresh = _model(mesh)
    b = FusedAdamW(fresh.parameters(), lr=1e-2, masters=masters)
    b.load_state_dict(saved)
    _assert_same(a, b, sharded, fresh)
    exact_model = _model(mesh)
    exact = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(exact_model.parameters(), lr=1e-2))
    exact.load_state_dict(saved)
    for m, n in zip(exact.master_params(), a.master_params(), strict=True):
        assert torch.equal(m, n)
    assert exact.state_dict()["params"] == saved["params"]


def test_refresh_masters_reads_the_shards_after_fsdp2_gives_them_new_storage(mesh):
    sharded = _model(mesh)
    mp = FusedSGD(sharded.parameters(), lr=0.1, masters="split")
    sharded.to_empty(device="cpu")  # the same Parameters, new local storage
    with torch.no_grad():
        for p in sharded.parameters():
            p.to_local().fill_(0.25)
    mp.refresh_masters()
    assert all(torch.equal(m, torch.full_like(m, 0.25)) for m in mp.master_params())
    _train(mp, sharded, 1)
    for p, m in zip(sharded.parameters(), mp.master_params(), strict=True):
        assert not torch.equal(m, torch.full_like(m, 0.25))
        assert torch.equal(p.to_local(), split_master(m.reshape(-1))[0].view_as(m))  # the split's high half


def test_zero_grad_keeping_the_buffers_and_grads_set_by_hand_over_shards(mesh):
    """``zero_grad(set_to_none=False)`` keeps each ``.grad`` a DTensor over the flat buffer, which FSDP2 adds the
    next reduced shard into in place; a grad assigned by hand (a DTensor) is taken at the step; the same as on the
    unsharded model, bit for bit."""
    from halfprec.optim.mesh import as_dtensor

    sharded, plain = _model(mesh), _model()
    a = FusedAdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    b = FusedAdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for mp, model in ((a, sharded), (b, plain)):
            mp.zero_grad(set_to_none=False)
            mp.backward(_loss(model, step, 0))
            mp.backward(_loss(model, step, 1))  # added into the kept grads
        first = next(sharded.parameters())
        assert is_dtensor(first.grad)  # a view of the flat grad buffer, laid out as FSDP2's shard
        if step == 1:  # a grad set by hand on both
            p, q = list(sharded.parameters())[-1], list(plain.parameters())[-1]
            value = torch.full_like(q, 0.5)
            q.grad = value.clone()
            p.grad = as_dtensor(p, value.clone())
        a.step()
        b.step()
    _assert_same(a, b, sharded, plain)
    for g, h in zip(a.unscaled_grads(), b.unscaled_grads(), strict=True):
        assert torch.equal(g, h)  # the last step's grads, unscaled, as plain fp32 tensors


def test_fp32_shards_are_their_own_masters_through_loads(mesh):
    """fp32 shards (FSDP2's own recipe: fp32 params computing in 16 bits) are their own masters: what a load writes
    into them is what the next step starts from. A resume from (weights, state dict) equals training on."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in (model[0], model[2]):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return model, FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, param_dtype=torch.float32)

    (model, mp), (again, resumed) = build(), build()
    _train(mp, model, 2)
    weights = [p.to_local().clone() for p in model.parameters()]
    saved = mp.state_dict()
    _train(mp, model, 2)
    with torch.no_grad():  # a weights-only load into the fp32 shards, then the optimizer's state
        for p, w in zip(again.parameters(), weights, strict=True):
            p.to_local().copy_(w)
    resumed.load_state_dict(saved)
    assert all(torch.equal(p.to_local(), w) for p, w in zip(again.parameters(), weights, strict=True))
    assert all(torch.equal(m, w) for m, w in zip(resumed.master_params(), weights, strict=True))
    _train(resumed, again, 2)  # the same batches as the uninterrupted run's last two steps
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())


def test_a_stepped_torch_optimizers_dtensor_state_moves_onto_the_fused_buffers(mesh):
    """The factory hands a torch optimizer's state over to the fused one: over shards that state is DTensors, whose
    local rows are taken (as the exact strategy takes them); a state tensor of another size is refused before the
    load changes anything."""
    sharded = _model(mesh)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    _loss(sharded, 0).backward()
    opt.step()
    opt.zero_grad()
    expected = [local(opt.state[p]["exp_avg"]).float() for p in sharded.parameters()]
    mp = halfprec.MixedPrecisionOptimizer(opt, impl="triton")
    state = mp.state_dict()["optimizer"]["state"]
    assert all(torch.equal(local(state[i]["exp_avg"]), e) for i, e in enumerate(expected))
    bad = mp.state_dict()
    bad["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    bad["optimizer"]["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=r"exp_avg of param 0 has 3 elements and the param 35"):
        mp.load_state_dict(bad)
    assert mp.param_groups[0]["lr"] == 1e-2  # a refused load changes nothing
    after = mp.state_dict()["optimizer"]["state"]
    assert all(torch.equal(local(after[i]["exp_avg"]), e) for i, e in enumerate(expected))


def test_a_captured_step_over_shards_is_refused_first(mesh, monkeypatch):
    """Before any of the capture's own preconditions: a refused capture leaves the optimizer as it was."""
    import halfprec.optim.fused.base as fused_base

    sharded, plain = _model(mesh), _model()
    a, b = FusedAdamW(sharded.parameters(), lr=1e-2), FusedAdamW(plain.parameters(), lr=1e-2)
    a.backward(_loss(sharded, 0))
    monkeypatch.setattr(fused_base, "stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="over FSDP2 shards cannot be captured in a CUDA graph"):
        a.step()
    monkeypatch.undo()
    a.step()
    a.zero_grad()
    _train(b, plain, 1)  # the same first batch and step on the unsharded model
    _assert_same(a, b, sharded, plain)
