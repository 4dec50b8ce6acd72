"""The engine over FSDP2: ``Config(zero_stage=3)`` shards the model itself, a model the user sharded trains as it
is, and checkpoints gather the weights whole and reshard (``_engine_fsdp.py``: one launch on 2 gloo ranks that
saves, one on 3 and one on 4 that load; world size 1 in this process)."""

from __future__ import annotations

import re
from pathlib import Path

import _engine_fsdp as worker
import _launch
import pytest
import torch
from _compare import assert_equal
from safetensors.torch import load_file
from tests.tolerances import tol

import halfprec
from halfprec.cli.main import main
from halfprec.optim.mesh import is_dtensor

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="gloo on CPU")

WORKER = Path(__file__).with_name("_engine_fsdp.py")


def _launch_worker(world: int, scenario: str, out: Path, **kwargs) -> list:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_launch, "WORKER", WORKER)
        _launch.launch(world, scenario, out, timeout=240.0, **kwargs)
    return _launch.results(out, world)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_fsdp")
    return out, _launch_worker(2, "save", out)


def _whole(saved) -> dict:
    return torch.load(saved[0] / "whole.pt", weights_only=True)


@pytest.mark.slow
def test_zero_stage_3_shards_each_block_then_the_root_in_16_bits(saved):
    for rank, r in enumerate(saved[1]):
        assert r["sharded_modules"] == ["", "layers.0", "layers.1"], rank
        assert r["dtensor_params"] and r["param_dtypes"] == ["torch.bfloat16"], rank
        assert r["buffer_dtype"] == "torch.bfloat16", rank
        assert r["optimizer_over_the_shards"], rank


@pytest.mark.slow
def test_zero_stage_3_masters_are_the_fp32_weights_not_their_rounding(saved):
    for rank, r in enumerate(saved[1]):
        assert r["some_master_not_bf16"]
        assert r["masters_are_fp32_originals"], rank
        assert r["params_are_rounded_masters"], rank


@pytest.mark.slow
def test_zero_stage_3_steps_as_its_policy_written_out_by_hand(saved):
    for rank, r in enumerate(saved[1]):
        assert r["full"]["losses"] == r["by_hand"]["losses"], rank
        assert_equal(r["full"]["state"], r["by_hand"]["state"], f"rank {rank}: engine vs by hand")
        assert_equal(r["full"]["weights"], r["by_hand"]["weights"], f"rank {rank}: weights")


@pytest.mark.slow
def test_resume_at_world_size_2_equals_the_uninterrupted_run_bit_for_bit(saved):
    more = worker.MORE * worker.GAS
    for rank, r in enumerate(saved[1]):
        assert r["resumed"]["losses"] == r["full"]["losses"][-more:], rank
        assert_equal(r["resumed"]["state"], r["full"]["state"], f"rank {rank}: resumed masters and state")
        assert_equal(r["resumed"]["weights"], r["full"]["weights"], f"rank {rank}: resumed weights")
        assert r["counters"][0] == r["counters"][1] and r["lr"][0] == r["lr"][1], rank
        assert r["client"] == {"note": 7}


@pytest.mark.slow
def test_a_model_the_user_sharded_in_bf16_trains_with_fp32_sums(saved):
    for rank, r in enumerate(saved[1]):
        assert_equal(r["user"]["engine"], r["user"]["optimizer"], f"rank {rank}: engine vs optimizer")


REFUSALS = [
    ("fp16_shards", r"param 'inp.weight' is torch.float16 but precision='bf16'; pass the model in fp32"),
    ("sharded_twice", r"sharded already \(fully_shard, DTensor params\): pass zero_stage=0"),
    ("sub_mesh", r"mesh of 1 rank.*default process group of 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "pattern"), REFUSALS, ids=[c for c, _ in REFUSALS])
def test_refusals_over_two_ranks(saved, case, pattern):
    for r in saved[1]:
        kind, message = r["refusals"][case]
        assert kind == "ValueError" and re.search(pattern, message, re.S), (kind, message)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_the_checkpoint_loads_at_another_world_size(saved, tmp_path, world):
    whole = _whole(saved)
    for rank, r in enumerate(_launch_worker(world, "load", tmp_path, ck=saved[1][0]["path"])):
        assert r["global_step"] == worker.FIRST
        assert_equal(r["state"], whole["state"], f"rank {rank} of {world}: masters and state")
        assert_equal(r["weights"], whole["weights"], f"rank {rank} of {world}: weights")


@pytest.mark.slow
def test_the_checkpoint_loads_at_world_size_1_sharded_and_not(saved, one_rank):
    whole = _whole(saved)
    engine = worker.stage3_engine(seed=1)
    assert all(is_dtensor(p) for p in engine.module.parameters())
    engine.load_checkpoint(saved[1][0]["path"])
    assert_equal(worker.gathered(engine.optimizer, engine.module), whole["state"], "world 1, zero_stage=3")
    assert_equal(worker.whole_weights(engine.module), whole["weights"], "world 1, zero_stage=3: weights")
    model = worker.Net(seed=1)
    plain = halfprec.initialize(
        model, torch.optim.AdamW(model.parameters()), precision="bf16", gradient_accumulation_steps=2
    )
    plain.load_checkpoint(saved[1][0]["path"])
    assert_equal(worker.gathered(plain.optimizer, model), whole["state"], "world 1, unsharded")
    assert_equal(model.state_dict(), whole["weights"], "world 1, unsharded: weights")


@pytest.mark.slow
def test_export_and_inspect_read_the_fp32_masters(saved, tmp_path, capsys):
    whole = _whole(saved)
    ck = Path(saved[1][0]["path"])
    out = tmp_path / "model.safetensors"
    assert main(["export", str(ck.parent), "--out", str(out)]) == 0
    exported = load_file(str(out))
    masters = {k.removeprefix("master/"): v for k, v in whole["state"].items() if k.startswith("master/")}
    assert_equal({k: exported[k] for k in masters}, masters, "exported")
    assert exported["shift"].dtype == torch.float32
    assert main(["inspect", str(ck)]) == 0
    assert "global_step" in capsys.readouterr().out


def test_zero_stage_3_needs_a_process_group():
    model = worker.Net()
    with pytest.raises(ValueError, match=r"zero_stage=3 .*init_process_group"):
        halfprec.initialize(model, torch.optim.AdamW(model.parameters()), zero_stage=3)


def test_a_model_without_a_module_list_is_sharded_per_child_with_params_in_fp16(one_rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = halfprec.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", zero_stage=3
    )
    sharded = [
        n for n, m in engine.module.named_modules() if isinstance(m, torch.distributed.fsdp.FSDPModule)
    ]
    assert sharded == ["", "0", "2"]
    masters = {k.removeprefix("master/"): v for k, v in worker.gathered(engine.optimizer, model).items()}
    assert_equal(masters, fp32, "fp16 shards' masters")
    engine.backward(engine(torch.randn(3, 4)).float().pow(2).mean())
    record = engine.step()
    assert record.loss_scale == 2.0**16 and not record.skipped


@pytest.mark.slow
def test_zero_stage_3_with_the_fused_strategy_trains_and_resumes_bit_exactly(saved):
    for rank, r in enumerate(saved[1]):
        fused = r["fused"]
        assert fused["type"] == "FusedAdamW", rank
        assert fused["masters_start_from_fp32"], rank  # the fp32 weights, not their rounding
        # the exact strategy on the same run: the fused update rounds otherwise (tests/tolerances.py)
        torch.testing.assert_close(
            torch.tensor(fused["losses"]),
            torch.tensor(fused["exact_losses"]),
            **tol("fused_engine_loss", torch.float16),
        )
        assert fused["resumed_losses"] == fused["losses"][-len(fused["resumed_losses"]) :], rank
        assert fused["resumed_masters_equal"] and fused["resumed_weights_equal"], rank


@pytest.mark.parametrize("stepped", [False, True])
def test_zero_stage_3_takes_an_optimizer_holding_state(one_rank, stepped):
    """Adagrad makes its state in its constructor, and a stepped optimizer holds some: at zero_stage=3 it follows
    its params onto their rows. At world size 1 the rows are the params: the same as zero_stage=0, bit for bit."""

    def engine(stage: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25)
        if stepped:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
        return halfprec.initialize(model, opt, precision="bf16", zero_stage=stage)

    sharded, plain = engine(3), engine(0)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for e in (sharded, plain):
            e.backward(e(x).float().pow(2).mean())
            e.step()
    a = worker.gathered(sharded.optimizer, sharded.module)
    b = {k: v for k, v in worker.gathered(plain.optimizer, plain.module).items()}
    assert_equal(a, b, "zero_stage=3 against 0, Adagrad")
    assert float(next(iter(sharded.optimizer.state.values()))["step"]) == 2.0 + stepped


@pytest.mark.slow
def test_a_model_the_user_sharded_in_fp32_is_cast_with_masters_from_its_fp32_rows(saved):
    for rank, r in enumerate(saved[1]):
        plain, frozen = r["user_fp32"]
        for run in (plain, frozen):
            assert run["dtypes"] == ["torch.bfloat16"] and run["dtensors"], rank
            assert run["masters_from_fp32"] and run["losses_finite"], rank
        assert (plain["trained"], frozen["trained"]) == (12, 10), rank  # the frozen layer has no master
