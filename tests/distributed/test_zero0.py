"""ZeRO-0 data parallelism with fp32 sums (``process_group=``, ``optim/accumulate.py``), 2 gloo ranks.

With k = 1, 4, 16 micro-batches, the grads a step reads equal, bit for bit, each rank's fp32 sum in micro-batch
order of its 16-bit micro-batch grads, then the fp32 sum of the two ranks' sums, divided by 2 and by the loss scale
(the sharded path's mean); a param only rank 1 trains gets that mean on both ranks. bf16 on the exact path only
(the interpreter's bf16 arithmetic is wrong: the fused bf16 case runs on CUDA, ``test_gpu.py``'s territory); fp16 on
both, an overflow on rank 1 skipping the step on both. The exact masters equal a plain fp32 optimizer fed those
grads bit for bit; the fused ones within the fused path's tolerance.
"""

from __future__ import annotations

import re

import pytest
import torch
from _compare import assert_equal, unskipped
from _launch import launch, results
from tests.tolerances import tol

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = [
    {
        "dtype": dtype,
        "micro": k,
        "steps": 3,
        "impls": ["torch", "triton"] if dtype == "fp16" else ["torch"],
        **({"poison": [[1, 1]]} if dtype == "fp16" else {}),
    }  # fmt: skip
    for k in (1, 4, 16)
    for dtype in ("bf16", "fp16")
]
IDS = [f"{c['dtype']}-k{c['micro']}" for c in CONFIGS]
RUNS = [(i, impl) for i, c in enumerate(CONFIGS) for impl in c["impls"]]
RUN_IDS = [f"{IDS[i]}-{impl}" for i, impl in RUNS]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero0")
    launch(2, "zero0", out, configs=CONFIGS, timeout=600.0)
    return results(out, 2)


@pytest.mark.slow
@pytest.mark.parametrize(("i", "impl"), RUNS, ids=RUN_IDS)
def test_step_reads_the_mean_of_the_ranks_fp32_sums(ranks, i, impl):
    cfg = CONFIGS[i]
    for rank, r in enumerate(ranks):
        run = r[i][impl]
        assert run["impl"] == impl
        for where, s in unskipped(
            run, cfg, f"{IDS[i]}, {impl}", rank
        ):  # rank 0 skips too: its grads are finite
            assert "unused" in s["seen"] and set(s["seen"]) == set(s["oracle"]), where
            assert_equal(s["seen"], s["oracle"], where)


@pytest.mark.slow
@pytest.mark.parametrize(("i", "impl"), RUNS, ids=RUN_IDS)
def test_masters_match_a_plain_fp32_optimizer_fed_those_grads(ranks, i, impl):
    bound = (
        {"rtol": 0.0, "atol": 0.0} if impl == "torch" else tol("fused_master", DTYPES[CONFIGS[i]["dtype"]])
    )
    for rank, r in enumerate(ranks):
        run = r[i][impl]
        for name, m in run["masters"].items():
            torch.testing.assert_close(
                m, run["reference"][name], **bound, msg=lambda t, n=name, k=rank: f"rank {k} {n}: {t}"
            )
        assert_equal(run["masters"], ranks[0][i][impl]["masters"], f"{IDS[i]} {impl}: rank {rank} vs rank 0")


@pytest.mark.slow
def test_the_oracle_is_not_16_bit_accumulation(ranks):
    for i, cfg in enumerate(CONFIGS):
        if cfg["micro"] == 16 and cfg["dtype"] == "bf16":
            assert any(s["differs"] for s in ranks[0][i]["torch"]["steps"]), IDS[i]


@pytest.mark.slow
def test_engine_at_stage_0_all_reduces_fp32_sums_saves_on_rank_0_and_refuses_ddp(tmp_path):
    launch(2, "engine_zero0", tmp_path)
    res = results(tmp_path, 2)
    for rank, r in enumerate(res):
        assert r["grouped"] and r["accum"] == "fp32", f"rank {rank}"
        assert_equal(r["weights"], res[0]["weights"], f"rank {rank} vs rank 0: the ranks' weights")
        assert_equal(r["resumed"], r["weights"], f"rank {rank}: resumed weights")
        assert torch.equal(*r["rng"]), f"rank {rank}: its own RNG stream after the resume"
        assert r["ddp"].startswith(
            "the model is wrapped in DistributedDataParallel and grad_accum_dtype resolves"
        ), r["ddp"]
    assert not torch.equal(res[0]["rng"][0], res[1]["rng"][0])
    assert (tmp_path / "ck" / "step-2" / "rng-1.pt").exists()
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-2"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "regex"),
    [
        ("no group", "grad_accum_dtype='fp32' with a process group of 2 ranks: .*pass process_group="),
        (
            "16-bit sums",
            "process_group= all-reduces the fp32 grad sums, which needs grad_accum_dtype='fp32'",
        ),
        ("not a group", "process_group must be a torch.distributed.ProcessGroup .* got str"),
    ],
)
def test_refusals(ranks, name, regex):
    for r in ranks:
        assert re.search(regex, r["errors"][name]), r["errors"][name]


@pytest.mark.slow
def test_impl_triton_passes_the_group_to_the_fused_optimizer(ranks):
    for r in ranks:
        assert r["triton"] == ["FusedAdamW", True]


@pytest.mark.slow
def test_fp32_params_that_are_their_own_masters_get_the_mean_too(ranks):
    for rank, r in enumerate(ranks):
        own = r["own"]
        assert own["dtype"] == "torch.float32"
        assert_equal({"gain": own["got"]}, {"gain": own["want"]}, f"rank {rank}")
