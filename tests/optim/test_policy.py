"""The impl policy: when the fused kernels can take an optimizer (``select_impl``)."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.policy import select_impl


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
