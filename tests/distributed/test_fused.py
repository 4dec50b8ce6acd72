"""The sharded optimizer's fused local step (``impl="triton"``) on 2 gloo ranks, kernels in Triton's interpreter.

Against the torch local step on the same data: masters and state within the fused path's tolerance
(``tests/tolerances.py``), step counters, skips and loss scales exactly; the 16-bit params are the
masters rounded. Pieces cut params at odd offsets, so both the aligned and the unaligned update rows run.
A checkpoint of the fused run, loaded into a fresh fused optimizer, continues bit-exactly.
"""

from __future__ import annotations

import pytest
import torch
from _compare import stitch
from _launch import launch, results
from tests.tolerances import tol

# CPU gloo ranks with the kernels in Triton's interpreter; on a GPU machine test_gpu.py runs them on CUDA
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")

STEPS, MORE = 4, 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FUSED = [
    {"dtype": "fp16", "opt": "adamw", "stage": 1, "reduce": "fp32", "poison": [[1, 0]], "clip": 0.05},
    {"dtype": "bf16", "opt": "adam", "stage": 2, "reduce": "fp32", "micro": 2},
    {"dtype": "fp16", "opt": "sgd", "stage": 2, "reduce": "param", "poison": [[2, 1]]},
    {"dtype": "bf16", "opt": "adagrad", "stage": 1, "reduce": "fp32", "param_dtype": True, "clip": 0.05},
    # 16-bit grad shards, read by the kernel with 1/scale x clip in its coefficient
    {"dtype": "bf16", "opt": "adamw", "stage": 1, "reduce": "param", "clip": 0.05, "micro": 2},
]
IDS = [f"{c['opt']}-{c['dtype']}-stage{c['stage']}" for c in FUSED]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused")
    launch(2, "fused", out, configs=FUSED, steps=STEPS, more=MORE, timeout=300.0)
    return results(out, 2)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(FUSED)), ids=IDS)
def test_fused_local_step_matches_the_torch_local_step(ranks, i):
    cfg = FUSED[i]
    dtype = DTYPES[cfg["dtype"]]
    assert [r[i]["triton"]["impl"] for r in ranks] == ["triton", "triton"]
    assert [r[i]["torch"]["impl"] for r in ranks] == ["torch", "torch"]
    for r in ranks:
        fused, ref = r[i]["triton"]["trace"], r[i]["torch"]["trace"]
        assert fused["skipped"] == ref["skipped"]
        assert fused["scales"] == ref["scales"]
        assert fused["lr"] == ref["lr"] and fused["lr"][0] < 0.01  # the scheduler moved it, held on skips
        torch.testing.assert_close(fused["norms"], ref["norms"], equal_nan=True, **tol("grad_norm"))
    assert any(ranks[0][i]["torch"]["trace"]["skipped"]) == bool(cfg.get("poison"))
    masters_f, state_f = stitch([r[i]["triton"]["pieces"] for r in ranks])
    masters_t, state_t = stitch([r[i]["torch"]["pieces"] for r in ranks])
    assert masters_f.keys() == masters_t.keys()
    for name, ref in masters_t.items():
        torch.testing.assert_close(masters_f[name], ref, **tol("fused_master", dtype), msg=name)
    assert state_f.keys() == state_t.keys()
    for name, ref_state in state_t.items():
        assert state_f[name].keys() == ref_state.keys(), (name, sorted(state_f[name]), sorted(ref_state))
        for key, ref in ref_state.items():
            got = state_f[name][key]
            if key == "step":
                assert got.dtype == ref.dtype == torch.float32 and got.device.type == "cpu"
                assert torch.equal(got, ref), (name, got, ref)
            else:
                torch.testing.assert_close(got, ref, **tol("fused_state", dtype), msg=f"{name}.{key}")
    for r in ranks:  # every rank's 16-bit params are the (all-gathered) masters rounded to nearest even
        for name, p in r[i]["triton"]["params"].items():
            assert torch.equal(p.reshape(-1), masters_f[name].to(p.dtype)), name


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(FUSED)), ids=IDS)
def test_fused_checkpoint_resumes_bit_exactly(ranks, i):
    masters_f, state_f = stitch([r[i]["triton"]["pieces"] for r in ranks])
    masters_r, state_r = stitch([r[i]["resumed"]["pieces"] for r in ranks])
    assert masters_r.keys() == masters_f.keys()
    for name, ref in masters_f.items():
        assert torch.equal(masters_r[name], ref), name
        assert state_r.get(name, {}).keys() == state_f.get(name, {}).keys(), name
        for key, value in state_f.get(name, {}).items():
            assert torch.equal(state_r[name][key], value), (name, key)
    for r in ranks:
        for name, p in r[i]["triton"]["params"].items():
            assert torch.equal(p, r[i]["resumed"]["params"][name]), name


@pytest.mark.slow
def test_fused_local_step_refuses_what_it_cannot_honour(ranks):
    for r in ranks:
        assert "has step hooks, which would not run" in r["hooks"] and "impl='torch'" in r["hooks"]
        assert r["nadam"].startswith("impl='triton' cannot be honoured: NAdam has no fused kernel")


@pytest.mark.slow
def test_fused_local_step_edges(ranks):
    e0, e1 = ranks[0]["edges"], ranks[1]["edges"]
    assert e1["no_piece_pieces"] == 0 and e0["no_piece_pieces"] == 1  # rank 1 holds nothing and still steps
    assert torch.equal(e0["no_piece_weight"], e1["no_piece_weight"])
    for rank, e in enumerate((e0, e1)):  # rank 0 updated it, the all-gather reached rank 1
        assert not torch.equal(e["no_piece_before"], e["no_piece_weight"]), f"rank {rank}: weight never moved"
    assert e1["pieces_held"] == ["y"] and e0["pieces_held"] == ["x", "y"]
    # y: no grad at step 0, two updates after; x: three. Both ranks agree on the params.
    assert e0["steps"] == {"x": 3.0, "y": 2.0} and e1["steps"] == {"y": 2.0}
    for name in ("x", "y"):
        assert torch.equal(e0["xy"][name], e1["xy"][name])
    assert e0["sched_warnings"] == [] and e1["sched_warnings"] == []
    for e in (e0, e1):
        assert (
            "fused local step cannot run: param group 0 has maximize=True, which the fused kernels do not"
            in e["maximize"]
        )
