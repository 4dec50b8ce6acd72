"""halfprec as a real Lightning ``Trainer`` precision plugin (CPU): parity, skips, clipping, resume, errors.

Lightning adds one rounding of its own: ``convert_input`` casts the whole batch, targets included, to the
16-bit dtype (as its ``"bf16-true"`` does), so the oracle rounds its targets too (``cast_targets=True``).
Accumulation divides the loss by ``accumulate_grad_batches`` before the plugin scales it, as the oracle does;
``gradient_clip_val`` clips inside ``mp.step()`` with the oracle's arithmetic. So every comparison is bit-exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as L  # noqa: E402

from halfprec.integrations.lightning import HalfprecPrecision  # noqa: E402

from ..tolerances import approx
from . import _oracle  # noqa: E402
from ._oracle import (  # noqa: E402
    CLIP,
    DTYPES,
    LR,
    InfInjector,
    assert_same_weights,
    loss_fn,
    make_batches,
    make_loader,
    make_model,
    make_optimizer,
    make_scaler,
    plain_loop,
)

_QUIET = dict(logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)


class LitRegression(L.LightningModule):
    def __init__(self, seed=0, inf_at=(), halfprec_optimizer=None):
        super().__init__()
        self.net = make_model(seed)
        self.inf_at = inf_at
        self.halfprec_optimizer = (
            halfprec_optimizer  # build a MixedPrecisionOptimizer in configure_optimizers
        )
        self.losses, self.lrs, self.skipped, self.grad_norms, self.scales = [], [], [], [], []

    def on_train_start(self):
        self.injector = InfInjector(self.net[0].weight, self.inf_at)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.halfprec_optimizer is not None:
            opt = make_optimizer(self.net, torch.bfloat16, max_grad_norm=self.halfprec_optimizer)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step()
        mp = self.trainer.optimizers[0]
        self.lrs.append(scheduler.get_last_lr()[0])
        self.skipped.append(mp.step_was_skipped)
        self.grad_norms.append(mp.grad_norm)
        self.scales.append(mp.loss_scale)


def _fit(
    name,
    batches,
    *,
    epochs=1,
    seed=0,
    inf_at=(),
    ckpt_path=None,
    device="cpu",
    impl="auto",
    model=None,
    accum=2,
    grad_accum_dtype="param",  # 16-bit accumulation, as the plain loop
    **kw,
):
    model = LitRegression(seed, inf_at) if model is None else model
    plugin = HalfprecPrecision(
        DTYPES[name], loss_scaler=make_scaler(DTYPES[name]), impl=impl, grad_accum_dtype=grad_accum_dtype
    )
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        max_epochs=epochs,
        plugins=[plugin],
        gradient_clip_val=CLIP,
        accumulate_grad_batches=accum,
        **_QUIET,
        num_sanity_val_steps=0,
        **kw,
    )
    trainer.fit(model, make_loader(batches), ckpt_path=ckpt_path)
    return trainer, model


def _check_same(model, trainer, ref_model, ref_mp, ref, *, first=0):
    assert model.losses == ref.losses[2 * first :]
    assert model.lrs == ref.lrs[first:]
    assert model.skipped == ref.skipped[first:]
    assert model.grad_norms == ref.grad_norms[first:]
    assert model.scales == ref.scales[first:]
    assert_same_weights(model.net, trainer.optimizers[0], ref_model, ref_mp)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matches_plain_loop(name):
    dtype, batches = DTYPES[name], make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, cast_targets=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. torch's lr_scheduler order warnings
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers).*")
        trainer, model = _fit(name, batches)
    mp = trainer.optimizers[0]
    assert type(mp).__name__ == "ExactMixedPrecisionOptimizer" and mp.loss_scaler is not None
    assert all(n > CLIP for n in ref.grad_norms)  # gradient_clip_val clipped every step
    assert [p.dtype for p in model.parameters()] == [dtype] * 4
    _check_same(model, trainer, ref_model, ref_mp, ref)
    # The last step's master grads (unscaled) were clipped to gradient_clip_val, from the logged pre-clip norm.
    post = torch.nn.utils.get_total_norm([m.grad for m in mp.master_params()])
    assert float(post) == pytest.approx(CLIP, rel=1e-5) and model.grad_norms[-1] > 10 * CLIP


def test_default_accumulates_bf16_in_fp32_as_the_plain_loop_asked_for_it():
    dtype, batches = torch.bfloat16, make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(
        dtype, batches, accum=2, cast_targets=True, grad_accum_dtype="fp32"
    )
    trainer, model = _fit("bf16", batches, grad_accum_dtype="auto")
    assert trainer.optimizers[0].grad_accum_dtype == "fp32"
    _check_same(model, trainer, ref_model, ref_mp, ref)


@pytest.mark.parametrize(
    ("name", "accum", "grad_accum_dtype", "expected"),
    [
        ("bf16", 1, "auto", "param"),  # one micro-batch: nothing to sum
        ("fp16", 2, "auto", "param"),  # the loss scale keeps 16-bit sums close
        ("bf16", 2, "param", "param"),  # explicit 16-bit
        ("fp16", 1, "fp32", "fp32"),  # explicit fp32
    ],
)
def test_grad_accum_dtype_auto_and_explicit(name, accum, grad_accum_dtype, expected):
    trainer, _ = _fit(name, make_batches(2), accum=accum, grad_accum_dtype=grad_accum_dtype)
    assert trainer.optimizers[0].grad_accum_dtype == expected


def test_grad_accum_dtype_default_is_auto():
    assert HalfprecPrecision(torch.bfloat16).grad_accum_dtype == "auto"
    assert HalfprecPrecision(torch.bfloat16, grad_accum_dtype="fp32").grad_accum_dtype == "fp32"
    # the one vocabulary of Config and the optimizers: a dtype is refused with the name to write
    with pytest.raises(
        ValueError,
        match=r"grad_accum_dtype must be one of \('auto', 'param', 'fp32'\), got torch.float32; use 'fp32'",
    ):
        HalfprecPrecision(torch.bfloat16, grad_accum_dtype=torch.float32)


def test_convert_module_keeps_buffers_outside_the_state_dict():
    """As the engine (tests/test_engine.py): a persistent=False buffer such as a rotary ``inv_freq`` keeps its fp32
    values; the state's buffers and the params are cast."""
    module = torch.nn.BatchNorm1d(4)
    module.register_buffer("inv_freq", torch.rand(4) / 3, persistent=False)
    inv_freq = module.inv_freq.clone()
    HalfprecPrecision(torch.bfloat16).convert_module(module)
    assert module.inv_freq.dtype == torch.float32 and torch.equal(module.inv_freq, inv_freq)
    assert module.running_mean.dtype == module.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_overflow_skip_holds_schedule(name, recwarn):
    dtype, batches = DTYPES[name], make_batches(6)
    inf_at = (2, 3)  # both micro-batches of optimizer step 1
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, inf_at=inf_at, cast_targets=True)
    trainer, model = _fit(name, batches, inf_at=inf_at)
    assert model.skipped == [False, True, False]
    assert model.lrs == approx([0.009, 0.009, 0.0081], "lr_schedule")
    assert trainer.optimizers[0].skipped_steps == 1
    _check_same(model, trainer, ref_model, ref_mp, ref)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "halfprec" in str(w.message)]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_resume_from_ckpt_bit_exact(name, tmp_path):
    dtype, batches = DTYPES[name], make_batches(4)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches * 2, accum=2, cast_targets=True)
    trainer, _ = _fit(name, batches, epochs=1)
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["optimizer_states"][0]["scaler"]["scale"] == ref.scales[1]  # the scaler travels in the .ckpt

    trainer2, model2 = _fit(name, batches, epochs=2, seed=123, ckpt_path=str(path))
    _check_same(model2, trainer2, ref_model, ref_mp, ref, first=2)


@pytest.mark.parametrize(("device", "impl"), _oracle.FUSED_PATHS)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fused_path_clips_in_the_kernel(name, device, impl):
    # gradient_clip_val clips in the fused optimizer's norm pass: the logged norm, skips and schedule match the
    # plain fused loop bit for bit, and that loop matches the exact path within the fused tolerances.
    dtype, batches = DTYPES[name], make_batches(6)
    inf_at = (2, 3)  # both micro-batches of optimizer step 1
    ref_model, ref_mp, _, ref = _oracle.fused_oracle(
        dtype, batches, device=device, impl=impl, inf_at=inf_at, cast_targets=True
    )
    trainer, model = _fit(name, batches, inf_at=inf_at, device=device, impl=impl)
    assert trainer.optimizers[0].impl == "triton" and model.skipped == [False, True, False]
    _check_same(model, trainer, ref_model, ref_mp, ref)


class LitReadsGrads(LitRegression):
    """A hook that reads unscaled grads on the fused path: ``unscaled_grads()``, fp32 copies made on demand."""

    hook_norms: list[float]

    def on_before_optimizer_step(self, optimizer):
        grads = [g for g in optimizer.unscaled_grads() if g is not None]
        self.hook_norms.append(float(torch.nn.utils.get_total_norm(grads)))


def test_fused_path_hooks_read_unscaled_grads_on_demand():
    model = LitReadsGrads()
    model.hook_norms = []
    _fit("fp16", make_batches(4), impl="triton", model=model)
    # the hook's norm (torch's, of the unscaled copies) is the one the kernel clipped with, pre-clip
    assert model.hook_norms == approx(model.grad_norms, "grad_norm") and len(model.hook_norms) == 2
    assert all(n > CLIP for n in model.hook_norms)


def test_fused_path_refuses_clipping_by_value():
    with pytest.raises(ValueError, match=r"gradient_clip_algorithm='value'.*impl='torch'"):
        _fit("fp16", make_batches(2), impl="triton", gradient_clip_algorithm="value")


def test_gradient_clip_by_value_clamps_masters():
    batches = make_batches(2)
    trainer, _ = _fit("fp16", batches, gradient_clip_algorithm="value")
    grads = [m.grad for m in trainer.optimizers[0].master_params()]  # the last step's, clamped and unscaled
    bound = torch.tensor(CLIP, dtype=torch.float32)
    assert max(g.abs().max() for g in grads) == bound  # some entries were clamped, none exceed the bound


class LitManual(LitRegression):
    """Manual optimization: ``manual_backward`` scales, ``opt.step()`` is ``mp.step()``, the proxy holds."""

    def __init__(self, inf_at=()):
        super().__init__(inf_at=inf_at)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt, sched = self.optimizers(), self.lr_schedulers()
        loss = loss_fn(self.net(x), y)
        self.losses.append(loss.item())
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=CLIP)
        opt.step()
        opt.zero_grad()
        sched.step()  # the plugin's proxy: no step after a skipped one
        mp = self.trainer.optimizers[0]
        self.lrs.append(sched.get_last_lr()[0])
        self.skipped.append(mp.step_was_skipped)
        self.grad_norms.append(mp.grad_norm)
        self.scales.append(mp.loss_scale)


def test_manual_optimization_fp16():
    dtype, batches = torch.float16, make_batches(4)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=1, inf_at=(1,), cast_targets=True)
    model = LitManual(inf_at=(1,))
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[HalfprecPrecision(dtype, loss_scaler=make_scaler(dtype))],
        **_QUIET,
    )
    trainer.fit(model, make_loader(batches))
    assert model.skipped == [False, True, False, False]
    assert model.losses == ref.losses and model.lrs == ref.lrs and model.grad_norms == ref.grad_norms
    assert_same_weights(model.net, trainer.optimizers[0], ref_model, ref_mp)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # the one spelling of the 16-bit dtype (as the optimizers' and HalfprecTrainer's): a precision string
        # names the dtype to pass
        (
            {"param_dtype": "bf16"},
            r"^HalfprecPrecision param_dtype must be torch.float16 or torch.bfloat16, got "
            r"'bf16'; use param_dtype=torch.bfloat16$",
        ),
        ({"param_dtype": "fp16"}, r"got 'fp16'; use param_dtype=torch.float16$"),
        ({"param_dtype": "bf16-true"}, r"got 'bf16-true'; use param_dtype=torch.bfloat16$"),
        # Lightning's own autocast and fp32 need no plugin
        (
            {"param_dtype": "16-mixed"},
            r"got '16-mixed'; .*autocast.*pass precision='16-mixed' to the Trainer"
            r".*param_dtype=torch.float16",
        ),
        ({"param_dtype": "fp32"}, r"got 'fp32'; fp32 weights need no plugin"),
        ({"param_dtype": torch.float32}, r"got torch.float32; fp32 weights need no plugin"),
        ({"param_dtype": torch.float64}, r"torch.float16 or torch.bfloat16, got torch.float64$"),
        ({"param_dtype": None}, r"torch.float16 or torch.bfloat16, got None$"),
        (
            {"param_dtype": torch.float16, "loss_scaler": 2.0},
            r"loss_scaler must be a halfprec loss scaler, got float",
        ),
    ],
)
def test_plugin_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HalfprecPrecision(**kwargs)


def test_plugin_takes_param_dtype_positionally_or_by_keyword():
    for plugin in (HalfprecPrecision(torch.bfloat16), HalfprecPrecision(param_dtype=torch.bfloat16)):
        assert (plugin.dtype, plugin.precision) == (torch.bfloat16, "bf16-true")
    plugin = HalfprecPrecision(param_dtype=torch.float16)
    assert (plugin.dtype, plugin.precision) == (torch.float16, "16-true")


def test_clip_set_twice_is_an_error():
    model = LitRegression(halfprec_optimizer=0.5)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[HalfprecPrecision(torch.bfloat16)],
        gradient_clip_val=CLIP,
        **_QUIET,
    )
    with (
        pytest.raises(ValueError, match=r"max_grad_norm=0\.5 and the Trainer has gradient_clip_val=0\.05"),
        pytest.warns(RuntimeWarning, match=r"masters start from their 16-bit roundings.*return the plain"),
    ):
        trainer.fit(model, make_loader(make_batches(2)))


def test_optimizer_wrapped_in_configure_optimizers_warns_that_masters_are_rounded():
    """configure_optimizers runs after the plugin cast the model: such masters cannot start from fp32."""
    model = LitRegression(halfprec_optimizer=0.5)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        plugins=[HalfprecPrecision(torch.bfloat16)],
        **_QUIET,
    )
    with pytest.warns(
        RuntimeWarning, match=r"MixedPrecisionOptimizer was built over params that the halfprec"
    ):
        trainer.fit(model, make_loader(make_batches(2)))


def test_precision_flag_with_plugin_is_refused_by_lightning():
    with pytest.raises(Exception, match=r"precision"):
        L.Trainer(
            accelerator="cpu",
            precision="bf16-true",
            plugins=[HalfprecPrecision(torch.bfloat16)],
            logger=False,
        )


def test_second_fit_on_the_same_trainer_uses_only_its_own_optimizer():
    """Each fit connects its optimizers anew (a second fit, or one after Tuner.lr_find): manual fp16
    backward must still find exactly one optimizer's loss scale."""
    batches = make_batches(4)
    model = LitManual(inf_at=())
    plugin = HalfprecPrecision(torch.float16, loss_scaler=make_scaler(torch.float16))
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[plugin],
        **_QUIET,
    )
    trainer.fit(model, make_loader(batches))
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, make_loader(batches))
    assert len(plugin._optimizers) == 1 and len(model.losses) == 8


def test_scheduler_proxy_can_be_deep_copied():
    import copy

    import halfprec
    from halfprec.integrations.lightning import _HoldOnSkipScheduler

    net = torch.nn.Linear(2, 2).half()
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.SGD(net.parameters(), lr=1.0), impl="torch")
    proxy = _HoldOnSkipScheduler(torch.optim.lr_scheduler.StepLR(mp, 1, 0.5), mp)
    twin = copy.deepcopy(proxy)
    assert twin.get_last_lr() == [1.0] and twin.state_dict() == proxy.state_dict()
