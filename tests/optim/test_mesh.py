"""``optim/mesh.py``: DTensor params (FSDP2) as local shards, in one process (a gloo world of one); the multi-rank
behaviour (norms over the mesh, skips, HSDP, resharding) is ``tests/distributed/test_fsdp.py``'s."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import halfprec
from halfprec.optim.exact import ExactMixedPrecisionOptimizer
from halfprec.optim.mesh import Mesh, as_dtensor, is_dtensor, local, local_grad

from .helpers import mesh_of_one


@pytest.fixture
def mesh(tmp_path):
    with mesh_of_one(tmp_path / "store") as one:
        yield one


def _sharded(mesh, dtype=torch.bfloat16, **options) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1)).to(dtype)
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _loss(model, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model(x).float().square().mean()


def test_importing_halfprec_imports_no_dtensor():
    code = (
        "import sys, halfprec, halfprec.optim, halfprec.distributed\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plain_tensors_are_their_own_shards():
    p = torch.nn.Parameter(torch.ones(3))
    assert Mesh.of([p]) is None and not is_dtensor(p)
    assert local(p) is p and local_grad(p) is None
    p.grad = torch.ones(3)
    assert local_grad(p) is p.grad


def test_dtensor_params_have_a_mesh_rows_and_a_norm(mesh):
    model = _sharded(mesh)
    params = list(model.parameters())
    found = Mesh.of(params)
    assert found.counts and [found.rows(p) for p in params] == [(0, 7), (0, 7), (0, 1), (0, 1)]
    assert found.offset(params[2]) == 0
    shard = local(params[0])
    assert not is_dtensor(shard) and shard.data_ptr() == params[0].to_local().data_ptr()
    again = as_dtensor(params[0], shard)
    assert again.placements == params[0].placements and torch.equal(
        again.full_tensor(), params[0].full_tensor()
    )
    grads = [torch.full((2, 3), 0.5), torch.full((4,), 2.0)]
    norm, flag = found.norm_and_flag(grads, check=True, device=torch.device("cpu"))
    assert (
        norm.dtype == torch.float32 and norm.item() == torch.tensor(17.5).sqrt().item() and flag.item() == 0.0
    )
    grads[1][0] = float("inf")
    assert found.norm_and_flag(grads, check=True, device=torch.device("cpu"))[1].item() == 1.0
    assert found.norm_and_flag(grads, check=False, device=torch.device("cpu"))[1].item() == 0.0


def test_masters_are_plain_fp32_copies_of_the_shards_and_state_is_lazy(mesh):
    model = _sharded(mesh)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), max_grad_norm=1.0)
    assert isinstance(mp, ExactMixedPrecisionOptimizer)  # impl="auto" picks the exact strategy
    masters = mp.master_params()
    assert not any(map(is_dtensor, masters)) and len(mp.state) == 0
    for p, m in zip(model.parameters(), masters, strict=True):
        assert m.dtype == torch.float32 and torch.equal(m, local(p).float())
    mp.backward(_loss(model))
    mp.step()
    assert mp.grad_norm is not None and not mp.step_was_skipped and len(mp.state) == len(masters)
    for p, m in zip(model.parameters(), mp.master_params(), strict=True):
        assert torch.equal(local(p), m.to(torch.bfloat16))  # the step rounds the masters into the shards


def test_grad_marks_see_fsdps_in_place_accumulation(mesh):
    model = _sharded(mesh)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    mp.backward(_loss(model))
    mp.step()
    with pytest.raises(RuntimeError, match="without a new backward"):
        mp.step()
    grad = next(model.parameters()).grad
    mp.backward(_loss(model))  # FSDP2 adds into the same sharded grad, in place
    assert next(model.parameters()).grad is grad
    mp.step()


ERRORS = [
    ({"stage": 1}, r"stage=1 .* already sharded by fully_shard .* pass stage=0"),
    ({"process_group": "WORLD"}, r"FSDP2 already reduce-scatters: leave process_group=None"),
    (
        {"param_dtype": torch.bfloat16, "fp32": True},
        r"fp32 DTensor .* cannot recast them in place.*\(model\.to\(torch\.bfloat16\), before or after fully_shard",
    ),
    ({"param_dtype": torch.float16, "fp32": True}, r"param_dtype=torch\.float32"),
]


@pytest.mark.parametrize(
    ("options", "pattern"),
    ERRORS,
    ids=["stage", "process_group", "bf16-cast", "fp16-cast"],
)
def test_the_factory_refuses_what_cannot_apply_to_fsdp2_shards(mesh, options, pattern):
    options = dict(options)
    model = _sharded(mesh, torch.float32 if options.pop("fp32", False) else torch.bfloat16)
    if options.get("process_group") == "WORLD":
        options["process_group"] = dist.group.WORLD
    with pytest.raises(ValueError, match=pattern):
        halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), **options)
    if not {"stage", "impl", "masters"} & set(options):  # the strategy's own constructor says the same
        with pytest.raises(ValueError, match=pattern):
            ExactMixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), **options)


def test_an_optimizer_that_needs_whole_tensors_is_refused_on_shards(mesh):
    # Adafactor's factored moments of a 2-D param read whole rows and columns: stepping one rank's rows of it would
    # silently differ from stepping the param
    model = _sharded(mesh)
    for build in (halfprec.MixedPrecisionOptimizer, ExactMixedPrecisionOptimizer):
        with pytest.raises(ValueError, match="Adafactor is not a known elementwise optimizer.*FSDP2 shards"):
            build(torch.optim.Adafactor(model.parameters()))


def test_mixed_layouts_are_refused(mesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = _sharded(mesh)
    plain = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a plain tensor and others are DTensors.*fully_shard every module"):
        Mesh.of([*model.parameters(), plain])
    named = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    other = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), named, [Shard(0)]))
    with pytest.raises(ValueError, match="one optimizer per mesh"):
        Mesh.of([*model.parameters(), other])
    columns = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"Shard\(dim=1\).*tensor parallel layouts are not supported"):
        Mesh.of([columns])
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()]))
    assert Mesh.of([replicated]).rows(replicated) == (0, 4)


def test_state_of_a_stepped_torch_optimizer_moves_onto_the_local_masters(mesh):
    model = _sharded(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _loss(model).backward()
    opt.step()
    before = {i: local(opt.state[p]["exp_avg"]).clone() for i, p in enumerate(model.parameters())}
    mp = halfprec.MixedPrecisionOptimizer(opt)
    for i, m in enumerate(mp.master_params()):
        state = mp.state[m]
        assert not is_dtensor(state["exp_avg"]) and state["exp_avg"].dtype == torch.float32
        assert torch.equal(state["exp_avg"], before[i].float()) and float(state["step"]) == 1.0


def test_the_shards_are_found_again_after_fsdp2_gives_them_new_storage(mesh):
    model = _sharded(mesh)
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.to_empty(device="cpu")  # the same Parameters, new local storage
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0.25)
    mp.refresh_masters()
    assert all(torch.equal(m, torch.full_like(m, 0.25)) for m in mp.master_params())
    mp.backward(_loss(model))
    mp.step()
    for p, m in zip(model.parameters(), mp.master_params(), strict=True):
        assert torch.equal(p.to_local(), m.to(torch.bfloat16))
        assert not torch.equal(m, torch.full_like(m, 0.25))


def test_the_interpreter_refusal_covers_exactly_the_shards_written_in_place(mesh, monkeypatch):
    """``chunk.interpreter_reason``, read by the policy (auto) and the fused constructor: under Triton's interpreter
    only 16-bit shards off the CPU are refused (the kernels reach them by address; the interpreter copies a
    launch's arguments to the host); fp32 shards are staged in a flat buffer, CPU shards are where they are. A
    meta-device shard stands in for a CUDA one."""
    from torch.distributed.tensor import DTensor, Shard

    from halfprec.optim.chunk import interpreter_reason, written_in_place
    from halfprec.optim.policy import fused_unsupported_reason

    def shard(dtype, device):
        local_rows = torch.zeros(4, 3, dtype=dtype, device=device)
        return torch.nn.Parameter(DTensor.from_local(local_rows, mesh, [Shard(0)], run_check=False))

    bf16_off_cpu, fp32_off_cpu = shard(torch.bfloat16, "meta"), shard(torch.float32, "meta")
    assert written_in_place(bf16_off_cpu) and not written_in_place(fp32_off_cpu)
    assert not written_in_place(torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reason = interpreter_reason([fp32_off_cpu, bf16_off_cpu])
    assert reason is not None and "copies meta tensors to the host" in reason
    assert interpreter_reason([fp32_off_cpu, shard(torch.bfloat16, "cpu")]) is None
    refused = fused_unsupported_reason(
        torch.optim.AdamW([bf16_off_cpu]), explicit=True, instead="impl='torch'"
    )
    assert refused == f"{reason}: unset TRITON_INTERPRET or use impl='torch'"
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter_reason([bf16_off_cpu]) is None
