"""One rank of the 2-rank FSDP2 integration tests: ``python -m tests.integrations._fsdp_ranks OUT`` (cwd: the
repository root; env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), launched by
test_fsdp_ranks.py.

Each case trains through the tool and through its plain-loop oracle (the world-of-one tests' oracles, here over
a mesh of both ranks, each rank with its own batches) and compares them on this rank, bit for bit; ``OUT``
receives ``{case: "ok" or the failure}`` as ``OUT/result-RANK.pt``. Rank 0's first batch of optimizer step 1
holds an inf, so that step is skipped on both ranks (the overflow flag is all-reduced).

- Lightning (``HalfprecModelParallelStrategy(data_parallel_size=2)``): bf16 (fp32 sums) and fp16, each rank
  fed its own batches (no DistributedSampler, which would shuffle them); and fp16 saved after one epoch (each
  rank its rows) and resumed by a new Trainer over a model of another init.
- Accelerate (FSDP2 state set as in test_fsdp.py): Accelerate's prepared loader gives rank r batches r, r + 2,
  ...; bf16 with ``sync_each_batch=True`` (fp32 sums, which need every micro-batch reduce-scattered) and fp16
  with Accelerate's default (``no_sync`` on the first micro-batch, 16-bit sums).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ._oracle import DTYPES, Record, make_batches, make_loader
from ._shards import assert_same_shards, same_floats, with_inf

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _lightning_fit(name: str, batches, *, epochs: int = 1, seed: int = 0, ckpt_path=None):
    import lightning.pytorch as L

    from halfprec.integrations.lightning import HalfprecModelParallelStrategy, HalfprecPrecision

    from ._oracle import CLIP, make_scaler
    from .test_lightning_strategy import ShardedLit

    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=HalfprecModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        plugins=[HalfprecPrecision(DTYPES[name], loss_scaler=make_scaler(DTYPES[name]), impl="torch")],
        max_epochs=epochs,
        gradient_clip_val=CLIP,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = ShardedLit(seed)
    trainer.fit(model, make_loader(batches), ckpt_path=ckpt_path)
    return trainer, model


def _lightning_batches(n: int):
    batches = make_batches(n, seed=1 + RANK)
    return with_inf(batches, 2) if RANK == 0 else batches


def lightning_case(name: str) -> None:
    from .test_lightning_strategy import check_same, oracle

    batches = _lightning_batches(6)
    accum_dtype = "fp32" if name == "bf16" else "param"  # "auto": Lightning reduce-scatters every micro-batch
    ref_model, ref_mp, _, ref = oracle(DTYPES[name], batches, accum_dtype)
    trainer, model = _lightning_fit(name, batches)
    assert trainer.optimizers[0].grad_accum_dtype == accum_dtype
    assert model.skipped == [False, True, False], model.skipped
    check_same(model, trainer, ref_model, ref_mp, ref)


def lightning_resume_case(name: str, out: Path) -> None:
    """Save after one epoch (each rank its rows), resume in a new Trainer and model (another init)."""
    from .test_lightning_strategy import check_same, oracle

    batches = _lightning_batches(4)
    ref_model, ref_mp, _, ref = oracle(DTYPES[name], batches * 2, "param")
    trainer, _ = _lightning_fit(name, batches)
    path = out / f"{name}.ckpt"  # a directory every rank sees
    trainer.save_checkpoint(path)
    trainer2, model2 = _lightning_fit(name, batches, epochs=2, seed=123, ckpt_path=str(path))
    check_same(model2, trainer2, ref_model, ref_mp, ref, first=2)


def accelerate_case(name: str, sync_each_batch: bool) -> None:
    from accelerate.state import AcceleratorState, GradientState

    from .test_accelerate import _train
    from .test_fsdp import accelerate_fsdp2, accelerate_oracle

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    dtype, batches = DTYPES[name], with_inf(make_batches(12), 4)  # rank 0 gets 0, 2, 4, ...: step 1
    accum_dtype = "fp32" if sync_each_batch else "param"
    mine = batches[RANK::WORLD]
    ref_model, ref_mp, _, ref = accelerate_oracle(
        dtype, mine, 2, accum_dtype, sync_each_batch=sync_each_batch
    )
    accelerator, model, mp, opt, loader, sched = accelerate_fsdp2(
        dtype, batches, 2, sync_each_batch=sync_each_batch
    )
    assert mp.grad_accum_dtype == accum_dtype, mp.grad_accum_dtype  # "auto"
    rec = Record()
    _train(accelerator, model, mp, opt, loader, sched, dtype, rec)
    assert rec.skipped == ref.skipped == [False, True, False], (rec.skipped, ref.skipped)
    assert same_floats(rec.losses, ref.losses) and same_floats(rec.grad_norms, ref.grad_norms)
    assert (rec.lrs, rec.scales) == (ref.lrs, ref.scales)
    assert_same_shards(model, mp, ref_model, ref_mp)


CASES = {
    "lightning-bf16": lambda out: lightning_case("bf16"),
    "lightning-fp16": lambda out: lightning_case("fp16"),
    "lightning-resume-fp16": lambda out: lightning_resume_case("fp16", out),
    "accelerate-bf16-sync-each-batch": lambda out: accelerate_case("bf16", True),
    "accelerate-fp16": lambda out: accelerate_case("fp16", False),
}


def main(out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # else Accelerate picks the threads
    dist.init_process_group("gloo")
    results = {}
    for case, run in CASES.items():
        torch.manual_seed(0)
        try:
            run(out)
            results[case] = "ok"
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[case] = traceback.format_exc()[-3000:]
        dist.barrier()
    torch.save(results, out / f"result-{RANK}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
