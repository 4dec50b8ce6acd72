"""What a step leaves behind (``halfprec.optim.results``): grad marks that tell a new backward from grads already
consumed, the skip log's one line per skip and one warning at the minimum scale.

Two silent mistakes, warned once each on the user's line: in fp16 a plain ``loss.backward()``
followed by ``step()`` trains on grads ``loss_scale`` times too small; wrapping an fp32 model without
``param_dtype`` quietly trains in fp32.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import types
import warnings

import pytest
import torch

import halfprec
from halfprec.optim import FusedAdamW
from halfprec.optim.results import Delivered, GradMarks, ScaleGuard, SkipLog, StepState


def _params(n: int = 3) -> list[torch.nn.Parameter]:
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(n)]
    for p in ps[:-1]:
        p.grad = torch.ones(4)
    return ps  # the last one has no grad


def test_marks_hold_until_a_grad_changes_in_place():
    ps = _params()
    marks = GradMarks(ps)
    assert marks.same(ps)
    ps[0].grad.add_(1)  # a second backward accumulates in place
    assert not marks.same(ps)


def test_marks_see_a_new_grad_tensor_and_a_grad_appearing():
    ps = _params()
    marks = GradMarks(ps)
    ps[1].grad = torch.ones(4)
    assert not marks.same(ps)
    ps = _params()
    marks = GradMarks(ps)
    ps[2].grad = torch.ones(4)
    assert not marks.same(ps)


def test_marks_do_not_keep_freed_grads_alive():
    ps = _params()
    marks = GradMarks(ps)
    ps[0].grad = None  # zero_grad(): the grad is freed, not kept alive by the marks
    gc.collect()
    assert marks.marks[0][0]() is None
    ps[0].grad = torch.ones(4)  # a new grad, maybe at the freed one's address: not the one marked
    assert not marks.same(ps)


def test_step_state_starts_empty():
    s = StepState()
    assert (s.unscaled, s.grads, s.grad_norm, s.step_was_skipped, s.skipped_steps) == (
        False,
        [],
        None,
        False,
        0,
    )
    assert StepState().grads is not s.grads  # no list shared between optimizers


def test_skip_log_logs_every_skip_and_warns_once_at_the_minimum(caplog):
    log = SkipLog()
    with caplog.at_level(logging.WARNING, logger="halfprec"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.report(before=1024.0, after=512.0, skipped_so_far=1, at_min_scale=False)
        for n in (2, 3):
            log.report(before=1.0, after=1.0, skipped_so_far=n, at_min_scale=True, where=" on rank 0")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        "halfprec: step skipped, non-finite gradients or gradient norm (loss scale 1024 -> 512, 1 skipped so far)"
    )
    assert lines[2].endswith("on rank 0 (loss scale 1 -> 1, 3 skipped so far)") and len(lines) == 3
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(ours) == 1 and "minimum loss scale 1" in str(ours[0].message)


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
    return halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3), impl="torch", **kw
    )


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
    assert all(
        p.dtype == torch.float32 and torch.equal(p, b)
        for p, b in zip(model.parameters(), before, strict=True)
    )
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
    with pytest.raises(
        ValueError, match=r"param_dtype must be torch.float16 or torch.bfloat16 or torch.float32 \(or None\)"
    ):
        _exact(_model(), param_dtype=bad)


# Delivered (FSDP2 with fp32 sums): backwards against the hook calls FSDP2 made. torch 2.11's FSDP2 calls no hook
# under compiled autograd, so the error names that cause when its switch is on and no hook ran; else no-sync's.
# (torch version, torch._dynamo.config.compiled_autograd or None: dynamo never imported, hook calls, message)
NO_SYNC = r"2 backward\(\) calls .* of 0: a backward under model.set_requires_gradient_sync\(False\)"
COMPILED = (
    r"2 backward\(\) calls .* of 0: compiled autograd is on .* torch 2.11.0\+cu130's FSDP2 calls no "
    r"post-accumulate-grad hook .* Turn compiled autograd off, pass grad_accum_dtype='param'"
)
UNDELIVERED = [
    ("2.11.0+cu130", True, 0, COMPILED),
    ("2.11.0+cu130", False, 0, NO_SYNC),
    ("2.11.0+cu130", None, 0, NO_SYNC),
    ("2.12.0", True, 0, NO_SYNC),  # 2.12 and later always call the hooks
    ("2.13.0+cpu", True, 0, NO_SYNC),
    ("2.11.0+cu130", True, 1, r"of 1: a backward under model.set_requires_gradient_sync"),  # hooks did run
]


@pytest.mark.parametrize(("version", "switch", "fired", "message"), UNDELIVERED)
def test_undelivered_grads_name_their_cause(monkeypatch, version, switch, fired, message):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    config = None if switch is None else types.SimpleNamespace(compiled_autograd=switch)
    monkeypatch.setitem(sys.modules, "torch._dynamo.config", config)  # None: as if never imported
    guard = ScaleGuard()
    delivered = Delivered(guard)
    guard.mark()
    guard.mark()
    for _ in range(fired):
        delivered.fire("w")
    with pytest.raises(RuntimeError, match=message):
        delivered.check()


def test_delivered_grads_pass_and_the_count_restarts():
    guard = ScaleGuard()
    delivered = Delivered(guard)
    guard.mark()
    delivered.fire("w")
    delivered.check()
    guard.mark()  # the next accumulation starts from the last check
    delivered.fire("w")
    delivered.check()
