"""Lightning's Trainer over FSDP2 with the halfprec plugin (``HalfprecModelParallelStrategy``), on CPU with gloo
in a world of one: training, checkpoints and resume, and the strategies that are refused.

The module shards its fp32 net in ``configure_model``; the plugin casts the shards and starts the masters from
their fp32 rows. The oracle is the plain halfprec loop (``_oracle.plain_loop``) over the same net, sharded and
cast the same way by hand, with the same ``MixedPrecisionOptimizer``: bit for bit, an overflow skip included.
Lightning rounds the targets to 16 bits too (``cast_targets``, as in test_lightning.py). The oracle does not
check the clipping against ``clip_grad_norm_`` here: over shards the norm is fp32(sqrt(fp64 sum of squares))
(docs/guarantees.md, FSDP2).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning")
pytest.importorskip("accelerate")  # the world_of_one fixture puts Accelerate's state back too

import lightning.pytorch.strategies as strategies  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import halfprec  # noqa: E402
from halfprec.integrations.fsdp import trains_shards  # noqa: E402
from halfprec.integrations.lightning import (  # noqa: E402
    HalfprecFabricPrecision,
    HalfprecModelParallelStrategy,
    check_trainer_strategy,
    setup_fabric,
)
from halfprec.integrations.lightning_strategy import check_fabric_strategy, optimizer_path  # noqa: E402
from halfprec.optim.mesh import local  # noqa: E402
from halfprec.prepare import start_masters_from  # noqa: E402

from ..tolerances import approx  # noqa: E402
from ._oracle import CLIP, DTYPES, LR, make_batches, make_model, make_scaler, make_scheduler, plain_loop  # noqa: E402
from ._shards import assert_same_shards, same_floats, shard, with_inf  # noqa: E402
from .test_lightning import LitRegression, _fit  # noqa: E402


class ShardedLit(LitRegression):
    """``LitRegression`` with its fp32 net sharded in ``configure_model``, over the data-parallel mesh."""

    def configure_model(self):
        shard(self.net, mesh=self.device_mesh["data_parallel"])


def oracle(dtype, batches, grad_accum_dtype="param", impl="torch"):
    """The plain loop over the fp32 net sharded over every rank, then cast, its masters started from the fp32
    rows (``batches``: this rank's)."""
    model = shard(make_model(), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    fp32 = [local(p).clone() for p in model.parameters()]
    rows = {p: local(p).detach() for p in model.parameters()}
    model.to(dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    mp = halfprec.MixedPrecisionOptimizer(
        inner, loss_scaler=make_scaler(dtype), max_grad_norm=CLIP, param_dtype=dtype, impl=impl,
        grad_accum_dtype=grad_accum_dtype,
    )  # fmt: skip
    start_masters_from(mp, rows)
    for m, w in zip(mp.master_params(), fp32, strict=True):
        torch.testing.assert_close(m, w, rtol=0, atol=0)
    sched = make_scheduler(mp)
    return plain_loop(
        dtype, batches, accum=2, model=model, mp=mp, sched=sched, cast_targets=True, max_grad_norm=None
    )


def _fit_sharded(name, batches, *, strategy=None, seed=0, impl="torch", **kw):
    strategy = strategy or HalfprecModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    # a parallel strategy's DistributedSampler would shuffle the batches
    return _fit(
        name,
        batches,
        model=ShardedLit(seed),
        strategy=strategy,
        impl=impl,
        use_distributed_sampler=False,
        **kw,
    )


def check_same(model, trainer, ref_model, ref_mp, ref, *, first=0):
    assert same_floats(model.losses, ref.losses[2 * first :]), (model.losses, ref.losses[2 * first :])
    assert same_floats(model.grad_norms, ref.grad_norms[first:]), (model.grad_norms, ref.grad_norms[first:])
    assert (model.lrs, model.skipped, model.scales) == (
        ref.lrs[first:],
        ref.skipped[first:],
        ref.scales[first:],
    )
    assert_same_shards(model.net, trainer.optimizers[0], ref_model, ref_mp)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_matches_plain_loop(name, world_of_one, recwarn):
    batches = with_inf(make_batches(6), 2)  # optimizer step 1 (accumulate_grad_batches=2) is skipped
    ref_model, ref_mp, _, ref = oracle(DTYPES[name], batches)
    trainer, model = _fit_sharded(name, batches)
    mp = trainer.optimizers[0]
    assert type(mp).__name__ == "ExactMixedPrecisionOptimizer" and trains_shards(mp.model_params())
    assert model.skipped == [False, True, False]
    assert model.lrs == approx([0.009, 0.009, 0.0081], "lr_schedule")  # held on the skip
    assert all(n > CLIP for n, s in zip(ref.grad_norms, ref.skipped, strict=True) if not s)  # clipped
    check_same(model, trainer, ref_model, ref_mp, ref)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message)]


def test_the_fused_path_matches_the_plain_loop(world_of_one):
    """The plugin's fused optimizer over the shards it cast (written in place; fp16 under the Triton interpreter)
    against the plain loop's, bit for bit, an overflow skip included."""
    batches = with_inf(make_batches(6), 2)
    ref_model, ref_mp, _, ref = oracle(torch.float16, batches, impl="triton")
    trainer, model = _fit_sharded("fp16", batches, impl="triton")
    mp = trainer.optimizers[0]
    assert type(mp).__name__ == type(ref_mp).__name__ == "FusedAdamW" and trains_shards(mp.model_params())
    assert model.skipped == [False, True, False]
    check_same(model, trainer, ref_model, ref_mp, ref)


def test_sums_bf16_micro_batches_in_fp32(world_of_one):
    # Lightning reduce-scatters every micro-batch under ModelParallelStrategy (it has no no_sync for fully_shard),
    # so "auto" takes fp32 sums at any world size
    batches = make_batches(6)
    ref_model, ref_mp, _, ref = oracle(torch.bfloat16, batches, grad_accum_dtype="fp32")
    trainer, model = _fit_sharded("bf16", batches, grad_accum_dtype="auto")
    assert trainer.optimizers[0].grad_accum_dtype == "fp32"
    check_same(model, trainer, ref_model, ref_mp, ref)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_checkpoint_resumes_bit_exact(name, world_of_one, tmp_path):
    dtype, batches = DTYPES[name], with_inf(make_batches(4), 2)
    ref_model, ref_mp, _, ref = oracle(dtype, batches * 2)
    trainer, _ = _fit_sharded(name, batches, epochs=1)
    path = tmp_path / "epoch1.ckpt"
    trainer.save_checkpoint(path)
    assert (path / ".metadata").is_file() and (optimizer_path(path, 0) / ".metadata").is_file()

    trainer2, model2 = _fit_sharded(name, batches, epochs=2, seed=123, ckpt_path=str(path))
    check_same(model2, trainer2, ref_model, ref_mp, ref, first=2)


def test_plain_model_parallel_strategy_is_refused_with_the_fix(world_of_one):
    strategy = strategies.ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    match = r"ModelParallelStrategy\) saves and loads each optimizer through .*HalfprecModelParallelStrategy"
    with pytest.raises(ValueError, match=match):
        _fit_sharded("bf16", make_batches(2), strategy=strategy)


def test_a_gathered_checkpoint_is_refused():
    with pytest.raises(
        ValueError, match=r"save_distributed_checkpoint=False.*leave save_distributed_checkpoint"
    ):
        HalfprecModelParallelStrategy(save_distributed_checkpoint=False)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("FSDPStrategy", r"it is FSDP1: .*use strategy=HalfprecModelParallelStrategy\(data_parallel_size=N"),
        ("DeepSpeedStrategy", r"alternatives, not layers: .*HalfprecModelParallelStrategy"),
        ("ModelParallelStrategy", r"torch's own optimizer format.*HalfprecModelParallelStrategy\(\.\.\.\)"),
    ],
    ids=["FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"],
)
def test_strategies_the_plugin_cannot_take_are_refused_with_the_fix(name, match):
    strategy = object.__new__(getattr(strategies, name))  # built without its launcher: only its type is read
    with pytest.raises(ValueError, match=rf"Trainer\(strategy={name}\) .*{match}"):
        check_trainer_strategy(strategy)
    for fine in (strategies.DDPStrategy, strategies.SingleDeviceStrategy, HalfprecModelParallelStrategy):
        check_trainer_strategy(object.__new__(fine))
    check_trainer_strategy(None)


def test_fabric_strategies_that_shard_in_setup_are_refused(world_of_one):
    import lightning.fabric.strategies as fabric_strategies
    from lightning.fabric import Fabric

    # Fabric's ModelParallelStrategy shards in fabric.setup, after setup_fabric would have built the masters
    strategy = fabric_strategies.ModelParallelStrategy(
        lambda module, mesh: shard(module, mesh["data_parallel"])
    )
    fabric = Fabric(
        accelerator="cpu", devices=1, strategy=strategy, plugins=[HalfprecFabricPrecision(torch.bfloat16)]
    )
    fabric.launch()
    model = make_model()
    match = r"Fabric\(strategy=ModelParallelStrategy\) shards the module inside fabric.setup.*train nothing"
    with pytest.raises(ValueError, match=match):
        setup_fabric(fabric, model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert [p.dtype for p in model.parameters()] == [torch.float32] * 4  # refused before anything was cast
    for name in ("FSDPStrategy", "DeepSpeedStrategy"):
        with pytest.raises(ValueError, match=rf"Fabric\(strategy={name}\) shards the module"):
            check_fabric_strategy(object.__new__(getattr(fabric_strategies, name)))
    check_fabric_strategy(object.__new__(fabric_strategies.DDPStrategy))
