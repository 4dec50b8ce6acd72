"""halfprec under the real HF ``Trainer`` (CPU): parity with the plain loop, skips, clipping, resume, errors.

The Trainer adds no arithmetic of its own on this path: it divides the loss by the accumulation steps (as the
oracle does), the loss-scale hook multiplies the gradient by a power of two (the oracle multiplies the loss;
both orders give the same bits), and ``optimizer.step()`` is ``mp.step()``. Comparisons are bit-exact.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import halfprec  # noqa: E402
from halfprec.integrations.hf import HalfprecTrainer, HalfprecTrainerMixin  # noqa: E402

from ..tolerances import approx  # noqa: E402
from . import _oracle  # noqa: E402
from ._oracle import (  # noqa: E402
    CLIP,
    DTYPES,
    LR,
    InfInjector,
    assert_same_weights,
    loss_fn,
    make_batches,
    make_model,
    make_optimizer,
    make_scaler,
    make_scheduler,
    plain_loop,
)


class RegressionModel(nn.Module):
    """The oracle's MLP behind the Trainer's calling convention (keyword inputs, a dict with ``loss``)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.net = make_model(seed)
        self.losses: list[float] = []

    def forward(self, x, labels=None):
        out = self.net(x.to(self.net[0].weight.dtype))
        loss = loss_fn(out, labels)
        if self.training and torch.is_grad_enabled():
            self.losses.append(loss.item())
        return {"loss": loss, "logits": out}


class _Steps(TrainerCallback):
    def __init__(self):
        self.lrs, self.skipped = [], []

    def on_step_end(self, args, state, control, lr_scheduler=None, optimizer=None, **kwargs):
        self.lrs.append(lr_scheduler.get_last_lr()[0])
        self.skipped.append(optimizer.step_was_skipped)


def _dataset(batches):
    return [{"x": x[i], "labels": y[i]} for x, y in batches for i in range(x.shape[0])]


def _args(tmp_path, steps, **kw):
    defaults = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=5,
        gradient_accumulation_steps=2,
        max_steps=steps,
        learning_rate=LR,
        max_grad_norm=CLIP,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        seed=0,
    )
    defaults.update(kw)
    return TrainingArguments(**defaults)


def _trainer(tmp_path, dtype, batches, steps, *, seed=0, **kw):
    model = RegressionModel(seed)
    mp = make_optimizer(model.net, dtype)
    steps_cb = _Steps()
    trainer = HalfprecTrainer(
        model=model,
        args=_args(tmp_path, steps, **kw),
        train_dataset=_dataset(batches),
        optimizers=(mp, make_scheduler(mp)),
        callbacks=[steps_cb],
    )
    return trainer, model, mp, steps_cb


def _logged(trainer, key):
    return [rec[key] for rec in trainer.state.log_history if key in rec and "train_runtime" not in rec]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matches_plain_loop(name, tmp_path):
    dtype, batches = DTYPES[name], make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)
    trainer, model, mp, steps = _trainer(tmp_path, dtype, batches, 3)
    trainer.train()
    assert model.losses == ref.losses
    assert steps.lrs == ref.lrs
    assert _logged(trainer, "grad_norm") == ref.grad_norms  # halfprec's unscaled pre-clip norm
    assert all(n > CLIP for n in ref.grad_norms)  # so every step really clipped
    assert _logged(trainer, "loss_scale") == ref.scales
    assert_same_weights(model.net, mp, ref_model, ref_mp)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_trainer_built_optimizer_matches_plain_loop(name, tmp_path):
    # The Trainer builds its own AdamW (two groups: decay / no decay) and linear schedule over an fp32 model;
    # the mixin wraps the optimizer with param_dtype, so the masters start from the fp32 weights.
    dtype, batches = DTYPES[name], make_batches(6)
    args = _args(tmp_path, 3, weight_decay=0.1)
    model = RegressionModel()
    trainer = HalfprecTrainer(
        model=model, args=args, train_dataset=_dataset(batches), param_dtype=dtype, grad_accum_dtype="param"
    )  # 16-bit accumulation, as the plain loop
    trainer.train()

    ref_model = make_model()
    decay = set(trainer.get_decay_parameter_names(RegressionModel()))
    named = [(f"net.{n}", p) for n, p in ref_model.named_parameters()]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, ref_model)
    inner = cls(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        **kwargs,
    )
    scaler = halfprec.DynamicLossScaler() if dtype == torch.float16 else None
    ref_mp = halfprec.MixedPrecisionOptimizer(
        inner, loss_scaler=scaler, max_grad_norm=CLIP, param_dtype=dtype
    )
    ref_sched = transformers.get_scheduler("linear", ref_mp, num_warmup_steps=0, num_training_steps=3)
    _, _, _, ref = plain_loop(dtype, batches, accum=2, model=ref_model, mp=ref_mp, sched=ref_sched)
    assert model.losses == ref.losses
    assert_same_weights(model.net, trainer.halfprec_optimizer, ref_model, ref_mp)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_overflow_skip_holds_schedule(name, tmp_path, recwarn):
    dtype, batches = DTYPES[name], make_batches(6)
    inf_at = (2, 3)  # both micro-batches of optimizer step 1
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, inf_at=inf_at)
    trainer, model, mp, steps = _trainer(tmp_path, dtype, batches, 3)
    injector = InfInjector(model.net[0].weight, inf_at)
    trainer.train()
    injector.handle.remove()
    assert steps.skipped == [False, True, False] == ref.skipped
    assert steps.lrs == approx([0.009, 0.009, 0.0081], "lr_schedule") and steps.lrs == ref.lrs
    assert _logged(trainer, "skipped_steps") == [0, 1, 1]
    assert model.losses == ref.losses
    assert_same_weights(model.net, mp, ref_model, ref_mp)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "halfprec" in str(w.message)]


def test_default_accumulates_bf16_in_fp32_as_the_plain_loop_asked_for_it(tmp_path):
    dtype, batches = torch.bfloat16, make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, grad_accum_dtype="fp32")
    model = RegressionModel()
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    trainer = HalfprecTrainer(
        model=model,
        args=_args(tmp_path, 3),
        train_dataset=_dataset(batches),
        optimizers=(inner, make_scheduler(inner)),
        param_dtype=dtype,
        impl="torch",
    )
    trainer.train()
    mp = trainer.halfprec_optimizer
    assert mp.grad_accum_dtype == "fp32" and model.losses == ref.losses
    assert _logged(trainer, "grad_norm") == ref.grad_norms
    assert_same_weights(model.net, mp, ref_model, ref_mp)


@pytest.mark.parametrize(
    ("name", "accum", "kwargs", "expected"),
    [
        ("bf16", 2, {}, "fp32"),
        ("bf16", 1, {}, "param"),  # one micro-batch: nothing to sum
        ("fp16", 2, {}, "param"),  # the loss scale keeps 16-bit sums close
        ("bf16", 2, {"grad_accum_dtype": "param"}, "param"),
        ("fp16", 1, {"grad_accum_dtype": "fp32"}, "fp32"),
    ],
)
def test_grad_accum_dtype_default_follows_gradient_accumulation_steps(
    tmp_path, name, accum, kwargs, expected
):
    trainer = HalfprecTrainer(
        model=RegressionModel(),
        args=_args(tmp_path, 1, gradient_accumulation_steps=accum),
        train_dataset=_dataset(make_batches(2)),
        param_dtype=DTYPES[name],
        **kwargs,
    )
    assert trainer.create_optimizer().grad_accum_dtype == expected


@pytest.mark.parametrize(("device", "impl"), _oracle.FUSED_PATHS)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fused_path_clips_in_the_kernel(name, device, impl, tmp_path):
    # The mixin wraps a plain torch optimizer on the fused path; max_grad_norm clips in its norm pass and the
    # logged grad_norm is its unscaled pre-clip norm: bit for bit the plain fused loop, which matches the exact
    # path within the fused tolerances.
    dtype, batches = DTYPES[name], make_batches(6)
    inf_at = (2, 3)  # both micro-batches of optimizer step 1
    ref_model, ref_mp, _, ref = _oracle.fused_oracle(dtype, batches, device=device, impl=impl, inf_at=inf_at)
    model = RegressionModel().to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    steps = _Steps()
    trainer = HalfprecTrainer(
        model=model,
        args=_args(tmp_path, 3, use_cpu=device == "cpu"),
        train_dataset=_dataset(batches),
        optimizers=(inner, make_scheduler(inner)),
        callbacks=[steps],
        param_dtype=dtype,
        loss_scaler=make_scaler(dtype),
        impl=impl,
        grad_accum_dtype="param",  # 16-bit accumulation, as the plain loop
    )
    injector = InfInjector(model.net[0].weight, inf_at)
    trainer.train()
    injector.handle.remove()
    mp = trainer.halfprec_optimizer
    assert mp.impl == "triton" and steps.skipped == [False, True, False] == ref.skipped
    assert model.losses == ref.losses and steps.lrs == ref.lrs
    assert _logged(trainer, "grad_norm") == ref.grad_norms
    assert _logged(trainer, "loss_scale") == ref.scales
    assert_same_weights(model.net, mp, ref_model, ref_mp)


@pytest.mark.gpu
def test_trainer_built_optimizer_takes_the_fused_path_on_cuda(tmp_path):
    # The Trainer's default optim="adamw_torch_fused" sets fused=True; impl="auto" still takes halfprec's fused
    # path (the flag names torch's kernel, which halfprec's step replaces), and impl="torch" keeps the exact one.
    for impl, want in (("auto", "triton"), ("torch", "torch")):
        trainer = HalfprecTrainer(
            model=RegressionModel().to("cuda"),
            args=_args(tmp_path, 1, use_cpu=False),
            train_dataset=_dataset(make_batches(2)),
            param_dtype=torch.bfloat16,
            impl=impl,
        )
        trainer.train()
        assert trainer.halfprec_optimizer.impl == want


class _Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 1))

    def forward(self, x, labels=None):
        out = self.net(x.to(self.net[0].weight.dtype)).float().squeeze(-1)
        return {"loss": (out - labels).square().mean(), "logits": out}


class _Allocated(TrainerCallback):
    def __init__(self):
        self.before_step, self.at_begin = (
            [],
            [],
        )  # bytes allocated with the grads in place / at a step's start

    def on_pre_optimizer_step(self, *args, **kwargs):
        self.before_step.append(torch.cuda.memory_allocated())

    def on_step_begin(self, *args, **kwargs):
        self.at_begin.append(torch.cuda.memory_allocated())


@pytest.mark.gpu
def test_trainer_frees_the_flat_grad_buffer_after_each_step(tmp_path):
    # The Trainer clears grads with model.zero_grad(), which would leave the fused optimizer's flat grad buffer
    # (2 B/param in bf16) alive through the next forward; HalfprecCallback frees it, as the engine does.
    model = _Wide().cuda()
    n = sum(p.numel() for p in model.parameters())
    probe = _Allocated()
    data = [{"x": torch.randn(16), "labels": torch.randn(())} for _ in range(20)]
    trainer = HalfprecTrainer(
        model=model,
        args=_args(tmp_path, 3, use_cpu=False, gradient_accumulation_steps=1),
        train_dataset=data,
        callbacks=[probe],
        param_dtype=torch.bfloat16,
    )
    trainer.train()
    assert trainer.halfprec_optimizer.impl == "triton"
    # step 2's grads in place, then step 3's start: the grad buffer is the difference (AdamW's state came at step 1)
    freed = (probe.before_step[1] - probe.at_begin[2]) / n
    assert 1.9 < freed < 2.1, (freed, probe.before_step, probe.at_begin, n)


def test_flop_count_equals_the_trainers_counting_the_params_once(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    rows = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 4
    args = _args(tmp_path, 2, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    trainer = HalfprecTrainer(model=model, args=args, train_dataset=rows, param_dtype=torch.bfloat16)
    counted = []
    monkeypatch.setattr(
        model, "num_parameters", lambda **kw: counted.append(kw) or type(model).num_parameters(model, **kw)
    )
    inputs = {"input_ids": torch.zeros(3, 7, dtype=torch.long)}
    expected = Trainer.floating_point_ops(trainer, inputs)
    assert expected == 6 * 21 * sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    assert [trainer.floating_point_ops(inputs) for _ in range(3)] == [expected] * 3
    assert counted == [{"exclude_embeddings": True}] * 2  # the Trainer's call above, then ours once
    assert (
        trainer.floating_point_ops({"x": torch.zeros(3)})
        == Trainer.floating_point_ops(trainer, {"x": 0})
        == 0
    )


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_resume_from_checkpoint_bit_exact(name, tmp_path):
    dtype, batches = DTYPES[name], make_batches(8)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)
    trainer, model, mp, steps = _trainer(tmp_path, dtype, batches, 4, save_strategy="steps", save_steps=2)
    trainer.train()
    assert (tmp_path / "checkpoint-2" / "optimizer.pt").is_file()

    # Other initial weights, then loaded: only checkpoint-2 can make the continuation match.
    trainer2, model2, mp2, steps2 = _trainer(tmp_path, dtype, batches, 4, seed=123)
    trainer2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert model2.losses == ref.losses[4:]
    assert steps2.lrs == ref.lrs[2:]
    assert_same_weights(model2.net, mp2, ref_model, ref_mp)


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"bf16": True}, r"TrainingArguments\(bf16=True\).*fp16=False, bf16=False.*torch\.bfloat16"),
        ({"fp16": True}, r"TrainingArguments\(fp16=True\).*fp16=False, bf16=False.*torch\.float16"),
        (
            {"fsdp": "full_shard"},
            r"TrainingArguments\(fsdp=True\): under FSDP2 .*Drop fsdp \(DDP\), or train FSDP2 with halfprec under "
            r"Accelerate",
        ),
    ],
)
def test_precision_flags_are_an_error(setting, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        HalfprecTrainer(
            model=RegressionModel(), args=_args(tmp_path, 1, **setting), param_dtype=torch.bfloat16
        )


def test_misconfiguration_errors(tmp_path):
    batches = make_batches(2)
    with pytest.raises(ValueError, match=r"param_dtype is None.*param_dtype=torch\.bfloat16"):
        HalfprecTrainer(
            model=RegressionModel(), args=_args(tmp_path, 1), train_dataset=_dataset(batches)
        ).train()
    model = RegressionModel()
    mp = make_optimizer(model.net, torch.bfloat16, max_grad_norm=0.5)
    trainer = HalfprecTrainer(
        model=model, args=_args(tmp_path, 1), train_dataset=_dataset(batches), optimizers=(mp, None)
    )
    with pytest.raises(ValueError, match=r"max_grad_norm=0\.5 but TrainingArguments has max_grad_norm=0\.05"):
        trainer.train()
    with pytest.raises(ValueError, match=r"param_dtype must be"):
        HalfprecTrainer(model=RegressionModel(), args=_args(tmp_path, 1), param_dtype=torch.float32)
    with pytest.raises(
        ValueError, match=r"halfprec_dtype=torch.bfloat16: the 16-bit dtype is spelled param_dtype="
    ):
        HalfprecTrainer(model=RegressionModel(), args=_args(tmp_path, 1), halfprec_dtype=torch.bfloat16)


_CHILD = """
import sys, torch
from tests.integrations._oracle import DTYPES, make_batches
from tests.integrations.test_hf import _trainer
name, out, ckpt = sys.argv[1:4]
trainer, model, mp, steps = _trainer(out, DTYPES[name], make_batches(8), 4, seed=123)
trainer.train(resume_from_checkpoint=ckpt)
torch.save({"params": [p.detach() for p in model.parameters()], "masters": [m.detach() for m in mp.master_params()],
            "losses": model.losses, "lrs": steps.lrs, "scale": mp.loss_scale}, out + "/child.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_resume_in_a_fresh_process_bit_exact(tmp_path, name):
    import pathlib
    import subprocess
    import sys

    dtype, batches = DTYPES[name], make_batches(8)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)
    trainer, *_ = _trainer(tmp_path, dtype, batches, 2, save_strategy="steps", save_steps=2)
    trainer.train()
    root = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, "-c", _CHILD, name, str(tmp_path), str(tmp_path / "checkpoint-2")],
        cwd=root,
        check=True,
    )
    child = torch.load(tmp_path / "child.pt", weights_only=True)
    assert (
        child["losses"] == ref.losses[4:] and child["lrs"] == ref.lrs[2:] and child["scale"] == ref.scales[-1]
    )
    for a, b in zip(child["params"], ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(child["masters"], ref_mp.master_params(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _OwnLoss(HalfprecTrainer):
    """The usual custom-loss pattern: compute_loss overridden without calling super()."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        return (out["loss"], out) if return_outputs else out["loss"]


class _OwnStep(HalfprecTrainer):
    """A training_step override that calls accelerator.backward itself, scaling as the error message says."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = model(**inputs)["loss"] / self.args.gradient_accumulation_steps
        self.accelerator.backward(self.halfprec_scale_loss(loss))
        return loss.detach()


class _UsersTrainer(Trainer):
    """A user's own Trainer subclass whose training_step calls compute_loss and scales as the docs say."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = self.compute_loss(model, inputs) / self.args.gradient_accumulation_steps
        self.accelerator.backward(self.halfprec_scale_loss(loss))
        return loss.detach()


class _MixinFirst(HalfprecTrainerMixin, _UsersTrainer):
    """The mixin in front of it: its compute_loss hook and halfprec_scale_loss must not both scale."""


@pytest.mark.parametrize(
    "trainer_cls",
    [_OwnLoss, _OwnStep, _MixinFirst],
    ids=["compute_loss", "training_step", "mixin_in_front_of_own_training_step"],
)
def test_overrides_are_still_loss_scaled(tmp_path, trainer_cls):
    dtype, batches = DTYPES["fp16"], make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)
    model = RegressionModel()
    mp = make_optimizer(model.net, dtype)
    trainer = trainer_cls(
        model=model,
        args=_args(tmp_path, 3),
        train_dataset=_dataset(batches),
        optimizers=(mp, make_scheduler(mp)),
    )
    trainer.train()
    assert _logged(trainer, "grad_norm") == ref.grad_norms
    assert mp.skipped_steps == ref_mp.skipped_steps
    assert_same_weights(model.net, mp, ref_model, ref_mp)


class _NoSuperStep(HalfprecTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = model(**inputs)["loss"]
        self.accelerator.backward(loss)
        return loss.detach()


def test_unscaled_backward_before_a_step_is_an_error(tmp_path):
    model = RegressionModel()
    mp = make_optimizer(model.net, DTYPES["fp16"])
    trainer = _NoSuperStep(
        model=model,
        args=_args(tmp_path, 2),
        train_dataset=_dataset(make_batches(4)),
        optimizers=(mp, make_scheduler(mp)),
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"backward that halfprec did not loss-scale.*super\(\)\.training_step"
    ):
        trainer.train()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_engine_casts_a_llama_as_from_pretrained_does(tmp_path):
    """``halfprec.initialize(fp32 Llama, precision="bf16")`` holds the model HF's own
    ``from_pretrained(dtype=torch.bfloat16)`` loads from the same weights: bf16 params, the rotary ``inv_freq``
    (a persistent=False buffer) fp32, the same logits to the bit at positions where a bf16 ``inv_freq`` is off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    halfprec.initialize(model, torch.optim.AdamW(model.parameters()), precision="bf16")
    ours, theirs = dict(model.named_buffers()), dict(loaded.named_buffers())
    assert {n: b.dtype for n, b in ours.items()} == {n: b.dtype for n, b in theirs.items()}
    assert ours["model.rotary_emb.inv_freq"].dtype == torch.float32
    positions = torch.arange(4000, 4016)[None]
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions).logits
        assert torch.equal(logits, loaded(input_ids=ids, position_ids=positions).logits)
