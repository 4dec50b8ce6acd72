"""halfprec over FSDP2 (``fully_shard``: DTensor params), 4 gloo ranks in one launch (``_fsdp.py``).

Bit for bit against the oracle (the same model unsharded: fp32 copies stepped by the same torch AdamW on the full
grads, norm fp32(sqrt(fp64 sum of squares))): masters, params, AdamW state, norms, skips and loss scales, for-loop
and foreach AdamW, with and without clipping, on two 2-rank meshes and on HSDP's 2x2 mesh; an inf in one rank's
shard skips the step on every rank; fp16's dynamic scale stays equal everywhere; fp32 accumulation of the sharded
grads; uneven and zero-row shards; a DCP checkpoint saved at world size 2 loads at 3 and at 1, bit-identical.
The fused strategy (Triton's interpreter; fp32 and split masters, 1-D and HSDP meshes) against the same fused
optimizer over the whole model, bit for bit where nothing is clipped.

The oracle here takes its grads from a twin FSDP2 model; ``test_fsdp_global.py`` checks FSDP2's grads against one
process without FSDP2 on the same global batch, at 2 and 4 ranks (a 1-D mesh of 4 shards trained).
"""

from __future__ import annotations

import re
from pathlib import Path

import _launch
import pytest
import torch
from tests.tolerances import approx, tol

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU")

PAIRS = [
    [  # ranks 0 and 1
        {"name": "bf16-forloop", "dtype": "bf16", "steps": 4},
        {"name": "bf16-foreach-clip-inf", "dtype": "bf16", "foreach": True, "clip": 0.05, "steps": 4, "inf": [[2, 1]]},
        {"name": "bf16-fp32-accumulation-clip", "dtype": "bf16", "micro": 3, "clip": 0.05, "steps": 3},
        {
            "name": "fused-fp16-dynamic-scale", "dtype": "fp16", "fused": True, "scaler": "dynamic", "steps": 5,
            "inf": [[1, 1], [2, 0]],
        },
        {
            "name": "fused-fp16-fp32-accumulation-clip", "dtype": "fp16", "fused": True, "scaler": "dynamic", "micro": 3,
            "clip": 0.05, "steps": 3,
        },
    ],
    [  # ranks 2 and 3
        {"name": "bf16-forloop-clip", "dtype": "bf16", "clip": 0.05, "steps": 4},
        {"name": "bf16-foreach", "dtype": "bf16", "foreach": True, "steps": 4},
        {
            "name": "fp16-dynamic-scale", "dtype": "fp16", "scaler": "dynamic", "clip": 0.05, "steps": 5,
            "inf": [[1, 3], [2, 3]],
        },
        {"name": "fused-bf16-split", "dtype": "bf16", "fused": True, "masters": "split", "steps": 4, "inf": [[2, 3]]},
    ],
]  # fmt: skip
# an inf on rank 3, a second replica: its sums of squares are not counted, its overflow flag is
HSDP = [
    {"name": "hsdp-bf16-foreach-clip-inf", "dtype": "bf16", "foreach": True, "clip": 0.05, "steps": 4, "inf": [[2, 3]]},
    {
        "name": "hsdp-fused-fp16-clip-inf", "dtype": "fp16", "fused": True, "scaler": "dynamic", "clip": 0.05, "steps": 4,
        "inf": [[2, 3]],
    },
]  # fmt: skip
CASES = {c["name"]: (c, (2 * i, 2 * i + 1)) for i, pair in enumerate(PAIRS) for c in pair} | {
    c["name"]: (c, (0, 1, 2, 3)) for c in HSDP
}
FUSED = [name for name, (cfg, _) in CASES.items() if cfg.get("fused")]
EXACT = [name for name in CASES if name not in FUSED]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_launch, "WORKER", Path(__file__).with_name("_fsdp.py"))
        _launch.launch(4, "fsdp", out, timeout=300.0, pairs=PAIRS, hsdp=HSDP)
    return _launch.results(out, 4)


def _runs(ranks, name):
    cfg, members = CASES[name]
    return cfg, [(r, ranks[r]["cases"][name]) for r in members]


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_masters_params_and_state_equal_the_oracle_bit_for_bit(ranks, name):
    cfg, runs = _runs(ranks, name)
    for rank, run in runs:
        for i, (m, o) in enumerate(zip(run["masters"], run["oracle"], strict=True)):
            assert torch.equal(m, o), f"{name}, rank {rank}, master {i}: max diff {(m - o).abs().max()}"
            assert torch.equal(run["params"][i], o.to(DTYPES[cfg["dtype"]])), (
                f"{name}, rank {rank}, param {i}"
            )
        for key, mine in run["state"].items():
            for i, (s, o) in enumerate(zip(mine, run["oracle_state"][key], strict=True)):
                assert torch.equal(s, o), f"{name}, rank {rank}, {key} of param {i}"
        stepped = sum(not s["oracle_skipped"] for s in run["steps"])
        assert run["step_count"] == [float(stepped)] * len(run["masters"]), (name, rank)


@pytest.mark.slow
@pytest.mark.parametrize("name", FUSED)
def test_fused_over_shards_equals_the_fused_optimizer_over_the_whole_model(ranks, name):
    """Without clipping bit for bit (the update is elementwise: the shards change nothing), skips and scales
    included; with clipping the norm is summed in another order, so the clip coefficient and every clipped update
    may differ in the last fp32 bits. With micro-batches (no fused twin: fp32 sums come from backward's hooks) the
    torch oracle, within the fused path's tolerance."""
    cfg, runs = _runs(ranks, name)
    dtype = DTYPES[cfg["dtype"]]
    for rank, run in runs:
        where = f"{name}, rank {rank}"
        stepped = sum(not s["oracle_skipped"] for s in run["steps"])
        assert run["step_count"] == [float(stepped)] * len(run["masters"]), where
        assert run["in_place"] and all(run["in_place"]), where  # zero-row shards too (rank 1 of each pair)
        for m, o in zip(run["masters"], run["oracle"], strict=True):  # both AdamW, either way
            torch.testing.assert_close(m, o, **tol("sharded_clipped_master"), msg=where)
        fused = run["fused_oracle"]
        if fused is None:
            assert cfg.get("micro", 1) > 1
            continue
        exact = cfg.get("clip") is None
        for i, (m, o) in enumerate(zip(run["masters"], fused["masters"], strict=True)):
            if exact:
                assert torch.equal(m, o), f"{where}, master {i}"
                assert torch.equal(run["params"][i], fused["params"][i]), f"{where}, param {i}"
            else:
                torch.testing.assert_close(m, o, **tol("sharded_clipped_master"), msg=where)
                torch.testing.assert_close(run["params"][i].float(), fused["params"][i].float(), **tol(
                    "fused_param_neighbour", torch.float16), msg=where)  # fmt: skip
            assert run["params"][i].dtype == dtype
        for key, mine in run["state"].items():
            for i, (s, o) in enumerate(zip(mine, fused["state"][key], strict=True)):
                if exact:
                    assert torch.equal(s, o), f"{where}, {key} of param {i}"
                else:
                    torch.testing.assert_close(s, o, **tol("sharded_clipped_master"), msg=where)
        for step, s in enumerate(run["steps"]):
            skipped, norm, scale = s["fused_oracle"]
            assert (s["skipped"], s["scale"]) == (skipped, scale), f"{where}, step {step}"
            if not skipped:
                assert s["norm"] == approx(norm, "grad_norm"), f"{where}, step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_reports_the_oracles_norm_skips_and_scale(ranks, name):
    _, runs = _runs(ranks, name)
    for rank, run in runs:
        for step, s in enumerate(run["steps"]):
            where = f"{name}, rank {rank}, step {step}"
            assert s["skipped"] == s["oracle_skipped"], where
            if s["oracle_norm"] is not None and name in FUSED:  # summed in blocks, then over the mesh in fp64
                assert s["norm"] == approx(s["oracle_norm"], "grad_norm"), where
            elif s["oracle_norm"] is not None:
                assert s["norm"] == s["oracle_norm"], where
            if s["oracle_scale"] is not None:
                assert s["scale"] == s["oracle_scale"], where
        assert run["steps"] == runs[0][1]["steps"], f"{name}: rank {rank} and rank {runs[0][0]} differ"


@pytest.mark.slow
def test_an_inf_in_one_ranks_shard_skips_the_step_on_every_rank(ranks):
    for name, (cfg, _) in CASES.items():
        planted = {s for s, _ in cfg.get("inf", [])}
        for rank, run in _runs(ranks, name)[1]:
            assert [s["skipped"] for s in run["steps"]] == [k in planted for k in range(cfg["steps"])], (
                name,
                rank,
            )


@pytest.mark.slow
def test_fp16_dynamic_scale_keeps_its_hysteresis_equal_on_every_rank(ranks):
    _, runs = _runs(ranks, "fp16-dynamic-scale")
    for _, run in runs:  # the first overflow spends the hysteresis, the second halves the scale
        assert [s["scale"] for s in run["steps"]] == [1024.0, 1024.0, 512.0, 512.0, 512.0]


@pytest.mark.slow
def test_fp32_accumulation_sums_the_sharded_grads_in_fp32(ranks):
    _, runs = _runs(ranks, "bf16-fp32-accumulation-clip")
    # the masters equal the oracle's, fed fp32 sums; the same sums in bf16 are other numbers
    assert any(run["differs"] for _, run in runs)


@pytest.mark.slow
def test_uneven_and_zero_row_shards(ranks):
    run0, run1 = (ranks[r]["cases"]["bf16-forloop"] for r in (0, 1))
    assert run0["rows"] == [(4, 5), (4,), (5, 7), (5,), (1, 9), (1,)]
    assert run1["rows"] == [(3, 5), (3,), (4, 7), (4,), (0, 9), (0,)]
    assert ranks[3]["cases"][HSDP[0]["name"]]["placements"] == "(Replicate(), Shard(dim=0))"


@pytest.mark.slow
@pytest.mark.parametrize(("rank", "world"), [(0, 3), (3, 1)])
def test_a_checkpoint_saved_at_world_size_2_loads_bit_identical_at(ranks, rank, world):
    load = ranks[rank]["load"]
    assert load["world"] == world
    assert load["keys_equal"] and load["unequal"] == []
    assert load["params_are_rounded_masters"]
    # the fused strategy's checkpoint, into the fused and the exact strategy at this world size
    assert load["fused_unequal"] == {"triton": [], "torch": []}
    if world == 3:
        assert [load["rows"] for load in (ranks[r]["load"] for r in range(3))] == [
            [(3, 5), (3,), (3, 7), (3,), (1, 9), (1,)],
            [(3, 5), (3,), (3, 7), (3,), (0, 9), (0,)],
            [(1, 5), (1,), (3, 7), (3,), (0, 9), (0,)],
        ]


@pytest.mark.slow
def test_state_dict_holds_the_shards_as_dtensors(ranks):
    """Saved per rank (torch.save), a state dict loads on its own rank and is refused on the other (its DTensors'
    rows are not this rank's); each param's entry holds the whole param's shape."""
    for rank in (0, 1):
        ck = ranks[rank]["checkpoint"]
        assert ck["local_state_dict_round_trip"]
        assert ck["local_state_dict_shapes"] == [[7, 5], [7], [9, 7], [9], [1, 9], [1]]
        for case in (
            "other_rank_state_dict",
            "even_other_rank",
        ):  # uneven shards, and rows of this rank's shape
            kind, message = ck[case]
            assert kind == "ValueError" and f"at mesh coordinate ({1 - rank},)" in message, (case, message)
            assert f"whose rows this rank, at mesh coordinate ({rank},), holds" in message
        assert ck["even_own_rank"] == ["no error", ""]


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 1])
def test_torch_dcp_saves_the_state_dict_and_reshards_it(ranks, world):
    """``torch.distributed.checkpoint`` saves ``state_dict()`` at world size 2 and loads it at 3 and at 1 into an
    optimizer that has stepped: masters and state equal the saved run's, bit for bit. Into one that has not, DCP
    keeps only what the destination held (no state), which the load refuses, naming halfprec's checkpoint."""
    load = next(r["load"] for r in ranks if r["load"]["world"] == world)
    assert load["torch_dcp_unequal"] == []
    kind, message = load["torch_dcp_into_fresh"]
    assert kind == "ValueError" and "records optimizer state for params [0, 1, 2, 3, 4, 5]" in message
    assert "save and load with halfprec.distributed.checkpoint" in message


@pytest.mark.slow
def test_fp32_shards_step_as_the_torch_optimizer_does(ranks):
    for rank in (2, 3):
        run = ranks[rank]["fp32_shards"]
        assert run["equal"] and run["reloaded"]
        assert all(mine == whole for mine, whole in run["norms"]), run["norms"]
        assert run["norms"] == ranks[2]["fp32_shards"]["norms"]


REFUSALS = [
    ("no_sync", "RuntimeError", r"3 backward\(\) calls .* set_requires_gradient_sync\(True\)"),
    (
        "two_meshes",
        "ValueError",
        r"one halfprec optimizer takes one FSDP2 layout; build one optimizer per mesh",
    ),
    ("shard_1", "ValueError", r"Shard\(dim=1\).*Shard\(0\) on one mesh dim"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "kind", "pattern"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_that_need_several_ranks(ranks, case, kind, pattern):
    for rank in (2, 3):
        found, message = ranks[rank]["refusals"][case]
        assert found == kind and re.search(pattern, message), (rank, found, message)
