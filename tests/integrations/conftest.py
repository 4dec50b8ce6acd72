"""Fixtures of the integration tests."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path):
    """This process as the one gloo rank of a world of size 1, with the environment the tools' launchers leave
    (RANK, LOCAL_RANK, WORLD_SIZE, ...); the environment, the process group and Accelerate's singletons are put
    back afterwards."""
    from accelerate.state import AcceleratorState, GradientState

    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else Accelerate sets the threads
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
