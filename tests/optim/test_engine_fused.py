"""The engine on the fused path (``impl="triton"``; the interpreter on CPU): steps, records, schedule holding,
checkpoints that resume bit-exactly and move to the torch path. (On CUDA ``impl="auto"`` picks this path.)"""

from __future__ import annotations

import pytest
import torch

from halfprec.optim import FusedAdamW
from tests.engine_util import build, train

from ..tolerances import tol

# CPU params through Triton's interpreter; on a GPU machine tests/optim/test_gpu.py runs the engine on CUDA
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")


def _flat(engine) -> dict:
    sd = engine.optimizer.state_dict()
    return {
        "weights": {k: v.clone() for k, v in engine.module.state_dict().items()},
        "state": sd["optimizer"]["state"],
        "masters": sd["masters"],
        "scaler": sd["scaler"],
        "lr": [g["lr"] for g in engine.optimizer.param_groups],
        "counters": [engine.global_step, engine.micro_step, engine.skipped_steps],
    }


def _equal(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"] and a["lr"] == b["lr"] and a["scaler"] == b["scaler"]
    for k, v in a["weights"].items():
        assert torch.equal(v, b["weights"][k]), k
    for k, v in a["masters"].items():
        assert torch.equal(v, b["masters"][k]), k
    assert a["state"].keys() == b["state"].keys()
    for k, st in a["state"].items():
        for key, v in st.items():
            assert torch.equal(v, b["state"][k][key]), (k, key)


@pytest.mark.parametrize("gas", [1, 2])
def test_engine_runs_the_fused_path_like_the_torch_path(gas):
    fused = build("fp16", gas, impl="triton")
    ref = build("fp16", gas, impl="torch")
    assert isinstance(fused.optimizer, FusedAdamW)
    losses_f = train(fused, 4, inject_inf_at=(1,))
    losses_t = train(ref, 4, inject_inf_at=(1,))
    torch.testing.assert_close(losses_f, losses_t, **tol("fused_engine_loss", torch.float16))
    assert fused.last_record.skipped is False and fused.skipped_steps == ref.skipped_steps == 1
    assert fused.last_record.loss_scale == ref.last_record.loss_scale
    torch.testing.assert_close(fused.last_record.grad_norm, ref.last_record.grad_norm, **tol("grad_norm"))
    assert fused.lr_scheduler.last_epoch == ref.lr_scheduler.last_epoch == 3  # held on the skip
    assert [g["lr"] for g in fused.optimizer.param_groups] == [g["lr"] for g in ref.optimizer.param_groups]
    a, b = _flat(fused), _flat(ref)
    for k, v in a["masters"].items():
        torch.testing.assert_close(v, b["masters"][k], **tol("fused_master", torch.float16))


def test_records_taken_at_each_step_keep_that_step_when_read_later():
    # the fused step's record stays on the device until read: every step's record, read after the run, is that
    # step's (the torch path's records hold host values)
    runs = {impl: build("fp16", impl=impl) for impl in ("triton", "torch")}
    records = {impl: [] for impl in runs}
    for step in range(4):
        for impl, engine in runs.items():
            train(engine, 1, inject_inf_at=(1,) if step == 1 else ())
            records[impl].append(engine.last_record)
    fused, exact = records["triton"], records["torch"]
    assert [r.skipped for r in fused] == [r.skipped for r in exact] == [False, True, False, False]
    assert [(r.step, r.loss_scale) for r in fused] == [(r.step, r.loss_scale) for r in exact]
    for got, want in zip(fused, exact, strict=True):
        torch.testing.assert_close(got.grad_norm, want.grad_norm, **tol("grad_norm"))


def test_engine_fused_checkpoint_resumes_bit_exactly_and_loads_on_the_torch_path(tmp_path):
    engine = build("fp16", 2, impl="triton")
    train(engine, 3, inject_inf_at=(1,))
    engine.save_checkpoint(tmp_path)
    train(engine, 2)
    uninterrupted = _flat(engine)

    resumed = build("fp16", 2, seed=123, impl="triton")
    resumed.load_checkpoint(tmp_path)
    train(resumed, 2)
    _equal(_flat(resumed), uninterrupted)

    exact = build("fp16", 2, seed=123, impl="torch")  # same format: the checkpoint moves between the paths
    exact.load_checkpoint(tmp_path)
    train(exact, 2)
    got = _flat(exact)
    assert got["counters"] == uninterrupted["counters"]
    for k, v in uninterrupted["masters"].items():
        torch.testing.assert_close(got["masters"][k], v, **tol("fused_master", torch.float16))


def test_fused_check_state_dict_names_the_first_mismatching_param():
    a = [torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(5))]
    b = [torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(6))]
    saved = FusedAdamW(a).state_dict()
    with pytest.raises(
        ValueError, match=r"at param 1: saved shape \[5\] dtype torch.float32, this model shape \[6\]"
    ):
        FusedAdamW(b).check_state_dict(saved)
    with pytest.raises(ValueError, match=r"not a FusedAdamW state dict: format None"):
        FusedAdamW(b).check_state_dict({"state": {}, "param_groups": []})


def test_deferred_grad_norm_is_the_steps_norm_on_both_strategies():
    # step_results().grad_norm_deferred (what the HF link hands the Trainer): a device tensor on the fused path,
    # taken without waiting and read after later steps, the float on the exact path; both the step's grad_norm
    runs = {impl: build("fp16", impl=impl) for impl in ("triton", "torch")}
    taken = {impl: [] for impl in runs}
    for _ in range(3):
        for impl, engine in runs.items():
            train(engine, 1)
            results = engine.optimizer.step_results()
            taken[impl].append((results.grad_norm_deferred, results.grad_norm))
    assert all(torch.is_tensor(d) and d.shape == () for d, _ in taken["triton"])
    assert all(isinstance(d, float) and d == n for d, n in taken["torch"])
    for (fused, fused_norm), (_, exact_norm) in zip(taken["triton"], taken["torch"], strict=True):
        assert float(fused) == fused_norm
        torch.testing.assert_close(fused_norm, exact_norm, **tol("grad_norm"))
