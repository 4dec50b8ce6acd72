"""FSDP2 (``fully_shard``, DTensor params) under Accelerate and the HF Trainer, and the helpers every adapter
shares (``integrations/fsdp.py``), on CPU with gloo in a world of one (Lightning: test_lightning_strategy.py).

- Accelerate: the 16-bit model is prepared first (Accelerate's ``fully_shard``), then the halfprec optimizer
  over its shards; the oracle is the plain halfprec loop (``_oracle.plain_loop``) over the same ``fully_shard``-ed
  model with the same optimizer, bit for bit, an overflow skip included. Accelerate turns FSDP on only on
  accelerators (its ``AcceleratorState`` keeps the plugin for MULTI_GPU and the like, not MULTI_CPU), so these
  tests set the state its GPU launch sets (``distributed_type`` FSDP, the plugin); its FSDP2 code
  (``fsdp2_prepare_model``, ``no_sync`` through ``set_requires_gradient_sync``) does not depend on the device.
  The oracle does not check the clipping against ``clip_grad_norm_`` here: over shards the norm is
  fp32(sqrt(fp64 sum of squares)) (docs/guarantees.md, FSDP2).
- The HF Trainer: refused, with why and the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, GradientAccumulationPlugin  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import halfprec  # noqa: E402
from halfprec.integrations import accelerate as hp_accelerate  # noqa: E402
from halfprec.integrations.fsdp import trains_shards  # noqa: E402
from halfprec.prepare import fp32_rows, start_masters_from  # noqa: E402

from ._oracle import (  # noqa: E402
    CLIP,
    DTYPES,
    LR,
    Record,
    make_batches,
    make_loader,
    make_model,
    make_scaler,
    make_scheduler,
    plain_loop,
)
from ._shards import assert_same_shards, same_floats, shard, with_inf  # noqa: E402
from .test_accelerate import _train  # noqa: E402


# --- the shared helpers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp32_rows_are_kept_through_the_cast_and_start_the_masters(world_of_one, impl):
    """Either strategy over the shards (the fused one under Triton's interpreter) starts from the fp32 rows."""
    model = shard(make_model())
    whole = [p.full_tensor().clone() for p in model.parameters()]
    rows = fp32_rows(model)
    model.to(torch.bfloat16)  # fully_shard's modules re-lay their shards out
    assert [r.dtype for r in rows.values()] == [torch.float32] * 4
    mp = halfprec.MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), impl=impl)
    assert mp.impl == impl
    start_masters_from(mp, rows)
    for m, w in zip(mp.master_params(), whole, strict=True):
        torch.testing.assert_close(m, w, rtol=0, atol=0)  # world of one: the rows are the whole tensor
    for p, w in zip(mp.model_params(), whole, strict=True):  # the shards are the masters rounded
        assert torch.equal(p.full_tensor(), w.bfloat16())
    assert trains_shards(mp.model_params()) and not trains_shards(make_model().parameters())


# --- Accelerate: FSDP2 -----------------------------------------------------------------------------------
def fsdp_accelerator(accum: int, *, sync_each_batch: bool = False, version: int = 2) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    accelerator = Accelerator(
        cpu=True,
        mixed_precision="no",
        fsdp_plugin=plugin,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=accum, sync_each_batch=sync_each_batch
        ),
    )
    # what Accelerate sets on an accelerator (module docstring), in both of its shared states, as it does
    for state in (accelerator.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def accelerate_oracle(dtype, batches, accum, grad_accum_dtype="param", *, sync_each_batch=False):
    """The plain loop over the 16-bit model sharded as Accelerate's default policy does (the root only), each
    micro-batch but a step's last under no_sync unless ``sync_each_batch``, as ``accelerator.accumulate`` runs
    them; the LR schedule stepped once per process at each step, as ``AcceleratedScheduler`` steps it."""
    model = make_model().to(dtype)
    fully_shard(model)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    mp = halfprec.MixedPrecisionOptimizer(
        inner,
        loss_scaler=make_scaler(dtype),
        max_grad_norm=CLIP,
        impl="torch",
        grad_accum_dtype=grad_accum_dtype,
    )
    sched = _PerProcess(make_scheduler(mp), dist.get_world_size())
    sync = sync_each_batch and dist.get_world_size() > 1  # Accelerate honours it on several processes only
    return plain_loop(
        dtype, batches, accum=accum, model=model, mp=mp, sched=sched, max_grad_norm=None, gradient_sync=sync
    )


class _PerProcess:
    """``scheduler`` stepped ``times`` at each step (``AcceleratedScheduler`` with ``split_batches=False``)."""

    def __init__(self, scheduler, times: int) -> None:
        self.scheduler, self.times = scheduler, times

    def step(self) -> None:
        for _ in range(self.times):
            self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()


def accelerate_fsdp2(dtype, batches, accum, *, sync_each_batch=False, grad_accum_dtype="auto"):
    accelerator = fsdp_accelerator(accum, sync_each_batch=sync_each_batch)
    model = hp_accelerate.prepare(accelerator, make_model().to(dtype))  # sharded here, by Accelerate
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    mp = hp_accelerate.wrap_optimizer(
        accelerator, inner, loss_scaler=make_scaler(dtype), max_grad_norm=CLIP, impl="torch",
        grad_accum_dtype=grad_accum_dtype,
    )  # fmt: skip
    model, opt, loader, sched = hp_accelerate.prepare(
        accelerator, model, mp, make_loader(batches), make_scheduler(mp)
    )
    return accelerator, model, mp, opt, loader, sched


@pytest.mark.parametrize(("name", "accum"), [("bf16", 2), ("fp16", 2), ("bf16", 1)])
def test_accelerate_fsdp2_matches_plain_loop(name, accum, world_of_one):
    dtype = DTYPES[name]
    batches = with_inf(make_batches(6), 2)  # the step of batch 2 is skipped
    ref_model, ref_mp, _, ref = accelerate_oracle(dtype, batches, accum)
    accelerator, model, mp, opt, loader, sched = accelerate_fsdp2(dtype, batches, accum)
    assert accelerator.is_fsdp2 and trains_shards(mp.model_params()) and opt.optimizer is mp
    assert hp_accelerate.prepare(accelerator, opt) is opt  # prepared once
    assert mp.grad_accum_dtype == "param"  # "auto": accumulate() turns gradient sync off, so 16-bit sums
    rec, seen = Record(), []
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec, skip_seen=seen)
    assert seen == ref.skipped and True in seen  # accelerator.optimizer_step_was_skipped
    assert same_floats(rec.losses, ref.losses) and same_floats(rec.grad_norms, ref.grad_norms)
    assert (rec.lrs, rec.skipped, rec.scales) == (ref.lrs, ref.skipped, ref.scales)
    assert_same_shards(model, mp, ref_model, ref_mp)


def test_accelerate_fsdp2_refuses_an_optimizer_over_the_whole_params(world_of_one):
    accelerator = fsdp_accelerator(1)
    model = make_model()
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), param_dtype=torch.bfloat16
    )
    masters = [m for g in mp.param_groups for m in g["params"]]
    with pytest.raises(ValueError, match=r"not FSDP2 shards.*prepare it alone first.*model.parameters\(\)"):
        hp_accelerate.prepare(accelerator, model, mp)
    assert [
        m for g in mp.param_groups for m in g["params"]
    ] == masters  # refused before Accelerate touched it
    assert not trains_shards(model.parameters())


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_accelerate_fsdp2_refuses_fp32_sums_that_accumulate_would_not_sync(sync_each_batch, world_of_one):
    # accumulate() turns FSDP2's gradient sync off on all but the last micro-batch; sync_each_batch=True keeps it
    # on only on several processes (Accelerator.accumulate reads use_distributed)
    accelerator = fsdp_accelerator(2, sync_each_batch=sync_each_batch)
    model = hp_accelerate.prepare(accelerator, make_model().to(torch.bfloat16))
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    assert hp_accelerate.wrap_optimizer(accelerator, inner).grad_accum_dtype == "param"  # "auto"
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    match = r"grad_accum_dtype='fp32'.*sync_each_batch=True\); else use grad_accum_dtype='param'"
    with pytest.raises(ValueError, match=match):
        hp_accelerate.wrap_optimizer(accelerator, inner, grad_accum_dtype="fp32")
    mp = halfprec.MixedPrecisionOptimizer(
        inner, grad_accum_dtype="fp32"
    )  # built directly: refused at prepare
    with pytest.raises(ValueError, match=match):
        hp_accelerate.prepare(accelerator, model, mp)


def test_accelerate_fsdp1_is_refused_with_the_fix(world_of_one):
    accelerator = fsdp_accelerator(1, version=1)
    model = make_model()
    mp = halfprec.MixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), param_dtype=torch.bfloat16
    )
    match = r"FSDP1 \(fsdp_version=1\).*fsdp_version=2\), prepare the 16-bit model"
    with pytest.raises(ValueError, match=match):
        hp_accelerate.prepare(accelerator, model, mp)
    with pytest.raises(ValueError, match=match):
        hp_accelerate.attach(accelerator)


# --- the HF Trainer: refused -----------------------------------------------------------------------------
_TRAINER_FSDP = (
    r"the Trainer builds the optimizer over the whole model.*train FSDP2 with halfprec under Accelerate"
)


def test_hf_trainer_fsdp1_is_refused_with_why_and_the_fix(tmp_path):
    from transformers import TrainingArguments

    from halfprec.integrations.hf import check_training_args

    args = TrainingArguments(tmp_path, fsdp=True, fsdp_config={"version": 1}, use_cpu=True, report_to="none")
    match = r"fsdp=True\): FSDP1 wraps the model in FullyShardedDataParallel.*train FSDP2 with halfprec under"
    with pytest.raises(ValueError, match=match):
        check_training_args(args)


def test_hf_trainer_fsdp_arguments_are_refused_with_why_and_the_fix(tmp_path):
    from transformers import TrainingArguments

    from halfprec.integrations.hf import check_training_args

    args = TrainingArguments(tmp_path, fsdp=True, fsdp_config={"version": 2}, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=True\): under FSDP2 " + _TRAINER_FSDP):
        check_training_args(args)


def test_hf_trainer_under_an_accelerate_config_with_fsdp_is_refused(world_of_one, tmp_path):
    # accelerate launch with FSDP in its config: the Trainer's own Accelerator has the plugin, fsdp= is unset
    from transformers import TrainingArguments

    from halfprec.integrations.hf import HalfprecTrainer

    from .test_hf import RegressionModel

    args = TrainingArguments(tmp_path, use_cpu=True, report_to="none", save_strategy="no")
    assert args.device.type == "cpu"  # sets Accelerate's state up afresh, once
    fsdp_accelerator(1)  # the state accelerate launch leaves (module docstring)
    with pytest.raises(
        ValueError, match=r"the Accelerate config turns FSDP on: under FSDP2 " + _TRAINER_FSDP
    ):
        HalfprecTrainer(model=RegressionModel(), args=args, param_dtype=torch.bfloat16)
