"""Split masters on the sharded optimizer (ZeRO-1/2, fused local step, 2 gloo ranks, kernels in Triton's
interpreter): the same steps as with fp32 masters give the same masters and state bit for bit, params equal
except at ties (counted); checkpoints hold the fp32 masters, so they move between split and fp32 masters and
from 2 ranks to 1, bit for bit. Refusals: in this process, as the one rank of a world of size 1."""

from __future__ import annotations

import pytest
import torch
from _compare import assert_equal, assert_steps, labelled, stitch
from _launch import launch, results

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer
from halfprec.optim.split import split_master

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")

STEPS, MORE = 4, 2
SPLIT = [
    {"dtype": "bf16", "opt": "adamw", "stage": 1, "reduce": "fp32", "param_dtype": True, "clip": 0.05},
    {"dtype": "bf16", "opt": "adamw", "stage": 2, "reduce": "param", "poison": [[2, 1]], "micro": 2},
    {"dtype": "bf16", "opt": "sgd", "stage": 2, "reduce": "fp32", "param_dtype": True},
    {"dtype": "bf16", "opt": "adagrad", "stage": 1, "reduce": "param", "micro": 2},
]
IDS = [f"{c['opt']}-stage{c['stage']}-{c['reduce']}" for c in SPLIT]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("split")
    launch(2, "split", out, configs=SPLIT, steps=STEPS, more=MORE, timeout=300.0)
    two = results(out, 2)
    launch(1, "split_load", out, configs=SPLIT, timeout=300.0)
    return two, results(out, 1)[0]


def _model_space(ranks: list, key: str) -> tuple[dict, dict]:
    """(masters, state) stitched from every rank's pieces, state flattened to ``name.key``."""
    masters, state = stitch([r[key]["pieces"] for r in ranks])
    return masters, {f"{n}.{k}": v for n, st in state.items() for k, v in st.items()}


def _assert_same(got: tuple, want: tuple, where: str) -> None:
    assert_equal(got[0], want[0], f"{where}: masters")
    assert_equal(got[1], want[1], f"{where}: state")


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SPLIT)), ids=IDS)
def test_split_masters_step_as_fp32_masters(runs, i):
    ranks = [r[i] for r in runs[0]]
    for rank, r in enumerate(ranks):
        split, fp32 = r["split"]["trace"], r["fp32"]["trace"]
        for what in ("skipped", "scales"):
            assert_steps(split[what], fp32[what], what, f"rank {rank}")
        norms = torch.tensor(split["norms"]), torch.tensor(fp32["norms"])
        torch.testing.assert_close(*norms, rtol=0, atol=0, equal_nan=True, msg=labelled(f"rank {rank} norms"))
    assert any(ranks[0]["fp32"]["trace"]["skipped"]) == bool(SPLIT[i].get("poison"))
    fp32 = _model_space(ranks, "fp32")
    _assert_same(_model_space(ranks, "split"), fp32, "split vs fp32 masters")
    ties = 0
    for r in ranks:  # the params: masters rounded to nearest even, or with split masters ties away
        for name, master in fp32[0].items():
            even, away = r["fp32"]["params"][name].reshape(-1), r["split"]["params"][name].reshape(-1)
            assert torch.equal(even, master.to(torch.bfloat16)), name
            assert torch.equal(away.view(torch.int16), split_master(master)[0].view(torch.int16)), name
            ties += int((even != away).sum())
    assert ties == 0, f"{ties} params differ (ties rounded away); none expected on this data"


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SPLIT)), ids=IDS)
def test_checkpoints_move_between_split_and_fp32_masters(runs, i):
    ranks = [r[i] for r in runs[0]]
    fp32 = _model_space(ranks, "fp32")  # the uninterrupted run's end
    # resumed from the checkpoint after STEPS for MORE steps; the rank-local state dicts loaded after the end
    for key in ("split->fp32", "fp32->split", "local split->fp32", "local fp32->split"):
        _assert_same(_model_space(ranks, key), fp32, key)
    for r in ranks:
        assert torch.equal(r["split"]["local_masters"], r["fp32"]["local_masters"])
        assert r["released-split"], "the save kept the joined fp32 masters"


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SPLIT)), ids=IDS)
def test_checkpoints_load_from_two_ranks_into_one(runs, i):
    ranks, one = [r[i] for r in runs[0]], runs[1]
    for source in ("fp32", "split"):
        saved = _model_space(ranks, f"saved-{source}")
        for target in ("fp32", "split"):
            got = one[f"{i} {source}->{target}"]
            _assert_same(_model_space([{"x": got}], "x"), saved, f"{source} on 2 ranks -> {target} on 1")
            for name, master in saved[0].items():
                want = master.to(torch.bfloat16) if target == "fp32" else split_master(master)[0]
                assert torch.equal(got["params"][name].reshape(-1).view(torch.int16), want.view(torch.int16))


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("stage", [1, 2])
def test_engine_builds_split_masters_at_zero_stage(stage):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    engine = halfprec.initialize(
        model, torch.optim.AdamW(model.parameters()), precision="bf16", zero_stage=stage, impl="triton",
        masters="split",
    )  # fmt: skip
    assert engine.optimizer.masters == "split" and engine.optimizer.stage == stage
    assert engine.optimizer.flat_master is None


def _sharded(dtype=torch.bfloat16, **options):
    model = torch.nn.Linear(3, 2).to(dtype)
    return ShardedMixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters()), named_parameters=model, **options
    )


# (options, dtype of the model, message): split masters where they cannot be kept
SPLIT_ERRORS = [
    (
        {"masters": "split", "impl": "torch"},
        torch.bfloat16,
        r"masters='split' needs the fused local step, got impl='torch'",
    ),
    (
        {"masters": "split"},
        torch.bfloat16,
        r"needs the fused local step, got impl='torch'.*impl='triton'",
    ),  # CPU: auto
    (
        {"masters": "split", "impl": "triton"},
        torch.float16,
        r"only for bf16 params, got torch.float16 params",
    ),
    (
        {"masters": "split", "impl": "triton", "param_dtype": torch.float16},
        torch.float32,
        r"torch.float16 params",
    ),
    (
        {"masters": "split", "impl": "triton"},
        torch.float32,
        r"keeps the masters of bf16 params, got torch.float32",
    ),
    (
        {"masters": "bf16", "impl": "triton"},
        torch.bfloat16,
        r"masters must be one of \('fp32', 'split'\), got 'bf16'",
    ),
]


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(("options", "dtype", "message"), SPLIT_ERRORS)
def test_split_masters_refused_where_they_cannot_be_kept(options, dtype, message):
    with pytest.raises(ValueError, match=message):
        _sharded(dtype, **options)


@pytest.mark.usefixtures("one_rank")
def test_split_masters_join_and_refresh():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)  # fp32: cast to bf16, the masters start from the fp32 weights
    originals = [p.detach().clone().reshape(-1) for p in model.parameters()]
    inner = torch.optim.AdamW(model.parameters())
    opt = ShardedMixedPrecisionOptimizer(
        inner, named_parameters=model, impl="triton", masters="split", param_dtype=torch.bfloat16
    )
    assert "masters='split'" in repr(opt) and opt.flat_master is None
    for master, original, p in zip(opt.master_params(), originals, model.parameters(), strict=True):
        assert torch.equal(master, original)  # exact fp32 masters
        assert p.dtype == torch.bfloat16
    opt.refresh_masters()  # the masters become the bf16 weights exactly: low halves 0
    assert not opt.flat_low.any()
    for master, p in zip(opt.master_params(), model.parameters(), strict=True):
        assert torch.equal(master, p.detach().float().reshape(-1))
