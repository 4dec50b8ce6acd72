"""Grads that reach a ZeRO-1/2 step other than as one hook call per param per backward, on 2 gloo ranks, against a
plain fp32 torch SGD (momentum) fed the mean grad (``_grads.py``).

A shared layer applied twice under reentrant activation checkpointing fires its params' hooks twice in one
backward: both contributions reach the step, and a bucket waits for its params, not for a count of hook calls.
Grads assigned to ``.grad``, zeroed in place or set to None after backward reach the step as local grads of the
rank that changed them (reduced, the mean over ranks), and a step where nothing changed runs no collective beyond
the usual ones. Stages 1 and 2, fp32 and 16-bit accumulation, one and two micro-batches, bit for bit. A stage-2
16-bit contribution that arrives after its bucket's reduction started (before the reducer learnt that the param's
hook runs twice) cannot join its backward's 16-bit sum: it is reduced with the next backward's, or on its own and
added in fp32 (as stage 2 adds micro-batches); the oracle sums it so. The fused local step (Triton's interpreter)
reads the same shard: its masters within the fused path's tolerance.
"""

from __future__ import annotations

import pytest
import torch
from _compare import assert_equal, labelled, stitch
from _launch import launch, results
from tests.tolerances import tol

BIG = 2**23
INTERPRETER = not torch.cuda.is_available()  # the fused step on CPU params runs in Triton's interpreter
TWICE = [
    {"model": "shared", "stage": stage, "accum": accum, "micro": micro, "bucket": bucket, "steps": 3,
     "no_sync": no_sync}
    for stage in (1, 2)
    for accum in ("fp32", "param")
    for micro in (1, 2)
    for bucket in (40, BIG)
    for no_sync in ((False, True) if micro == 2 and (stage == 1 or accum == "fp32") else (False,))
] + [
    # the grads reduced in the 16-bit dtype
    {"model": "shared", "stage": stage, "accum": "param", "micro": micro, "bucket": 40, "steps": 3,
     "no_sync": False, "reduce": "param"}
    for stage in (1, 2)
    for micro in (1, 2)
] + [
    # the fused local step (Triton's interpreter) reads the shard the reductions left
    {"model": "shared", "stage": stage, "accum": accum, "micro": micro, "bucket": 40, "steps": 2,
     "no_sync": False, "impl": "triton"}
    for stage, accum, micro in ((1, "fp32", 1), (2, "param", 2))
    if INTERPRETER
]  # fmt: skip
# (edit, whether the backward reaches b): "_rank0" edits on rank 0 only; zeroing in place needs a grad to zero,
# which only stage 1 with 16-bit accumulation leaves in .grad
EDITS = [
    ("none", True),
    ("assign", True),
    ("assign_rank0", True),
    ("assign", False),
    ("assign_rank0", False),
    ("drop", True),
    ("drop_rank0", True),
    ("zero_rank0", True),
]
EDIT_CONFIGS = [
    {"model": "pair", "stage": stage, "accum": accum, "micro": micro, "bucket": 40, "steps": 2, "edit": edit,
     "use_b": use_b, "unscale_first": first}
    for stage in (1, 2)
    for accum in ("fp32", "param")
    for micro in (1, 2)
    for edit, use_b in EDITS
    for first in ((False, True) if edit == "assign" and use_b else (False,))
    if not (edit.startswith("zero") and (stage, accum) != (1, "param"))
] + [
    {"model": "pair", "stage": stage, "accum": "param", "micro": 1, "bucket": 40, "steps": 2, "edit": edit,
     "use_b": use_b, "unscale_first": False, "reduce": "param"}
    for stage in (1, 2)
    for edit, use_b in (("assign", True), ("assign_rank0", False), ("drop_rank0", True), ("zero_rank0", True))
    if not (edit.startswith("zero") and stage != 1)
] + [
    {"model": "pair", "stage": stage, "accum": "param", "micro": 1, "bucket": 40, "steps": 2, "edit": edit,
     "use_b": use_b, "unscale_first": False, "impl": "triton"}
    for stage, edit, use_b in ((1, "zero_rank0", True), (2, "assign_rank0", False))
    if INTERPRETER
]  # fmt: skip


def _label(cfg: dict) -> str:
    keys = (
        "stage",
        "accum",
        "reduce",
        "micro",
        "bucket",
        "no_sync",
        "edit",
        "use_b",
        "unscale_first",
        "impl",
    )
    return "-".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("grads")
    launch(2, "grads", out, twice=TWICE, edits=EDIT_CONFIGS, timeout=600.0)
    return results(out, 2)


def _check(ranks: list, key: str, i: int, cfg: dict) -> None:
    where = _label(cfg)
    for step, records in enumerate(zip(*(r[key][i]["steps"] for r in ranks), strict=True)):
        at = f"{where}, step {step}"
        masters, _ = stitch([rec["pieces"] for rec in records])
        want = {n: m.reshape(-1) for n, m in records[0]["masters"].items()}
        if cfg.get("impl") == "triton":
            for name, ref in want.items():
                torch.testing.assert_close(
                    masters[name], ref, **tol("fused_master", torch.bfloat16), msg=labelled(f"{at}: {name}")
                )
        else:
            assert_equal(masters, want, f"{at}: masters")
            rounded = {n: m.bfloat16() for n, m in records[0]["masters"].items()}
            for rank, rec in enumerate(records):
                assert_equal(rec["params"], rounded, f"{at}, rank {rank}: 16-bit params")
        assert_equal(records[1]["params"], records[0]["params"], f"{at}: rank 1 vs rank 0 params")


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(TWICE)), ids=[_label(c) for c in TWICE])
def test_a_hook_firing_twice_in_one_backward_reaches_the_step(ranks, i):
    _check(ranks, "twice", i, TWICE[i])


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(EDIT_CONFIGS)), ids=[_label(c) for c in EDIT_CONFIGS])
def test_grads_changed_after_backward_reach_the_step(ranks, i):
    _check(ranks, "edits", i, EDIT_CONFIGS[i])


def _untouched(cfg: dict) -> bool:
    """No rank's ``.grad`` changed: no edit, or dropping a grad the hooks had already released."""
    return cfg["edit"] == "none" or (
        cfg["edit"].startswith("drop") and (cfg["stage"], cfg["accum"]) != (1, "param")
    )


@pytest.mark.slow
@pytest.mark.parametrize("i", [i for i, c in enumerate(EDIT_CONFIGS) if _untouched(c)])
def test_a_step_where_no_grad_changed_runs_only_its_own_collectives(ranks, i):
    """One all-reduce (norm and flags) and one all-gather per bucket: no reduction is redone."""
    for rank, r in enumerate(ranks):
        run = r["edits"][i]
        for step, seen in enumerate(run["collectives"]):
            assert seen == {"allreduce_": 1, "_allgather_base_": run["buckets"]}, (
                f"{_label(EDIT_CONFIGS[i])}, rank {rank}, step {step}: {seen}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("i", [i for i, c in enumerate(EDIT_CONFIGS) if not _untouched(c)])
def test_a_step_after_an_edit_on_any_rank_reduces_again_on_every_rank(ranks, i):
    for rank, r in enumerate(ranks):
        for step, seen in enumerate(r["edits"][i]["collectives"]):
            assert seen.get("_reduce_scatter_base_", 0) >= 1, (
                f"{_label(EDIT_CONFIGS[i])}, rank {rank}, step {step}: {seen}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_engine_with_reentrant_checkpointing_equals_stage_0(ranks, stage, gas):
    """The engine's loop on the shared-layer model, fp32 accumulation: ZeRO-1/2 train as ZeRO-0, bit for bit."""
    for rank, r in enumerate(ranks):
        got, want = r["engine"][f"{stage}-{gas}"], r["engine"][f"0-{gas}"]
        assert_equal(got, want, f"engine, stage {stage}, {gas} micro-batches, rank {rank}")
