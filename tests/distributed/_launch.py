"""Start N real gloo processes (meeting at a store this process hosts) running one scenario of ``_worker.py``; or make this
process a world of one (``one_process_group``)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tests.rendezvous import rendezvous_env

__all__ = ["launch", "one_process_group", "results"]

WORKER = Path(__file__).with_name("_worker.py")


def launch(
    world_size: int, scenario: str, out: Path, *, timeout: float = 150.0, expect_ok: bool = True, **kwargs
):
    """Run ``scenario`` on ``world_size`` ranks; return the exit codes. Results land in ``out/result-R.pt``."""
    out.mkdir(parents=True, exist_ok=True)
    args = out / f"args-{scenario}.json"
    args.write_text(json.dumps({"out": str(out), **kwargs}))
    with rendezvous_env(world_size) as meeting:
        procs, logs = [], []
        src = str(Path(__file__).resolve().parents[2] / "src")
        for rank in range(world_size):
            env = {**os.environ, **meeting}
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]),
            )
            log = open(out / f"log-{scenario}-{rank}.txt", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), scenario, str(args)], env=env, stdout=log, stderr=log
                )
            )
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
    for log in logs:
        log.close()
    if expect_ok and any(codes):
        text = "\n".join(
            f"--- rank {r} (exit {c}{_saved(out, r)}) ---\n"
            + (out / f"log-{scenario}-{r}.txt").read_text()[-4000:]
            for r, c in enumerate(codes)
        )
        raise AssertionError(f"scenario {scenario!r} failed on {world_size} ranks:\n{text}")
    return codes


def _saved(out: Path, rank: int) -> str:
    """Whether the rank got as far as saving its result (a crash after it is a teardown crash)."""
    return ", result saved" if (out / f"result-{rank}.pt").exists() else ", no result"


def results(out: Path, world_size: int) -> list:
    return [torch.load(out / f"result-{r}.pt", weights_only=True) for r in range(world_size)]


@contextlib.contextmanager
def one_process_group(backend: str, store: Path):
    """This process as rank 0 of a world of size 1 (``store``: a file for the rendezvous)."""
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
