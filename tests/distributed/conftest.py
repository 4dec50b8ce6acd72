"""Shared multi-process runs: each launch costs seconds, so every test module reads the same few launches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from _launch import launch, one_process_group, results  # noqa: E402

STEPS, MORE = 4, 2

SHARDED2 = [
    {"dtype": "bf16", "opt": "adamw", "stage": 1, "reduce": "fp32"},
    {"dtype": "fp16", "opt": "adamw", "stage": 2, "reduce": "fp32", "poison": [[2, 1]]},
    {"dtype": "fp16", "opt": "adamw", "stage": 1, "reduce": "param"},
    {"dtype": "bf16", "opt": "adamw", "stage": 2, "reduce": "param", "clip": 0.05},
    {"dtype": "bf16", "opt": "sgd", "stage": 1, "reduce": "fp32", "micro": 3},
    {"dtype": "fp16", "opt": "adagrad", "stage": 2, "reduce": "fp32", "micro": 2, "param_dtype": True},
]
DDP2 = [
    {"dtype": "bf16", "opt": "adamw", "clip": 0.5},
    {"dtype": "fp16", "opt": "adamw", "poison": [[2, 1]], "micro": 2},
]
SHARDED3 = [
    {"dtype": "bf16", "opt": "adamw", "stage": 1, "reduce": "fp32"},
    {"dtype": "fp16", "opt": "adamw", "stage": 2, "reduce": "param", "poison": [[1, 2]]},
]
SHARDED4 = [{"dtype": "bf16", "opt": "adamw", "stage": 2, "reduce": "fp32", "bucket": 64}]
CKPT = [
    {"dtype": "fp16", "opt": "adamw", "stage": 2, "reduce": "fp32", "poison": [[1, 0]]},
    {"dtype": "bf16", "opt": "adagrad", "stage": 1, "reduce": "param"},
]


class Runs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, list] = {}

    def _run(self, key: str, world: int, parts: list) -> list:
        if key not in self._cache:
            launch(world, "multi", self.root, parts=parts)
            self._cache[key] = results(self.root, world)
        return self._cache[key]

    def two(self) -> list:
        return self._run(
            "two",
            2,
            [
                ["ddp", {"configs": DDP2, "steps": STEPS}],
                ["sharded", {"configs": SHARDED2, "steps": STEPS}],
                ["ckpt_save", {"configs": CKPT, "steps": STEPS, "more": MORE}],
                ["misc", {}],
            ],
        )

    def reshard(self, world: int, target: str, extra: list | None = None) -> list:
        self.two()
        parts = [["ckpt_reshard", _reshard_args("A", target, resume=False)]] + (extra or [])
        return self._run(f"reshard{world}", world, parts)

    def three(self) -> list:
        return self.reshard(3, "C", [["sharded", {"configs": SHARDED3, "steps": STEPS}]])

    def four(self) -> list:
        return self.reshard(4, "D", [["sharded", {"configs": SHARDED4, "steps": STEPS}]])

    def one(self) -> list:
        return self.reshard(1, "E")

    def back(self) -> list:
        self.three()
        return self._run("back", 2, [["ckpt_reshard", _reshard_args("C", "F", resume=True)]])


def _reshard_args(source: str, target: str, *, resume: bool) -> dict:
    return {
        "configs": CKPT,
        "steps": STEPS,
        "more": MORE,
        "source": source,
        "target": target,
        "resume": resume,
    }


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("dist"))


@pytest.fixture
def one_rank(tmp_path):
    """This process as the one gloo rank of a world of size 1."""
    with one_process_group("gloo", tmp_path / "store"):
        yield
