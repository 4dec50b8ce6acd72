"""The one factory: every option validated the same way before a strategy is chosen, on every machine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import halfprec
from halfprec.distributed import ShardedMixedPrecisionOptimizer
from halfprec.optim import ExactMixedPrecisionOptimizer, FusedAdagrad, FusedAdamW, FusedSGD, build
from halfprec.optim.select import fused_from_torch

from .helpers import DEVICE, world_of_one


def _p(dtype=torch.bfloat16, device="cpu"):
    return [torch.nn.Parameter(torch.zeros(4, dtype=dtype, device=device))]


# (options, error regex): refused before any strategy is chosen, so the same on a CPU and on a GPU
BAD_OPTIONS = [
    (dict(impl="cuda"), r"impl must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
    (dict(stage=3), r"stage must be one of \(0, 1, 2\) \(the ZeRO stage\), got 3"),
    (dict(stage=True), r"stage must be one of .*, got True"),
    (dict(masters="bf16"), r"masters must be one of \('fp32', 'split'\), got 'bf16'"),
    (dict(masters="split", impl="torch"), r"masters='split' is kept by the fused kernels, and impl='torch'"),
    (dict(reduce_dtype="param"), r"reduce_dtype='param' applies to the sharded strategy .*stage is 0"),
    (dict(bucket_size=64), r"bucket_size=64 applies to the sharded strategy"),
    (dict(named_parameters=[]), r"named_parameters=\[\] applies to the sharded strategy"),
    (dict(stage=1), r"stage=1 needs named_parameters=model"),
    (
        dict(grad_accum_dtype=torch.float32),
        r"grad_accum_dtype must be one of \('param', 'fp32'\), got torch.float32; use 'fp32'",
    ),
    (
        dict(grad_accum_dtype=None),
        r"grad_accum_dtype must be one of \('param', 'fp32'\), got None; use 'param'",
    ),
    (dict(grad_accum_dtype="auto"), r"grad_accum_dtype must be one of \('param', 'fp32'\), got 'auto'$"),
    (dict(max_grad_norm=-1.0), r"max_grad_norm"),
    (
        dict(loss_scaler=2.0),
        r"loss_scaler must be a halfprec StaticLossScaler or DynamicLossScaler, got float",
    ),
    (dict(process_group="world"), r"process_group='world' but torch.distributed is not initialised"),
    # one spelling of the 16-bit dtype: a name is refused with the dtype to pass
    (dict(param_dtype="bf16"), r"param_dtype must be .*, got 'bf16'; use param_dtype=torch.bfloat16$"),
    (dict(param_dtype="half"), r"got 'half'; use param_dtype=torch.float16$"),
]


@pytest.mark.parametrize(("options", "match"), BAD_OPTIONS)
@pytest.mark.parametrize("entry", [build, halfprec.MixedPrecisionOptimizer])
def test_bad_options_are_refused_with_the_value_and_the_fix(entry, options, match):
    params = _p()
    with pytest.raises(ValueError, match=match):
        entry(torch.optim.AdamW(params), **options)
    assert params[0].dtype == torch.bfloat16 and params[0].grad is None  # nothing was cast or changed


def test_split_masters_off_cuda_is_a_value_error_that_names_why():
    # the same script fails the same way on every machine without the fused kernels (no TypeError); impl='triton'
    # would take the CPU params here, under the Triton interpreter these tests run in
    with pytest.raises(ValueError, match=r"masters='split' runs on the fused kernels.*CUDA.*masters='fp32'"):
        halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_p()), masters="split")


def test_split_masters_refuse_fp16_params_before_anything_else():
    with pytest.raises(ValueError, match=r"masters='split' keeps exact fp32 masters only for bf16 params"):
        build(torch.optim.AdamW(_p(torch.float16)), masters="split", impl="torch")


def test_the_factory_picks_the_exact_strategy_off_cuda():
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_p()), impl="auto", max_grad_norm=1.0)
    assert type(mp) is ExactMixedPrecisionOptimizer and mp.max_grad_norm == 1.0
    assert isinstance(mp, halfprec.MixedPrecisionOptimizer) and isinstance(mp, torch.optim.Optimizer)


def test_the_factory_picks_the_sharded_strategy_for_stage_1_and_2(tmp_path):
    with world_of_one(tmp_path / "store"):
        for stage in (1, 2):
            model = torch.nn.Linear(3, 2).bfloat16()
            mp = halfprec.MixedPrecisionOptimizer(
                torch.optim.AdamW(model.parameters()), stage=stage, named_parameters=model, impl="torch",
                reduce_dtype="param", bucket_size=128,
            )  # fmt: skip
            assert type(mp) is ShardedMixedPrecisionOptimizer and mp.stage == stage
            assert mp.reduce_dtype == "param" and mp.model_params() == list(model.parameters())


def test_fused_kernels_under_the_interpreter_are_picked_by_impl_triton():
    # TRITON_INTERPRET=1 lets impl='triton' take CPU params (the kernels' CPU tests); 'auto' never does off CUDA
    ps = _p(torch.float16, DEVICE)
    assert isinstance(build(torch.optim.AdamW(ps), impl="triton"), FusedAdamW)


@pytest.mark.parametrize(
    ("factory", "cls"),
    [
        (
            lambda ps: torch.optim.AdamW(
                [{"params": ps[:1], "lr": 0.5}, {"params": ps[1:]}],
                lr=0.1,
                betas=(0.8, 0.9),
                weight_decay=0.3,
            ),
            FusedAdamW,
        ),
        (lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.5, nesterov=True), FusedSGD),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.3, initial_accumulator_value=0.1), FusedAdagrad),
    ],
)
def test_fused_from_torch_copies_groups(factory, cls):
    ps = [torch.nn.Parameter(torch.randn(5, device=DEVICE).half()) for _ in range(2)]
    inner = factory(ps)
    want = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    fused = fused_from_torch(inner, max_grad_norm=1.0)
    assert type(fused) is cls
    assert [{k: v for k, v in g.items() if k != "params"} for g in fused.param_groups] == want
    assert fused.max_grad_norm == 1.0
    assert [p for g in fused.param_groups for p in g["params"]] == ps


def test_importing_halfprec_optim_does_not_import_triton():
    code = "import sys, halfprec, halfprec.optim, halfprec.optim.select; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
def test_mixed_precision_optimizer_factory_takes_the_fused_path_on_cuda():
    opt = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(_p(torch.float16, "cuda"), lr=0.5), impl="auto", max_grad_norm=1.0
    )
    assert isinstance(opt, FusedAdamW) and opt.param_groups[0]["lr"] == 0.5
    assert isinstance(opt, halfprec.MixedPrecisionOptimizer)  # every strategy is the public class
    split = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_p(torch.bfloat16, "cuda")), masters="split")
    assert isinstance(split, FusedAdamW) and split.masters == "split"


def test_split_masters_with_an_optimizer_without_kernels_name_the_fix_that_works():
    # impl='torch' would be refused with split masters: the fix named is the masters', not the impl's
    with pytest.raises(ValueError, match=r"RMSprop has no fused kernel .*; use masters='fp32'") as refused:
        build(torch.optim.RMSprop(_p()), masters="split", impl="triton")
    assert "impl='torch'" not in str(refused.value)


# refused the same way whichever stage is asked for: (options, error), off CUDA on a one-rank gloo world
AT_EVERY_STAGE = [
    (
        dict(process_group="x", impl="torch"),
        r"process_group must be a torch.distributed.ProcessGroup .*got str",
    ),
    # impl='auto': the reason and the fix the user can act on, not the impl the strategy resolved
    (dict(masters="split"), r"masters='split' runs on the fused kernels.*CUDA.*masters='fp32'"),
    (dict(masters="split", impl="torch"), r"masters='split' is kept by the fused kernels, and impl='torch'"),
]


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize(("options", "match"), AT_EVERY_STAGE)
def test_options_are_refused_the_same_way_at_every_stage(stage, options, match, tmp_path):
    with world_of_one(tmp_path / "store"):
        model = torch.nn.Linear(3, 2).bfloat16()
        sharded = dict(named_parameters=model) if stage else {}
        with pytest.raises(ValueError, match=match):
            build(torch.optim.AdamW(model.parameters()), stage=stage, **options, **sharded)
