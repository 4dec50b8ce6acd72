"""World-size-1 NCCL smoke test on a CUDA device (run on the GPU machine: ``pytest -m gpu tests/distributed``)."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import launch, results


@pytest.mark.gpu
def test_nccl_world_size_one_matches_unsharded_and_checkpoints(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("HALFPREC_TEST_BACKEND", "nccl")
    monkeypatch.setenv("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
    launch(1, "gpu", tmp_path, steps=5, timeout=300)
    (res,) = results(tmp_path, 1)
    for stage in (1, 2):
        assert res[stage]["same_params"], stage
        assert res[stage]["same_masters_in_checkpoint"], stage
        assert res[stage]["reloaded"], stage
        fused = res[stage]["fused"]
        assert fused["impl"] == "triton", fused  # impl='auto' on CUDA with default AdamW flags
        assert fused["steps_equal"] and fused["params_are_masters_rounded"], fused
        assert fused["master_diff"] < 2e-5 and fused["state_diff"] < 1e-6, fused  # tests/optim/tolerances.py
