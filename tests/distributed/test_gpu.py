"""World-size-1 NCCL smoke test on a CUDA device (run on the GPU machine: ``pytest -m gpu tests/distributed``)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from _compare import assert_equal
from _launch import launch, one_process_group, results
from tests.tolerances import tol

from halfprec.distributed import ShardedMixedPrecisionOptimizer


def _max_abs_diff(got: dict, want: dict) -> tuple[float, str]:
    """The largest |got - want| over every tensor, and the tensor it is in."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(((got[n].double() - want[n].double()).abs().max().item(), n) for n in want if want[n].numel())


@pytest.mark.gpu
def test_nccl_world_size_one_matches_unsharded_and_checkpoints(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("HALFPREC_TEST_BACKEND", "nccl")
    monkeypatch.setenv("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
    launch(1, "gpu", tmp_path, steps=5, timeout=300)
    (res,) = results(tmp_path, 1)
    for stage in (1, 2):
        r = res[stage]
        assert_equal(r["params"]["sharded"], r["params"]["unsharded"], f"stage {stage}: params vs unsharded")
        assert_equal(
            r["exported"]["checkpoint"], r["exported"]["masters"], f"stage {stage}: checkpoint vs masters"
        )
        assert_equal(r["reloaded"]["loaded"], r["reloaded"]["saved"], f"stage {stage}: reloaded vs saved")
        fused = r["fused"]
        assert fused["impl"] == "triton", fused["impl"]  # impl='auto' on CUDA with default AdamW flags
        assert sorted(fused["state"]) == sorted(fused["oracle_state"]), (sorted(fused["state"]), "vs oracle")
        steps = {k: float(v) for k, v in fused["state"].items() if k.endswith(".step")}
        want_steps = {k: float(v) for k, v in fused["oracle_state"].items() if k.endswith(".step")}
        assert steps == want_steps, f"stage {stage}: fused step counters {steps}, want {want_steps}"
        assert_equal(
            fused["params"], fused["masters_rounded"], f"stage {stage}: 16-bit params vs masters rounded"
        )
        diff, name = _max_abs_diff(fused["masters"], fused["oracle_masters"])
        bound = tol("fused_cuda_master_max_abs")["atol"]
        assert diff < bound, f"stage {stage}: fused master {name} differs by {diff:.3g} (bound {bound})"
        moments = {k for k in fused["oracle_state"] if k.endswith((".exp_avg", ".exp_avg_sq"))}
        diff, name = _max_abs_diff(
            {k: fused["state"][k] for k in moments}, {k: fused["oracle_state"][k] for k in moments}
        )
        bound = tol("fused_cuda_state_max_abs")["atol"]
        assert diff < bound, f"stage {stage}: fused state {name} differs by {diff:.3g} (bound {bound})"


# (stage, masters, allocated bytes per param after the first step): AdamW, bf16, reduce_dtype="param", N = 1
ALLOCATED = [(1, "fp32", 16), (2, "fp32", 16), (1, "split", 14), (2, "split", 14)]


@pytest.mark.gpu
@pytest.mark.parametrize(("stage", "masters", "per_param"), ALLOCATED)
def test_allocated_bytes_per_param_at_world_size_one(tmp_path, stage, masters, per_param):
    """The design's 4 + 12/N (stage 1) and 2 + 14/N (stage 2) at N = 1, within 5%: the fused local step reads
    the 16-bit grad shard and writes the 16-bit params itself; split masters take 2/N less."""
    torch.cuda.set_device(0)
    with one_process_group("nccl", tmp_path / "store"):
        # cuBLAS allocates its workspace (tens of MiB, counted as allocated) at a process's first matmul and
        # backward: made here, before the baseline, or the first case measures it
        warm = torch.nn.Linear(2048, 2048, bias=False).to("cuda", torch.bfloat16)
        warm(torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
        del warm
        gc.collect()  # earlier tests' garbage freed now, not during the measurement
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)]
        model = torch.nn.Sequential(*layers).to("cuda", torch.bfloat16)
        n = sum(p.numel() for p in model.parameters())
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        kw = {} if masters == "fp32" else {"masters": masters}
        opt = ShardedMixedPrecisionOptimizer(
            inner, named_parameters=model, stage=stage, reduce_dtype="param", **kw
        )
        assert opt.impl == "triton", opt.impl
        x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
        opt.backward(model(x).float().square().mean())
        opt.step()
        del x
        gc.collect()
        torch.cuda.synchronize()
        got = (torch.cuda.memory_allocated() - base) / n
        assert not opt.step_was_skipped
        assert abs(got - per_param) <= 0.05 * per_param, f"stage {stage}, {masters}: {got:.2f} B/param"
        del opt, inner, model, layers


@pytest.mark.gpu
@pytest.mark.parametrize("masters", ["fp32", "split"])
def test_fused_over_fsdp2_shards_on_nccl_matches_the_unsharded_fused_optimizer(tmp_path, masters):
    """World size 1 on NCCL: the fused kernels (compiled, not interpreted; impl='auto' picks them) over
    ``fully_shard``'s bf16 shards against the same fused optimizer on the same model unsharded, bit for bit over
    20 unclipped steps with an inf at step 7 (the shards change nothing at one rank: FSDP2's reduce-scatter of a
    grad is the grad)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import halfprec
    from halfprec.optim import FusedAdamW

    torch.cuda.set_device(0)

    def model(mesh=None) -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(256, 1031), torch.nn.GELU(), torch.nn.Linear(1031, 257), torch.nn.Linear(257, 1)
        ).to("cuda", torch.bfloat16)
        if mesh is not None:
            for block in m:
                if next(block.parameters(), None) is not None:
                    fully_shard(block, mesh=mesh)
            fully_shard(m, mesh=mesh)
        return m

    with one_process_group("nccl", tmp_path / "store"):
        mesh = init_device_mesh("cuda", (1,))
        sharded, plain = model(mesh), model()
        a = halfprec.MixedPrecisionOptimizer(
            torch.optim.AdamW(sharded.parameters(), lr=1e-3), masters=masters
        )
        b = FusedAdamW(plain.parameters(), lr=1e-3, masters=masters)
        assert isinstance(a, FusedAdamW) and a.collective
        for step in range(20):
            x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            for opt, m in ((a, sharded), (b, plain)):
                opt.backward(m(x.bfloat16()).float().square().mean())
                if step == 7:
                    with torch.no_grad():
                        g = next(m.parameters()).grad
                        (g.to_local() if hasattr(g, "to_local") else g)[0, 0] = float("inf")
                opt.step()
                opt.zero_grad()
            assert a.step_was_skipped == b.step_was_skipped == (step == 7)
        for m, n in zip(a.master_params(), b.master_params(), strict=True):
            assert torch.equal(m, n)
        for p, q in zip(sharded.parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q)
        del a, b, sharded, plain
