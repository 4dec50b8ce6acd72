"""Engine: casting, accumulation, scheduler holding on skips, counters, records, errors."""

from __future__ import annotations

import warnings

import pytest
import torch

import halfprec

from .engine_util import TiedLM, batch, build, train


def test_initialize_casts_and_keeps_fp32_masters():
    torch.manual_seed(0)
    model = TiedLM()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.register_buffer("table", torch.randn(3))
    engine = halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    names = [n for n, _ in model.named_parameters()]
    for name, p, m in zip(names, model.parameters(), engine.optimizer.master_params(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(m, originals[name])
    assert model.table.dtype == torch.bfloat16
    assert model.head.weight is model.emb.weight


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accumulation_equals_the_plain_wrapper_loop(precision):
    engine = build(precision, gas=3)
    # grad_accum_dtype "auto": fp32 sums for bf16 with several micro-batches, the 16-bit .grad for fp16
    assert (engine.optimizer.grad_accum_dtype is torch.float32) == (precision == "bf16")
    ref = build(precision, gas=1, grad_accum_dtype="fp32" if precision == "bf16" else "param")
    mp = ref.optimizer
    for step in range(4):
        for micro in range(3):
            idx = batch(step, micro)
            loss = torch.nn.functional.cross_entropy(
                ref.module(idx[:, :-1]).float().reshape(-1, 37), idx[:, 1:].reshape(-1)
            )
            mp.backward(loss / 3)
        mp.step()
        ref.lr_scheduler.step()
        mp.zero_grad()
    train(engine, 4)
    assert engine.global_step == 4 and engine.micro_step == 12
    for a, b in zip(engine.optimizer.master_params(), mp.master_params(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("accum", ["param", "fp32"])
def test_step_and_zero_grad_act_only_at_boundaries(accum):
    engine = build("bf16", gas=2, grad_accum_dtype=accum)
    idx = batch(0, 0)
    loss = engine(idx).float().mean()
    engine.backward(loss)
    engine.zero_grad()  # mid-accumulation: keeps the grads (fp32 sums: in the master grads)
    held = engine.module.mix.weight if accum == "param" else engine.optimizer.master_params()[1]
    assert held.grad is not None
    assert engine.step() is None and engine.global_step == 0
    engine.backward(engine(idx).float().mean())
    record = engine.step()
    assert record == halfprec.StepRecord(1, 1.0, record.grad_norm, False) and record.grad_norm > 0
    assert engine.step() is None  # the boundary was consumed
    assert engine.module.mix.weight.grad is None


def test_skipped_step_holds_schedule_and_counts():
    engine = build("fp16", hysteresis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(engine, 5, inject_inf_at=(0, 3))
    assert engine.global_step == 5 and engine.skipped_steps == 2
    assert engine.lr_scheduler.last_epoch == 3
    m = engine.optimizer.master_params()[0]
    assert int(engine.optimizer.state[m]["step"]) == 3
    assert engine.last_record.step == 5 and not engine.last_record.skipped


def test_save_mid_accumulation_is_an_error(tmp_path):
    engine = build("bf16", gas=2)
    engine.backward(engine(batch(0, 0)).float().mean())
    with pytest.raises(RuntimeError, match="middle of a gradient accumulation"):
        engine.save_checkpoint(tmp_path)


def test_precision_mismatch_is_an_error():
    model = TiedLM().half()
    with pytest.raises(ValueError, match="is torch.float16 but precision='bf16'"):
        halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")


def test_frozen_params_in_the_optimizer_are_cast_too():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model[0].weight.requires_grad_(False)
    engine = halfprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    engine.backward(engine(torch.randn(2, 5, dtype=torch.bfloat16)).float().sum())
    engine.step()


@pytest.mark.parametrize(
    "make,pattern",
    [
        (
            lambda m: halfprec.MixedPrecisionOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)),
            "plain torch.optim",
        ),
        (lambda m: torch.optim.SGD(TiedLM().parameters(), lr=0.1), "not this model's parameters"),
    ],
)
def test_initialize_rejects_foreign_or_wrapped_optimizers(make, pattern):
    model = TiedLM()
    with pytest.raises(ValueError, match=pattern):
        halfprec.initialize(model, make(model), precision="bf16")


def test_reduce_lr_on_plateau_is_refused_with_the_fix():
    model = TiedLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="ReduceLROnPlateau needs a metric"):
        halfprec.initialize(model, opt, lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


@pytest.mark.parametrize(
    "kwargs,error,regex",
    [
        (
            {"gradient_accumulation": 4},
            TypeError,
            "unknown config override 'gradient_accumulation' \\(did you mean 'gradient_accumulation_steps'\\?\\)",
        ),
        ({"foo": 1}, TypeError, "unknown config override 'foo'; Config's fields are: precision, "),
        ({"config": {"precision": "fp16"}}, TypeError, "config must be a halfprec.config.Config, got dict"),
    ],
)
def test_initialize_names_bad_config_arguments(kwargs, error, regex):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(error, match=regex):
        halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
