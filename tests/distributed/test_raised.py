"""A backward that raises part-way (an OOM retry loop, a failing hook), caught, on 1 and 2 gloo ranks.

The contract, as in torch: the raised backward keeps the grads it produced; ``zero_grad()`` drops them, after
which training equals a run that never raised, bit for bit; without it the next backward adds to them and a step
applies them, exactly as if that backward had been one of the part it reached (``_raised.py``). ZeRO stages 1
and 2 (reduce_dtype fp32 and param, fp32 accumulation), ZeRO-0 with a group and, on one rank, the unsharded
optimizer; the exact and the fused local step (Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch
from _compare import assert_equal
from _launch import launch, results
from _raised import configs, label, schedules

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU params)")

WORLDS = (1, 2)
CASES = [(world, label(cfg), name) for world in WORLDS for cfg in configs(world) for name in schedules(cfg)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``worlds(n)``: the ranks' results at world size ``n``, launched at the first call."""
    cache: dict = {}

    def get(world: int) -> list:
        if world not in cache:
            path = tmp_path_factory.mktemp(f"raised{world}")
            launch(world, "raised", path, timeout=600.0)
            cache[world] = results(path, world)
        return cache[world]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("world", "config", "schedule"), CASES, ids=[f"w{w}-{c}-{s}" for w, c, s in CASES])
def test_training_after_a_raised_backward_equals_its_oracle(worlds, world, config, schedule):
    for rank, r in enumerate(worlds(world)):
        run = r[config][schedule]
        actions = run["actions"]
        assert run["got"]["raised"] == sum(a.startswith("raise") for a in actions), f"rank {rank}"
        assert_equal(
            run["got"]["state"], run["want"]["state"], f"{config}, {schedule}, rank {rank} of {world}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_the_raised_backwards_grads_matter(worlds, world):
    """Keeping or dropping the raised backward's grads trains differently (else the oracles prove nothing)."""
    for cfg in configs(world):
        runs = worlds(world)[0][label(cfg)]
        kept, dropped = runs["add"]["want"]["state"], runs["zero_grad"]["want"]["state"]
        assert not torch.equal(kept["param layers.5.weight"], dropped["param layers.5.weight"]), label(cfg)
