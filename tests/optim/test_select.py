"""select_impl policy and fused_from_torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from halfprec.optim import FusedAdagrad, FusedAdamW, FusedSGD
from halfprec.optim.select import fused_from_torch, select_impl

from .helpers import DEVICE


def _p(device="cpu"):
    return [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16, device=device))]


CPU_CASES = [  # (optimizer factory, impl, expected)
    (lambda: torch.optim.AdamW(_p()), "torch", "torch"),
    (lambda: torch.optim.AdamW(_p()), "auto", "torch"),  # params on CPU
    (lambda: torch.optim.RMSprop(_p()), "auto", "torch"),
]


@pytest.mark.parametrize(("factory", "impl", "expected"), CPU_CASES)
def test_select_impl_cpu(factory, impl, expected):
    assert select_impl(factory(), impl) == expected


TRITON_ERRORS = [
    (lambda: torch.optim.RMSprop(_p()), r"RMSprop has no fused kernel"),
    (lambda: torch.optim.AdamW(_p(), amsgrad=True), r"amsgrad=True"),
    (lambda: torch.optim.AdamW(_p()), r"CUDA params"),
]


@pytest.mark.parametrize(("factory", "match"), TRITON_ERRORS)
def test_select_impl_triton_cannot_be_honoured(factory, match, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a real machine: CPU params are refused
    with pytest.raises(ValueError, match=r"impl='triton' cannot be honoured: .*" + match):
        select_impl(factory(), "triton")


def test_select_impl_triton_takes_cpu_params_only_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_impl(torch.optim.AdamW(_p()), "triton") == "triton"
    assert select_impl(torch.optim.AdamW(_p()), "auto") == "torch"  # auto never picks the interpreter


def test_select_impl_rejects_unknown():
    with pytest.raises(ValueError, match=r"impl must be one of"):
        select_impl(torch.optim.AdamW(_p()), "cuda")


@pytest.mark.gpu
def test_select_impl_gpu_policy():
    assert select_impl(torch.optim.AdamW(_p("cuda")), "auto") == "triton"
    assert select_impl(torch.optim.AdamW(_p("cuda"), foreach=True), "auto") == "torch"
    assert select_impl(torch.optim.AdamW(_p("cuda"), fused=True), "auto") == "torch"
    assert select_impl(torch.optim.AdamW(_p("cuda"), fused=True), "triton") == "triton"
    assert select_impl(torch.optim.SGD(_p("cuda"), lr=0.1), "auto") == "triton"


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


def test_mixed_precision_optimizer_factory_takes_the_torch_path_off_cuda():
    import halfprec

    opt = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(_p()), impl="auto", max_grad_norm=1.0)
    assert isinstance(opt, halfprec.MixedPrecisionOptimizer) and opt.max_grad_norm == 1.0


@pytest.mark.gpu
def test_mixed_precision_optimizer_factory_takes_the_fused_path_on_cuda():
    import halfprec

    opt = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(_p("cuda"), lr=0.5), impl="auto", max_grad_norm=1.0
    )
    assert isinstance(opt, FusedAdamW) and opt.param_groups[0]["lr"] == 0.5
    assert isinstance(opt, halfprec.MixedPrecisionOptimizer)  # every strategy is the public class
