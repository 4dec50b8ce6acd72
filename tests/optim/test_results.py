"""``halfprec.optim.results``: the warnings every strategy shares, said once and on the user's line.

Two silent mistakes (issue 21, item 5): in fp16 a plain ``loss.backward()`` followed by ``step()`` trains on
grads ``loss_scale`` times too small; wrapping an fp32 model without ``param_dtype`` quietly trains in fp32.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdamW

SCALED = "after a backward that was not loss-scaled"
FP32 = "every trained param is torch.float32"


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(dtype)


def _loss(model):
    x = torch.randn(4, 8).to(next(model.parameters()).dtype)
    return model(x).float().square().mean()


def _caught(run) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if "halfprec" in str(w.message)]


def _exact(model, **kw):
    return halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), impl="torch", **kw)


def _fused(model, **kw):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return FusedAdamW(model.parameters(), lr=1e-3, **kw)


@pytest.mark.parametrize("build", [_exact, _fused], ids=["exact", "fused"])
def test_plain_backward_in_fp16_warns_once_on_the_user_line(build):
    model = _model()
    mp = build(model, param_dtype=torch.float16)

    def plain_steps():
        for _ in range(3):
            _loss(model).backward()
            mp.step()
            mp.zero_grad()

    caught = _caught(plain_steps)
    assert [SCALED in str(w.message) for w in caught] == [True], [str(w.message) for w in caught]
    assert "65536" in str(caught[0].message) and "mp.backward(loss)" in str(caught[0].message)
    assert caught[0].filename == __file__  # attributed to the loop, not to halfprec's step


@pytest.mark.parametrize("build", [_exact, _fused], ids=["exact", "fused"])
@pytest.mark.parametrize("how", ["backward", "scale_loss", "closure"])
def test_scaled_backward_does_not_warn(build, how):
    model = _model()
    mp = build(model, param_dtype=torch.float16)

    def steps():
        for _ in range(3):
            if how == "backward":
                mp.backward(_loss(model))
            elif how == "scale_loss":
                mp.scale_loss(_loss(model)).backward()
            if how == "closure":
                mp.step(lambda: mp.backward(_loss(model)))
            else:
                mp.step()
            mp.zero_grad()

    assert _caught(steps) == []


def test_no_loss_scale_no_warning():
    model = _model()
    mp = _exact(model, param_dtype=torch.bfloat16)

    def steps():
        _loss(model).backward()  # bf16 has no loss scale: a plain backward is right
        mp.step()

    assert _caught(steps) == []


def test_fp32_model_without_param_dtype_warns():
    model = _model()
    caught = _caught(lambda: _exact(model))
    assert len(caught) == 1 and FP32 in str(caught[0].message)
    assert "param_dtype=torch.bfloat16" in str(caught[0].message) and caught[0].filename == __file__
    fused = _caught(lambda: _fused(_model()))
    assert len(fused) == 1 and FP32 in str(fused[0].message) and fused[0].filename == __file__


def test_fp32_on_purpose_casts_nothing_and_does_not_warn():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    caught = _caught(lambda: _exact(model, param_dtype=torch.float32))
    assert caught == []
    assert all(p.dtype == torch.float32 and torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    other = _model()
    engine_caught = _caught(
        lambda: halfprec.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), precision="fp32")
    )
    assert [str(w.message) for w in engine_caught if FP32 in str(w.message)] == []


def test_16bit_model_does_not_warn():
    model = _model(torch.bfloat16)
    assert _caught(lambda: _exact(model)) == []


@pytest.mark.parametrize("bad", [torch.float64, torch.int8, "bf16"])
def test_param_dtype_error_names_the_choices(bad):
    with pytest.raises(ValueError, match=r"param_dtype must be torch.float16, torch.bfloat16, torch.float32 or None"):
        _exact(_model(), param_dtype=bad)
