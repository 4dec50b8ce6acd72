"""Plain data at save time: what ``torch.load(weights_only=True)`` cannot load is refused; RNG states restored."""

from __future__ import annotations

import pytest
import torch

from ..engine_util import build, train


def test_state_that_weights_only_cannot_load_is_refused_at_save(tmp_path):
    import numpy as np

    engine = build("bf16")
    engine.lr_scheduler.base_lrs = [np.float64(3e-3)]  # numpy scalars do not load with weights_only=True
    with pytest.raises(ValueError, match="lr_scheduler.state_dict\\(\\)\\['base_lrs'\\]\\[0\\] is a float64"):
        engine.save_checkpoint(tmp_path)


def test_python_and_numpy_rng_states_are_restored(tmp_path):
    import random

    import numpy as np

    engine = build("bf16")
    train(engine, 1)
    random.seed(7)
    np.random.seed(7)
    engine.save_checkpoint(tmp_path)
    expected = (random.random(), float(np.random.rand()), torch.rand(1))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    build("bf16", seed=3).load_checkpoint(tmp_path)
    assert (random.random(), float(np.random.rand()), torch.rand(1)) == expected
