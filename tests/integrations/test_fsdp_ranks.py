"""The FSDP2 integrations on 2 gloo ranks (``_fsdp_ranks.py``): Lightning's ``HalfprecModelParallelStrategy``
and Accelerate's FSDP2, each bit for bit its plain halfprec loop over the same shards, with uneven shards, the
norm and overflow flag reduced over both ranks, and an overflow on one rank skipping the step on both."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from tests.rendezvous import rendezvous_env  # noqa: E402

from ._fsdp_ranks import CASES  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp_ranks")
    procs = []
    with rendezvous_env(WORLD) as meeting:
        for rank in range(WORLD):
            env = {
                **os.environ,
                **meeting,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
            }
            log = open(out / f"log-{rank}.txt", "w")  # noqa: SIM115 - closed below
            cmd = [sys.executable, "-m", "tests.integrations._fsdp_ranks", str(out)]
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log), log))
        codes = []
        for proc, log in procs:
            try:
                codes.append(proc.wait(timeout=300))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
            log.close()
    logs = "\n".join((out / f"log-{r}.txt").read_text()[-3000:] for r in range(WORLD))
    assert codes == [0] * WORLD, f"exit codes {codes}:\n{logs}"
    return [torch.load(out / f"result-{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_plain_loop_on_two_ranks(case, ranks):
    for rank, results in enumerate(ranks):
        assert results[case] == "ok", f"rank {rank}:\n{results[case]}"
