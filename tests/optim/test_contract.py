"""The contract every strategy keeps, one test per member, run on every strategy: exact, fused (the Triton
interpreter on CPU, fp16: the interpreter's bf16 arithmetic is wrong), sharded at stages 1 and 2 (a one-rank
gloo world), and exact and fused over FSDP2's shards (``fully_shard`` on a one-rank mesh: DTensor params, each
its own whole shard; on CPU only, as gloo is). Where strategies differ by design (the layout fixed at
construction, a rank-local state dict), the table ``DIFFERS`` says how, and the test checks that difference."""

from __future__ import annotations

import pytest
import torch

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer
from halfprec.optim import ExactMixedPrecisionOptimizer, FusedAdamW
from halfprec.optim.mesh import local

from .helpers import DEVICE, world_of_one

STRATEGIES = {
    "exact": (dict(impl="torch"), ExactMixedPrecisionOptimizer),
    "fused": (dict(impl="triton"), FusedAdamW),
    "stage1": (dict(impl="torch", stage=1), ShardedMixedPrecisionOptimizer),
    "stage2": (dict(impl="torch", stage=2), ShardedMixedPrecisionOptimizer),
    "fsdp_exact": (dict(impl="torch"), ExactMixedPrecisionOptimizer),
    "fsdp_fused": (dict(impl="triton"), FusedAdamW),
}
ON_MESH = {"fsdp_exact", "fsdp_fused"}  # the model sharded by fully_shard on a one-rank mesh
# what differs by design: adding groups after construction, and which state dicts load (model-space or rank-local)
DIFFERS = {
    "add_param_group": {
        "exact": None, "fused": RuntimeError, "stage1": RuntimeError, "stage2": RuntimeError,
        "fsdp_exact": None, "fsdp_fused": RuntimeError,
    },
    "torch_state_dict": {
        "exact": None, "fused": None, "stage1": ValueError, "stage2": ValueError, "fsdp_exact": None,
        "fsdp_fused": None,
    },
    # stage 1's model grads are views of its flat 16-bit buffer: zero_grad() zeroes them instead of dropping them
    # (no allocation per step); a param stepped or not is still decided by the grads of the last backward
    "grads_after_zero_grad": {
        "exact": None, "fused": None, "stage1": 0.0, "stage2": None, "fsdp_exact": None, "fsdp_fused": None,
    },
    # stage 2 reduces into a shard that the step consumed: a backward after a step without the optimizer's
    # zero_grad() (model.zero_grad() cannot reach the shard) is refused
    "backward_after_model_zero_grad": {
        "exact": None, "fused": None, "stage1": None, "stage2": RuntimeError, "fsdp_exact": None,
        "fsdp_fused": None,
    },
}  # fmt: skip
GLOO = pytest.mark.skipif(torch.cuda.is_available(), reason="FSDP2 on a gloo mesh: CPU params")


@pytest.fixture(params=[pytest.param(n, marks=GLOO) if n in ON_MESH else n for n in STRATEGIES])
def strategy(request, tmp_path):
    if request.param.startswith("stage") or request.param in ON_MESH:
        with world_of_one(tmp_path / "store"):
            yield request.param
    else:
        yield request.param


def _shard(strategy, *modules: torch.nn.Module) -> None:
    """For the FSDP2 strategies, ``fully_shard`` each of ``modules`` in order (blocks, then their root) on a
    one-rank mesh of the world the fixture started."""
    if strategy in ON_MESH:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        mesh = init_device_mesh("cpu", (1,))
        for module in modules:
            fully_shard(module, mesh=mesh)


def _model(strategy=None, seed=0):
    """fp16 5 -> 7 -> 3; for the FSDP2 strategies sharded per block, then the root (every param a DTensor)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = model.to(device=DEVICE, dtype=torch.float16)
    _shard(strategy, model[0], model[2], model)
    return model


def _build(strategy, model, **extra):
    options, cls = STRATEGIES[strategy]
    if "stage" in options:
        extra["named_parameters"] = model
    scaler = halfprec.DynamicLossScaler(
        init_scale=256.0, hysteresis=1
    )  # fp16 grads of a tiny model: no overflow
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), loss_scaler=scaler, **options, **extra
    )
    assert type(mp) is cls and isinstance(mp, halfprec.MixedPrecisionOptimizer)
    return mp


def _train(model, mp, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=g).to(device=DEVICE, dtype=torch.float16)
        mp.backward(model(x).float().pow(2).mean())
        mp.step()
        mp.zero_grad()


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_construction_is_inert_and_state_is_lazy(strategy):
    model = _model(strategy)
    before = _weights(model)
    mp = _build(strategy, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(mp.state) == 0 and mp.state_dict()["optimizer"]["state"] == {}
    _train(model, mp, 1)
    assert len(mp.state_dict()["optimizer"]["state"]) > 0 and mp.skipped_steps == 0


def test_model_params_and_master_params(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    assert mp.model_params() == list(model.parameters())
    masters = mp.master_params()
    assert all(m.dtype == torch.float32 for m in masters)
    flat = torch.cat([m.detach().reshape(-1) for m in masters]).sort().values
    want = torch.cat([local(p).detach().float().reshape(-1) for p in model.parameters()]).sort().values
    assert torch.equal(flat, want)  # every element's master, once (pieces, whole tensors or the local shards)


def test_zero_grad_both_ways(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    x = torch.randn(2, 5).to(device=DEVICE, dtype=torch.float16)
    mp.backward(model(x).float().sum())
    mp.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    mp.backward(model(x).float().sum())
    mp.zero_grad()
    if DIFFERS["grads_after_zero_grad"][strategy] is None:
        assert all(p.grad is None for p in model.parameters())
    else:
        assert all(not p.grad.any() for p in model.parameters())


def test_refresh_masters_takes_the_models_weights(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    other = _model(strategy, seed=3)
    with torch.no_grad():
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.copy_(q)
    mp.refresh_masters()
    flat = torch.cat([m.detach().reshape(-1) for m in mp.master_params()]).sort().values
    want = torch.cat([local(p).detach().float().reshape(-1) for p in other.parameters()]).sort().values
    assert torch.equal(flat, want)


def test_a_skipped_step_changes_nothing_but_the_scaler_and_the_count(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    _train(model, mp, 1)
    # cloned: a state dict's tensors are the live state on some strategies
    state = {
        k: {n: torch.as_tensor(v).clone() for n, v in e.items()}
        for k, e in mp.state_dict()["optimizer"]["state"].items()
    }
    before, scale = _weights(model), mp.loss_scale
    x = torch.randn(2, 5).to(device=DEVICE, dtype=torch.float16)
    mp.backward(model(x).float().sum() * float("inf"))
    mp.step()
    assert mp.step_was_skipped and mp.skipped_steps == 1 and mp.loss_scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    after = mp.state_dict()["optimizer"]["state"]
    assert after.keys() == state.keys()
    for k in state:
        for name, value in state[k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[k][name])), (k, name)


def test_unscale_is_honoured_or_refused_by_its_capability_flag(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    x = torch.randn(2, 5).to(device=DEVICE, dtype=torch.float16)
    mp.backward(model(x).float().sum())
    if not mp.unscales_in_place:
        with pytest.raises(RuntimeError, match="never unscaled in place"):
            mp.unscale_()
        return
    mp.unscale_()
    mp.unscale_()  # idempotent
    grads = [m.grad for m in mp.master_params() if m.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    held = [local(p.grad) for p in model.parameters() if p.grad is not None and p.grad.any()]
    if held:  # stage 2 reduced and released the model's grads during backward
        total = sum(g.double().sum() for g in grads)
        want = sum(g.double().sum() for g in held) / mp.loss_scale
        assert torch.allclose(total, want.to(total.device), rtol=1e-3)
    mp.step()
    assert not mp.step_was_skipped


def test_state_dict_round_trip_resumes_bit_for_bit(strategy):
    model, resumed = _model(strategy), _model(strategy)
    mp = _build(strategy, model)
    _train(model, mp, 2)
    saved = mp.state_dict()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    mp2 = _build(strategy, resumed)
    mp2.load_state_dict(saved)
    assert mp2.skipped_steps == mp.skipped_steps and mp2.loss_scale == mp.loss_scale
    _train(model, mp, 2, seed=7)
    _train(resumed, mp2, 2, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))


def test_a_state_dict_of_another_format_is_refused_and_changes_nothing(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    before = _weights(model)
    with pytest.raises(ValueError, match=r"not a \w+ state dict: format 'other/1'"):
        mp.load_state_dict({"format": "other/1", "optimizer": {"param_groups": []}})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("inner", [None, [], {"state": {}}, {"param_groups": []}])
def test_a_state_dict_of_this_format_without_an_inner_torch_state_is_refused(strategy, inner):
    model = _model(strategy)
    mp = _build(strategy, model)
    saved = mp.state_dict() | {"optimizer": inner}
    with pytest.raises(ValueError, match="'optimizer' must be a torch optimizer state dict"):
        mp.load_state_dict(saved)


MODEL_SPACE = [
    pytest.param(n, marks=GLOO) if n in ON_MESH else n for n in STRATEGIES if not n.startswith("stage")
]


@pytest.fixture(params=MODEL_SPACE)
def model_space(request, tmp_path):
    """The strategies whose state dict is in model space (the exact and fused ones, over shards too)."""
    if request.param in ON_MESH:
        with world_of_one(tmp_path / "store"):
            yield request.param
    else:
        yield request.param


def _with_keys_as_text(saved):
    inner = saved["optimizer"]
    return saved | {"optimizer": inner | {"state": {str(k): v for k, v in inner["state"].items()}}}


def test_state_keyed_by_text_loads_as_by_index(model_space):
    """A state dict whose state keys became text (a JSON or YAML round trip) loads as the one keyed by index."""
    model, resumed = _model(model_space), _model(model_space)
    mp = _build(model_space, model)
    _train(model, mp, 2)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    mp2 = _build(model_space, resumed)
    mp2.load_state_dict(_with_keys_as_text(mp.state_dict()))
    _train(model, mp, 1, seed=7)
    _train(resumed, mp2, 1, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters(), strict=True))


def _recorded(saved, *changed):
    return saved | {"has_state": torch.tensor([k in changed for k in range(len(saved["params"]))])}


def _without_state(s):
    return _recorded(s, 0, 1, 2, 3) | {"optimizer": s["optimizer"] | {"state": {}}}


DAMAGES = {  # id: (damage to a state dict with state for all 4 params, the error it gets)
    "not-bool": (
        lambda s: s | {"has_state": torch.ones(4)},
        r"has_state must be a bool tensor of 4 \(one per param\), got torch.float32",
    ),
    "wrong-size": (
        lambda s: s | {"has_state": torch.ones(3, dtype=torch.bool)},
        r"has_state must be a bool tensor of 4",
    ),
    "state-missing": (
        _without_state,
        r"records optimizer state for params \[0, 1, 2, 3\] but does not hold it.*"
        r"save and load with halfprec.distributed.checkpoint",
    ),
    "state-unrecorded": (
        lambda s: _recorded(s, 0, 1),
        r"holds optimizer state for params \[2, 3\] that its has_state does not record",
    ),
    "rank-local-rows": (
        lambda s: s | {"params": [e | {"rows": [0, 1]} for e in s["params"]]},
        r"one rank's rows of FSDP2 shards as plain tensors",
    ),
}


@pytest.mark.parametrize(("damage", "match"), list(DAMAGES.values()), ids=list(DAMAGES))
def test_a_state_dict_whose_record_disagrees_is_refused_and_changes_nothing(model_space, damage, match):
    model = _model(model_space)
    mp = _build(model_space, model)
    _train(model, mp, 1)
    saved, before = mp.state_dict(), _weights(model)
    with pytest.raises(ValueError, match=match):
        mp.load_state_dict(damage(saved))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert mp.state_dict()["has_state"].all()


def test_the_exact_and_fused_strategies_load_each_others_state_dicts(tmp_path):
    saved = {}
    for name in ("exact", "fused"):
        model = _model()
        mp = _build(name, model)
        _train(model, mp, 2)
        saved[name] = (mp.state_dict(), _weights(model))
    for src, dst in (("exact", "fused"), ("fused", "exact")):
        model = _model()
        mp = _build(dst, model)
        mp.load_state_dict(saved[src][0])
        assert all(torch.equal(a, b) for a, b in zip(saved[src][1], model.parameters(), strict=True))
        assert mp.state_dict()["optimizer"]["state"].keys() == saved[src][0]["optimizer"]["state"].keys()


def test_a_plain_torch_state_dict(strategy):
    model = _model(strategy)
    mp = _build(strategy, model)
    torch_model = _model().float()
    plain = torch.optim.AdamW(torch_model.parameters(), lr=0.25)
    expected = DIFFERS["torch_state_dict"][strategy]
    if expected is None:
        mp.load_state_dict(plain.state_dict())
        assert mp.param_groups[0]["lr"] == 0.25
    else:
        with pytest.raises(expected, match="plain torch optimizer state dict"):
            mp.load_state_dict(plain.state_dict())
        assert mp.param_groups[0]["lr"] == 1e-2


def _trained_plain(optimizer_class, **settings):
    model = _model().float()
    plain = optimizer_class(model.parameters(), **settings)
    model(torch.randn(2, 5, device=DEVICE)).sum().backward()
    plain.step()
    return plain.state_dict()


def _unchanged(mp, model, before, lr=1e-2):
    assert mp.param_groups[0]["lr"] == lr and mp.state_dict()["optimizer"]["state"] == {}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    _train(model, mp, 1)  # and it still trains


def test_another_optimizers_plain_torch_state_dict_is_refused_the_same_way_and_changes_nothing(strategy):
    model = _model(strategy)
    mp, before = _build(strategy, model), _weights(model)
    plain = _trained_plain(torch.optim.SGD, lr=0.1, momentum=0.9)
    match = {None: r"saved by an optimizer without \['amsgrad', 'betas', 'eps'\], this optimizer is AdamW"}
    with pytest.raises(
        ValueError, match=match.get(DIFFERS["torch_state_dict"][strategy], "plain torch optimizer")
    ):
        mp.load_state_dict(plain)
    _unchanged(mp, model, before)


@pytest.mark.parametrize("size", [3, 1])  # one element is no scalar: only 0-d state is
def test_a_plain_torch_state_dict_with_state_of_the_wrong_size_is_refused_at_load(strategy, size):
    model = _model(strategy)
    mp, before = _build(strategy, model), _weights(model)
    plain = _trained_plain(torch.optim.AdamW, lr=0.25)
    plain["state"][0]["exp_avg"] = torch.zeros(size)
    match = {None: rf"state dict's exp_avg of param 0 has {size} elements? and the param 35"}
    with pytest.raises(
        ValueError, match=match.get(DIFFERS["torch_state_dict"][strategy], "plain torch optimizer")
    ):
        mp.load_state_dict(plain)
    _unchanged(mp, model, before)


def test_the_format_error_offers_a_plain_torch_state_dict_only_where_one_loads(strategy):
    mp = _build(strategy, _model(strategy))
    with pytest.raises(ValueError, match="not a") as refused:
        mp.load_state_dict({"format": "other/1"})
    assert ("plain torch optimizer state dict" in str(refused.value)) == (
        DIFFERS["torch_state_dict"][strategy] is None
    )


def test_add_param_group(strategy):
    model, extra = _model(strategy), torch.nn.Linear(3, 2).to(device=DEVICE, dtype=torch.float16)
    _shard(strategy, extra)  # one FSDP2 layout for every param of one optimizer
    mp = _build(strategy, model)
    expected = DIFFERS["add_param_group"][strategy]
    if expected is not None:
        with pytest.raises(expected, match="construction"):
            mp.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
        return
    mp.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    assert mp.model_params()[-2:] == list(extra.parameters()) and mp.param_groups[-1]["lr"] == 0.5
    x = torch.randn(2, 5).to(device=DEVICE, dtype=torch.float16)
    before = extra.weight.detach().clone()
    mp.backward(extra(model(x)).float().sum())
    mp.step()
    assert not torch.equal(before, extra.weight)


def test_a_grad_the_caller_dropped_after_a_step_is_not_applied_again(strategy):
    # torch.nn.Module.zero_grad() sets every .grad to None; a param the next backward does not reach then has no
    # grad, and torch does not step it
    model = _model(strategy)
    mp = _build(strategy, model)
    x = torch.randn(2, 5).to(device=DEVICE, dtype=torch.float16)
    mp.backward(model(x).float().pow(2).sum())
    mp.step()
    model.zero_grad()
    last = model[2]
    before = [last.weight.detach().clone(), last.bias.detach().clone()]
    frozen_head = model[0](x).float().pow(2).sum()  # reaches the first layer only
    expected = DIFFERS["backward_after_model_zero_grad"][strategy]
    if expected is not None:
        with pytest.raises(expected, match="zero_grad"):
            mp.backward(frozen_head)
        return
    mp.backward(frozen_head)
    mp.step()
    assert torch.equal(before[0], last.weight) and torch.equal(before[1], last.bias)


def _partly_used(strategy, set_to_none, grad_accum_dtype):
    """Three steps where the last layer gets a grad in the first only; its weights after them."""
    model = _model(strategy)
    mp = _build(strategy, model, grad_accum_dtype=grad_accum_dtype)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        x = torch.randn(4, 5, generator=g).to(device=DEVICE, dtype=torch.float16)
        h = model[1](model[0](x))
        out = model[2](h) if step == 0 else h
        mp.backward(out.float().pow(2).mean())
        mp.step()
        mp.zero_grad(set_to_none=set_to_none)
    return [p.detach().clone() for p in model[2].parameters()]


@pytest.mark.parametrize("grad_accum_dtype", ["param", "fp32"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_which_params_a_step_updates_follows_torchs_zero_grad_rule(strategy, set_to_none, grad_accum_dtype):
    # torch steps a param whose grad was zeroed (set_to_none=False: momentum and decay move it) and not one whose
    # grad is None; every strategy and both accumulation dtypes follow that rule (the fused strategy keeps its
    # flat buffers through zero_grad(set_to_none=False) and marks the zeroed grads as this step's)
    first = _partly_used(strategy, True, grad_accum_dtype)  # stepped in the first step only
    got = _partly_used(strategy, set_to_none, grad_accum_dtype)
    moved_after_first = not all(torch.equal(a, b) for a, b in zip(first, got, strict=True))
    assert moved_after_first == (not set_to_none)
