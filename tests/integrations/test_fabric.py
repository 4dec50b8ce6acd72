"""halfprec under real Lightning Fabric (CPU), set up through ``setup_fabric``: parity, skips, resume, errors.

Fabric adds no arithmetic: ``convert_input`` casts the model's inputs (the oracle casts them too),
``convert_output`` upcasts the 16-bit output exactly (the oracle's loss upcasts it), ``fabric.backward``
scales the loss by a power of two, and ``optimizer.step()`` is ``mp.step()``. Comparisons are bit-exact.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

from lightning.fabric import Fabric  # noqa: E402

from halfprec.integrations.lightning import HalfprecFabricPrecision, setup_fabric  # noqa: E402

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
    make_model,
    make_scaler,
    make_scheduler,
    plain_loop,
)


def _setup(name, *, seed=0, device="cpu", impl="auto"):
    fabric = Fabric(
        accelerator=device,
        devices=1,
        plugins=[HalfprecFabricPrecision(DTYPES[name], loss_scaler=make_scaler(DTYPES[name]), impl=impl)],
    )
    model = make_model(seed)  # fp32; the optimizer is built over it before setup, as Fabric users do
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, opt = setup_fabric(fabric, model, opt, max_grad_norm=CLIP)
    return fabric, model, opt, make_scheduler(opt)


def _train(fabric, model, opt, sched, batches, rec, *, accum=2, inf_at=()):
    injector = InfInjector(model.module[0].weight, inf_at)
    for i, (x, y) in enumerate(batches):
        boundary = (i + 1) % accum == 0
        x, y = x.to(fabric.device), y.to(fabric.device)
        with fabric.no_backward_sync(model, enabled=not boundary):
            loss = loss_fn(model(x), y)
            rec.losses.append(loss.item())
            fabric.backward(loss / accum)
        if boundary:
            opt.step()
            if not opt.step_was_skipped:  # Fabric has no scheduler hook: the loop holds the schedule
                sched.step()
            opt.zero_grad()
            rec.lrs.append(sched.get_last_lr()[0])
            rec.skipped.append(opt.step_was_skipped)
            rec.grad_norms.append(opt.grad_norm)
            rec.scales.append(opt.loss_scale)
    injector.handle.remove()


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matches_plain_loop(name, recwarn):
    dtype, batches = DTYPES[name], make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)
    fabric, model, opt, sched = _setup(name)
    rec = Record()
    _train(fabric, model, opt, sched, batches, rec)
    assert rec == ref
    assert all(n > CLIP for n in rec.grad_norms)
    assert_same_weights(model.module, opt.optimizer, ref_model, ref_mp)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "halfprec" in str(w.message)]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_overflow_skip(name, recwarn):
    dtype, batches = DTYPES[name], make_batches(6)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2, inf_at=(2, 3))
    fabric, model, opt, sched = _setup(name)
    rec = Record()
    _train(fabric, model, opt, sched, batches, rec, inf_at=(2, 3))
    assert rec.skipped == [False, True, False]
    assert rec == ref
    assert_same_weights(model.module, opt.optimizer, ref_model, ref_mp)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "halfprec" in str(w.message)]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fabric_save_load_bit_exact(name, tmp_path):
    dtype, batches = DTYPES[name], make_batches(8)
    ref_model, ref_mp, _, ref = plain_loop(dtype, batches, accum=2)
    fabric, model, opt, sched = _setup(name)
    first = Record()
    _train(fabric, model, opt, sched, batches[:4], first)
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": opt, "scheduler": sched})

    fabric2, model2, opt2, sched2 = _setup(name, seed=123)
    fabric2.load(tmp_path / "state.ckpt", {"model": model2, "optimizer": opt2, "scheduler": sched2})
    second = Record()
    _train(fabric2, model2, opt2, sched2, batches[4:], second)
    assert first.losses + second.losses == ref.losses
    assert first.lrs + second.lrs == ref.lrs
    assert first.scales + second.scales == ref.scales
    assert_same_weights(model2.module, opt2.optimizer, ref_model, ref_mp)


def test_fabric_clip_gradients_sees_unscaled_masters():
    # fabric.clip_gradients unscales through the plugin and clips main_params (the masters).
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[HalfprecFabricPrecision(torch.float16)])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = setup_fabric(fabric, model, opt)
    x, y = make_batches(1)[0]
    fabric.backward(loss_fn(model(x), y))
    norm = fabric.clip_gradients(model, opt, max_norm=CLIP)
    masters = opt.optimizer.master_params()
    ref = torch.nn.utils.get_total_norm([m.grad for m in masters])
    assert float(ref) == pytest.approx(CLIP, rel=1e-5)  # clipped, unscaled
    assert float(norm) < 100  # the unscaled norm, not 65536 times it
    opt.step()
    assert not opt.step_was_skipped


@pytest.mark.parametrize(("device", "impl"), _oracle.FUSED_PATHS)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fused_path_clips_in_the_kernel(name, device, impl):
    # setup_fabric's max_grad_norm clips in the fused optimizer's norm pass: bit for bit the plain fused loop,
    # which matches the exact path within the fused tolerances.
    dtype, batches = DTYPES[name], make_batches(6)
    ref_model, ref_mp, _, ref = _oracle.fused_oracle(dtype, batches, device=device, impl=impl, inf_at=(2, 3))
    fabric, model, opt, sched = _setup(name, device=device, impl=impl)
    rec = Record()
    _train(fabric, model, opt, sched, batches, rec, inf_at=(2, 3))
    assert opt.impl == "triton" and rec.skipped == [False, True, False]
    assert rec == ref
    assert_same_weights(model.module, opt.optimizer, ref_model, ref_mp)
    # fabric.clip_gradients clips main_params' grads with torch, which the fused path never materialises
    x, y = (t.to(fabric.device) for t in make_batches(1)[0])
    fabric.backward(loss_fn(model(x), y))
    with pytest.raises(RuntimeError, match=r"setup_fabric\(\.\.\., max_grad_norm=x\).*impl='torch'"):
        fabric.clip_gradients(model, opt, max_norm=CLIP)


def test_setup_fabric_errors():
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    model = make_model()
    with pytest.raises(ValueError, match=r"HalfprecFabricPrecision\(torch.bfloat16 \| torch.float16\)"):
        setup_fabric(fabric, model, torch.optim.SGD(model.parameters(), lr=0.1))
    # param_dtype= with a torch dtype, as HalfprecPrecision: a precision string names the dtype to pass
    with pytest.raises(
        ValueError,
        match=r"^HalfprecFabricPrecision param_dtype .*, got 'fp16'; use param_dtype=torch.float16$",
    ):
        HalfprecFabricPrecision("fp16")
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=[HalfprecFabricPrecision(param_dtype=torch.float16)]
    )
    assert fabric.strategy.precision.precision == "16-true"
    with pytest.raises(ValueError, match=r"at least one optimizer"):
        setup_fabric(fabric, model)
    # fabric.setup with the plain optimizer skips the wrapping: the plugin refuses to step it.
    plain = make_model().to(torch.float16)
    model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"setup_fabric"):
        opt.step()


@pytest.mark.parametrize(("kwargs", "expected"), [({}, "param"), ({"grad_accum_dtype": "fp32"}, "fp32")])
def test_grad_accum_dtype_is_16_bit_unless_told(kwargs, expected):
    # Fabric has no accumulation setting: "auto" cannot know that the loop accumulates
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[HalfprecFabricPrecision(torch.bfloat16, **kwargs)])
    model = make_model()
    _, opt = setup_fabric(fabric, model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert opt.optimizer.grad_accum_dtype == expected
