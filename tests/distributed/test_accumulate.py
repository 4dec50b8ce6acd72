"""FP32 gradient accumulation on the sharded optimizer (``grad_accum_dtype="fp32"``), 2 gloo ranks.

With k = 1, 4, 16 micro-batches, bf16 and fp16 (loss-scaled, one overflow on one rank), stages 1 and 2, the fp32
grad shard a step reads equals, bit for bit, the fp32 sum in micro-batch order of each rank's 16-bit micro-batch
grads, then the fp32 sum of the two ranks' sums, divided by 2 and by the loss scale (``_accum.py``). Both local
steps read that shard: the torch one gives masters equal to a plain fp32 optimizer fed the oracle grads, bit for
bit; the fused one (Triton's interpreter) within the fused path's tolerance.
"""

from __future__ import annotations

import pytest
import torch
from _compare import assert_equal, stitch, unskipped
from _launch import launch, results
from tests.tolerances import tol

# CPU gloo ranks, the fused step in Triton's interpreter
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = [
    {
        "dtype": dtype,
        "opt": "adamw",
        "stage": stage,
        "reduce": "fp32",
        "micro": k,
        "steps": 3,
        # stage 2 without no_sync() reduces after every backward: each reduction overwrites the shard
        "no_sync": stage == 1 or k == 16,
        "zero_grad": k != 4,  # k = 4: no zero_grad(), the step ends the accumulation by itself
        **({"poison": [[1, 1]]} if dtype == "fp16" else {}),
    }  # fmt: skip
    for k in (1, 4, 16)
    for dtype in ("bf16", "fp16")
    for stage in (1, 2)
]
IDS = [f"{c['dtype']}-stage{c['stage']}-k{c['micro']}" for c in CONFIGS]
IMPLS = ("torch", "triton")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("accum")
    launch(2, "accum", out, configs=CONFIGS, timeout=600.0)
    return results(out, 2)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_step_reads_the_fp32_sum_of_the_ranks_fp32_sums(ranks, i, impl):
    cfg = CONFIGS[i]
    for rank, r in enumerate(ranks):
        run = r[i][impl]
        assert run["impl"] == impl
        for where, s in unskipped(run, cfg, f"{IDS[i]}, {impl}", rank):
            got = {n: v for n, (_lo, _hi, v) in s["seen"].items() if n != "unused"}
            want = {n: s["oracle"][n].reshape(-1)[lo:hi] for n, (lo, hi, _v) in s["seen"].items() if n in got}
            assert_equal(got, want, where)
            if "unused" in s["seen"]:  # no rank ever gives it a grad: zeros, and it is not stepped
                assert not s["seen"]["unused"][2].any(), where


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=IDS)
@pytest.mark.parametrize("impl", IMPLS)
def test_local_step_applies_those_grads(ranks, i, impl):
    masters, _ = stitch([r[i][impl]["pieces"] for r in ranks])
    reference = ranks[0][i][impl]["reference"]
    bound = (
        {"rtol": 0.0, "atol": 0.0} if impl == "torch" else tol("fused_master", DTYPES[CONFIGS[i]["dtype"]])
    )
    for name, m in masters.items():
        torch.testing.assert_close(m, reference[name].reshape(-1), **bound, msg=lambda t, n=name: f"{n}: {t}")


@pytest.mark.slow
def test_the_oracle_is_not_16_bit_accumulation(ranks):
    """With 16 bf16 micro-batches the fp32 sums differ from the 16-bit ones somewhere (else the test is vacuous)."""
    for i, cfg in enumerate(CONFIGS):
        if cfg["micro"] == 16 and cfg["dtype"] == "bf16":
            assert any(s["differs"] for s in ranks[0][i]["torch"]["steps"]), IDS[i]


@pytest.mark.slow
def test_unsharded_optimizer_refuses_fp32_accumulation_with_two_ranks(ranks):
    for r in ranks:
        assert r["unsharded"].startswith("grad_accum_dtype='fp32' with a process group of 2 ranks")
        assert "MixedPrecisionOptimizer(..., stage=1 or 2, grad_accum_dtype='fp32'" in r["unsharded"]
