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


def test_initialize_keeps_buffers_outside_the_state_dict_as_from_pretrained_does():
    """A buffer registered persistent=False is a constant the model derives at construction (HF's rotary
    ``inv_freq``); ``from_pretrained(dtype=bf16)`` keeps it fp32, and so does the engine: in bf16 it is off by up to
    2**-9 relative, which at position 4095 moves the rotary angles by up to 0.73 radian here."""
    torch.manual_seed(0)
    model = TiedLM()
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    model.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
    model.register_buffer("table", torch.randn(3))
    halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    assert model.inv_freq.dtype == torch.float32 and torch.equal(model.inv_freq, inv_freq)
    assert model.table.dtype == torch.bfloat16  # the state's buffers follow the params
    angle = 4095 * inv_freq
    assert (angle - 4095 * inv_freq.bfloat16().float()).abs().max() > 0.7  # what the cast would have cost


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accumulation_equals_the_plain_wrapper_loop(precision):
    engine = build(precision, gas=3)
    # grad_accum_dtype "auto": fp32 sums for bf16 with several micro-batches, the 16-bit .grad for fp16
    assert (engine.optimizer.grad_accum_dtype == "fp32") == (precision == "bf16")
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


# (backwards of a 3-micro-batch accumulation, each followed by engine.step() or not, message)
SAVE_OFF_BOUNDARY = [
    (
        1,
        True,
        r"^save_checkpoint\(\) in the middle of a gradient accumulation, at micro-step 1 of 3: checkpoints are "
        r"saved at optimizer-step boundaries, after the engine\.step\(\) that follows backward 3 of 3 \(engine\."
        r"is_gradient_accumulation_boundary\(\) is True just before it; the engine\.step\(\) calls before it do "
        r"nothing and return None\); run the 2 remaining micro-step\(s\) \(engine\.backward\(\), then "
        r"engine\.step\(\)\), then save$",
    ),
    (2, False, r"at micro-step 2 of 3: .*run the 1 remaining micro-step\(s\)"),
    (
        3,
        False,
        r"^save_checkpoint\(\) at micro-step 3 of 3, before its optimizer step: .*; call engine\.step\(\), ",
    ),
]


@pytest.mark.parametrize(
    ("backwards", "stepped", "regex"), SAVE_OFF_BOUNDARY, ids=["1-stepped", "2-unstepped", "3-unstepped"]
)
def test_save_off_a_step_boundary_says_where_the_boundary_is(tmp_path, backwards, stepped, regex):
    engine = build("bf16", gas=3)
    for micro in range(backwards):
        engine.backward(engine(batch(0, micro)).float().mean())
        if stepped:
            assert engine.step() is None
    with pytest.raises(RuntimeError, match=regex):
        engine.save_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


# (gradient_accumulation_steps, message of the backward after that many without a step)
BACKWARD_PAST_BOUNDARY = [
    (
        4,
        r"^engine\.backward\(\) number 5 since the last optimizer step, with gradient_accumulation_steps=4: the "
        r"accumulation of the last 4 was never stepped\. Call engine\.step\(\) after every engine\.backward\(\), "
        r"as in DeepSpeed's loop \(it steps only at accumulation boundaries\), or raise "
        r"gradient_accumulation_steps$",
    ),
    (1, r"^engine\.backward\(\) number 2 since the last optimizer step, with gradient_accumulation_steps=1"),
]


def _loss(engine, micro: int) -> torch.Tensor:
    return engine(batch(0, micro)).float().mean()


@pytest.mark.parametrize(("gas", "regex"), BACKWARD_PAST_BOUNDARY, ids=["gas4", "gas1"])
def test_a_backward_past_an_unstepped_boundary_is_refused(gas, regex):
    """One step over 2 * gas micro-batches, each divided by gas, would apply twice the mean gradient."""
    engine, ref = build("bf16", gas=gas), build("bf16", gas=gas)
    for micro in range(gas):
        engine.backward(_loss(engine, micro))
    with pytest.raises(RuntimeError, match=regex):
        engine.backward(_loss(engine, gas))
    assert engine.micro_step == gas and engine.is_gradient_accumulation_boundary()
    assert engine.step() is not None  # the refused backward added nothing: the step equals a correct loop's
    for micro in range(gas):
        ref.backward(_loss(ref, micro))
        ref.step()
    for a, b in zip(engine.optimizer.master_params(), ref.optimizer.master_params(), strict=True):
        assert torch.equal(a, b)
    engine.backward(_loss(engine, 0))  # a new accumulation starts after the step


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


class _DuckScheduler:
    """What the engine needs of a scheduler: step() and the state-dict pair, as HF's schedulers have."""

    def __init__(self, optimizer):
        self.optimizer, self.steps = optimizer, 0

    def step(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_a_duck_typed_scheduler_is_stepped():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = halfprec.initialize(model, opt, lr_scheduler=_DuckScheduler(opt), precision="bf16")
    engine.backward(engine(torch.randn(2, 3)).float().sum())
    engine.step()
    assert engine.lr_scheduler.steps == 1


@pytest.mark.parametrize(
    "kwargs,error,regex",
    [
        (
            {"lr_scheduler": "cosine"},
            ValueError,
            r"^lr_scheduler must be a scheduler object with a step\(\) method, got str 'cosine'; pass one built on "
            r"the optimizer you pass, e\.g\. torch\.optim\.lr_scheduler\.CosineAnnealingLR\(optimizer, "
            r"T_max=total_steps\) \(a function of the step: LambdaLR\(optimizer, fn\)\)$",
        ),
        (
            {"lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR},
            ValueError,
            r"got the class CosineAnnealingLR; pass one built on the optimizer",
        ),
        (
            {"lr_scheduler": lambda step: 0.5},
            ValueError,
            r"got function <function .*LambdaLR\(optimizer, fn\)",
        ),
        (
            {"gradient_accumulation": 4},
            TypeError,
            "unknown config override 'gradient_accumulation' \\(did you mean 'gradient_accumulation_steps'\\?\\)",
        ),
        ({"foo": 1}, TypeError, "unknown config override 'foo'; Config's fields are: precision, "),
        ({"config": {"precision": "fp16"}}, TypeError, "config must be a halfprec.config.Config, got dict"),
    ],
)
def test_initialize_names_bad_arguments(kwargs, error, regex):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(error, match=regex):
        halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


# (method, directory: a str is made relative to tmp_path, where "file" is a regular file; error, message)
CHECKPOINT_DIRECTORY_ERRORS = [
    (
        "save_checkpoint",
        "file",
        ValueError,
        r"^save_checkpoint\('.*/file'\): .*/file is a file, not a directory; pass a directory \(it holds one "
        r"subdirectory per tag\), or move the file away$",
    ),
    (
        "save_checkpoint",
        "file/sub",
        ValueError,
        r"^save_checkpoint\('.*/file/sub'\): .*/file is a file, not a",
    ),
    (
        "save_checkpoint",
        None,
        ValueError,
        r"^save_checkpoint\(directory=None\): pass the directory to save into, a str or Path such as 'checkpoints'$",
    ),
    (
        "load_checkpoint",
        None,
        ValueError,
        r"^load_checkpoint\(directory=None\): pass the directory that save_checkpoint\(\) wrote to, or one of "
        r"its tag directories$",
    ),
]


@pytest.mark.parametrize(
    ("method", "directory", "error", "regex"),
    CHECKPOINT_DIRECTORY_ERRORS,
    ids=["save-file", "save-under-file", "save-None", "load-None"],
)
def test_checkpoint_directory_that_cannot_be_one_is_refused(tmp_path, method, directory, error, regex):
    (tmp_path / "file").write_text("mine")
    engine = build("bf16")
    with pytest.raises(error, match=regex):
        getattr(engine, method)(None if directory is None else str(tmp_path / directory))
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and (tmp_path / "file").read_text() == "mine"
