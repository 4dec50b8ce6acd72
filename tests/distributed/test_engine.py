"""The engine at ZeRO-1/2 on 2 gloo ranks: checkpoint directories that resume bit-exactly and export."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))

from _compare import assert_equal  # noqa: E402
from _launch import launch, results  # noqa: E402

from halfprec.cli.main import main  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("stage,gas", [(1, 2), (2, 1)])
def test_sharded_engine_checkpoint_resumes_and_exports(tmp_path, stage, gas):
    launch(2, "engine_ckpt", tmp_path, stage=stage, gas=gas, first=3, more=3)
    res = results(tmp_path, 2)
    for rank, r in enumerate(res):
        where = f"rank {rank}, stage {stage}, gas {gas}"
        assert r["again"] == r["full"], (
            f"{where}: losses after resume {r['again']}, uninterrupted {r['full']}"
        )
        assert_equal(r["resumed_weights"], r["weights"], f"{where}: resumed vs uninterrupted weights")
        # [global_step, skipped_steps] of the uninterrupted and the resumed engine; the rank-1 overflow, once
        assert r["counters"][:2] == r["counters"][2:] and r["counters"][1] == 1, f"{where}: {r['counters']}"
        assert r["lr"][0] == r["lr"][1] and r["scale"][0] == r["scale"][1], (
            f"{where}: lr {r['lr']}, {r['scale']}"
        )
        assert r["client"] == {"rank0_pos": 7}, where
    ck = Path(res[0]["path"])
    assert (
        (ck / "optimizer" / ".metadata").exists()
        and (ck / "rng-0.pt").exists()
        and (ck / "rng-1.pt").exists()
    )
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step-3"
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "ck"), "--out", str(out)]) == 0
    exported = load_file(str(out))
    w = exported["fc1.weight"]
    assert w.dtype == torch.float32 and w.shape == (13, 7)
    assert not torch.equal(w, w.half().float())  # the fp32 masters, not the fp16 weights
