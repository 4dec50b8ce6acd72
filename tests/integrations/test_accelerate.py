"""halfprec under the real Accelerate (CPU): parity with the plain loop, skips, resume, misconfiguration.

Accelerate adds no arithmetic of its own here: ``accelerator.backward`` divides the scaled loss by the
accumulation steps (the oracle divides the unscaled loss; the scale is a power of two, so both orders give the
same bits), and ``AcceleratedOptimizer.step`` calls ``mp.step``. Every comparison is therefore bit-exact.
"""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from halfprec.integrations import accelerate as hp_accelerate  # noqa: E402

from ..allocations import NewStorageBytes  # noqa: E402
from ..tolerances import approx  # noqa: E402
from . import _oracle  # noqa: E402
from ._oracle import (  # noqa: E402
    CLIP,
    DTYPES,
    LR,
    InfInjector,
    Record,
    assert_same_weights,
    loss_fn,
    make_batches,
    make_loader,
    make_model,
    make_optimizer,
    make_scheduler,
    plain_loop,
)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    # Accelerate keeps its state in process-wide singletons; each test builds its own Accelerator.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _setup(dtype, batches, accum, *, seed=0, device="cpu", impl="torch"):
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="no", gradient_accumulation_steps=accum)
    model = make_model(seed, device)  # on its device first: the masters are made where the params are
    mp = make_optimizer(model, dtype, impl=impl)
    sched = make_scheduler(mp)
    model, opt, loader, sched = hp_accelerate.prepare(accelerator, model, mp, make_loader(batches), sched)
    return accelerator, model, mp, opt, loader, sched


def _train(
    accelerator, model, mp, opt, loader, sched, dtype, rec, inf_at=(), skip_seen=None, stop_after=None
):
    injector = InfInjector(model[0].weight, inf_at)
    for i, (x, y) in enumerate(loader):
        if i == stop_after:
            break
        with accelerator.accumulate(model):
            loss = loss_fn(model(x.to(dtype)), y)
            rec.losses.append(loss.item())
            accelerator.backward(mp.scale_loss(loss))
            opt.step()
            sched.step()
            if accelerator.sync_gradients:
                rec.lrs.append(sched.get_last_lr()[0])
                rec.skipped.append(opt.step_was_skipped)
                rec.grad_norms.append(mp.grad_norm)
                rec.scales.append(mp.loss_scale)
                if skip_seen is not None:
                    skip_seen.append(accelerator.optimizer_step_was_skipped)
            opt.zero_grad()
    injector.handle.remove()


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matches_plain_loop(name, accum):
    dtype, batches = DTYPES[name], make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=accum)
    accelerator, model, mp, opt, loader, sched = _setup(dtype, batches, accum)
    assert isinstance(opt, torch.optim.Optimizer) and opt.optimizer is mp
    rec = Record()
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec)
    assert rec == ref
    assert len(rec.lrs) == 6 // accum
    assert_same_weights(model, mp, ref_model, ref_mp)
    assert all(n > 0.05 for n in rec.grad_norms)  # clipping at 0.05 was active on every step
    # ... and clipped the norm to 0.05: the oracle checked each step's grads against clip_grad_norm_ (fp32)
    assert len(ref.clipped_norms) == 6 // accum
    assert all(n == approx(0.05, "clipped_norm") for n in ref.clipped_norms), ref.clipped_norms


def test_wrap_optimizer_accumulates_bf16_in_fp32_as_the_plain_loop_asked_for_it():
    dtype, batches = torch.bfloat16, make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, grad_accum_dtype="fp32")
    accelerator = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    mp = hp_accelerate.wrap_optimizer(accelerator, inner, param_dtype=dtype, max_grad_norm=CLIP, impl="torch")
    model, opt, loader, sched = hp_accelerate.prepare(
        accelerator, model, mp, make_loader(batches), make_scheduler(mp)
    )
    rec = Record()
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec)
    assert mp.grad_accum_dtype == "fp32" and rec == ref
    assert_same_weights(model, mp, ref_model, ref_mp)


@pytest.mark.parametrize(
    ("name", "accum", "kwargs", "expected"),
    [
        ("bf16", 1, {}, "param"),  # one micro-batch: nothing to sum
        ("fp16", 2, {}, "param"),  # the loss scale keeps 16-bit sums close
        ("bf16", 2, {"grad_accum_dtype": "param"}, "param"),
        ("fp16", 1, {"grad_accum_dtype": "fp32"}, "fp32"),
    ],
)
def test_wrap_optimizer_grad_accum_dtype(name, accum, kwargs, expected):
    accelerator = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=accum)
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    mp = hp_accelerate.wrap_optimizer(accelerator, inner, param_dtype=DTYPES[name], **kwargs)
    assert mp.grad_accum_dtype == expected


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_overflow_skip_holds_schedule(name, recwarn, caplog):
    dtype, batches = DTYPES[name], make_batches(6)
    inf_at = (2, 3)  # both micro-batches of optimizer step 1 (accum=2)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, inf_at=inf_at)
    accelerator, model, mp, opt, loader, sched = _setup(dtype, batches, 2)
    rec, seen = Record(), []
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec, inf_at=inf_at, skip_seen=seen)
    assert rec.skipped == [False, True, False] == ref.skipped
    assert seen == [False, True, False]  # accelerator.optimizer_step_was_skipped, which the HF Trainer reads
    assert rec.lrs == approx([0.009, 0.009, 0.0081], "lr_schedule")  # AcceleratedScheduler held on the skip
    assert rec == ref
    assert_same_weights(model, mp, ref_model, ref_mp)
    assert mp.skipped_steps == 1
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "halfprec" in str(w.message)]


@pytest.mark.parametrize(("device", "impl"), _oracle.FUSED_PATHS)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fused_path_clips_in_the_kernel(name, device, impl):
    # The optimizer's max_grad_norm clips in the fused norm pass; skips reach Accelerate and hold its scheduler:
    # bit for bit the plain fused loop, which matches the exact path within the fused tolerances.
    dtype, batches = DTYPES[name], make_batches(6)
    inf_at = (2, 3)  # both micro-batches of optimizer step 1
    ref_model, ref_mp, _, ref = _oracle.fused_oracle(dtype, batches, device=device, impl=impl, inf_at=inf_at)
    accelerator, model, mp, opt, loader, sched = _setup(dtype, batches, 2, device=device, impl=impl)
    rec, seen = Record(), []
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec, inf_at=inf_at, skip_seen=seen)
    assert mp.impl == "triton" and seen == [False, True, False]
    assert rec == ref
    assert_same_weights(model, mp, ref_model, ref_mp)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_save_state_resume_bit_exact(name, tmp_path):
    dtype, batches = DTYPES[name], make_batches(8)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)

    acc, model, mp, opt, loader, sched = _setup(dtype, batches, 2)
    acc.register_for_checkpointing(mp.loss_scaler)  # redundant (it is in optimizer.bin) and harmless
    first = Record()
    _train(acc, model, mp, opt, loader, sched, dtype, first, stop_after=4)
    acc.save_state(tmp_path / "ckpt")

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2, model2, mp2, opt2, loader2, sched2 = _setup(
        dtype, batches, 2, seed=123
    )  # other weights, then loaded
    acc2.register_for_checkpointing(mp2.loss_scaler)
    acc2.load_state(tmp_path / "ckpt")
    second = Record()
    _train(acc2, model2, mp2, opt2, acc2.skip_first_batches(loader2, 4), sched2, dtype, second)

    assert first.losses + second.losses == ref.losses
    assert first.lrs + second.lrs == ref.lrs
    assert first.scales + second.scales == ref.scales
    assert_same_weights(model2, mp2, ref_model, ref_mp)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mixed_precision": "bf16"}, r"mixed_precision='bf16'.*mixed_precision='no'"),
        ({"mixed_precision": "fp16"}, r"mixed_precision='fp16'.*mixed_precision='no'"),
    ],
)
def test_misconfiguration_errors(kwargs, match):
    try:
        accelerator = Accelerator(cpu=True, **kwargs)
    except ValueError as e:  # Accelerate itself may refuse the setting on this device
        pytest.skip(f"Accelerate refuses {kwargs} here: {e}")
    model = make_model()
    mp = make_optimizer(model, torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        hp_accelerate.prepare(accelerator, model, mp)
    with pytest.raises(ValueError, match=match):
        hp_accelerate.attach(accelerator)


def test_prepare_before_first_step_round_trips_state():
    # AcceleratedOptimizer(device_placement=True) reloads mp.state_dict() at prepare time, before any step.
    model = make_model()
    mp = make_optimizer(model, torch.float16)
    before = [m.detach().clone() for m in mp.master_params()]
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    _, opt = hp_accelerate.prepare(accelerator, model, mp)
    for a, b in zip(before, mp.master_params(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.step_was_skipped is False and mp.loss_scale == 2.0**8


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fused_optimizer_matches_plain_loop(name):
    # The fused optimizers own masters and a scale too; the link and the scaled entry point are the same.
    from halfprec.optim import FusedAdamW

    from ._oracle import make_scaler

    def fused(model, dtype):
        return FusedAdamW(
            model.parameters(),
            lr=LR,
            weight_decay=0.1,
            loss_scaler=make_scaler(dtype),
            max_grad_norm=CLIP,
            param_dtype=dtype,
        )

    dtype, batches = DTYPES[name], make_batches(6)
    ref_model = make_model()
    ref_mp = fused(ref_model, dtype)
    _, _, _, ref = plain_loop(
        dtype, batches, accum=2, inf_at=(2,), model=ref_model, mp=ref_mp, sched=make_scheduler(ref_mp)
    )
    accelerator = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
    model = make_model()
    mp = fused(model, dtype)
    model, opt, loader, sched = hp_accelerate.prepare(
        accelerator, model, mp, make_loader(batches), make_scheduler(mp)
    )
    rec, seen = Record(), []
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec, inf_at=(2,), skip_seen=seen)
    assert seen == [False, True, False] and rec == ref
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(("device", "impl"), _oracle.FUSED_PATHS)
def test_prepare_allocates_no_optimizer_state(device, impl):
    # prepare() round-trips the optimizer's state dict (device placement) before any step; a load that allocated
    # the AdamW moments there would cost 8 B/param: state only at the first update (construction is inert)
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision="no")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)).to(device)
    mp = make_optimizer(model, torch.bfloat16, impl=impl)
    n = sum(p.numel() for p in model.parameters())
    with NewStorageBytes() as counter:
        hp_accelerate.prepare(accelerator, model, mp)
    assert counter.total <= 4 * n + 4096 * len(list(model.parameters())), counter.total / n  # masters' copies


@pytest.mark.parametrize("kind", ["DEEPSPEED", "MEGATRON_LM"])  # FSDP: tests/integrations/test_fsdp.py
def test_a_distribution_that_owns_the_masters_is_refused_with_the_fix(kind):
    # Accelerate builds these only under their launchers: the check reads the two attributes it needs
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    accelerator = SimpleNamespace(mixed_precision="no", distributed_type=getattr(DistributedType, kind))
    with pytest.raises(ValueError, match=r"are alternatives, not layers: use plain DDP.*FSDP2 \("):
        hp_accelerate.check_accelerator(accelerator)
