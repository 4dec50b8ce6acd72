"""``bench_train.live_at_peak``: the blocks live at an allocator trace's peak, by the site that allocated them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_train", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
)
bench_train = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_train", bench_train)  # its dataclasses look their module up
_spec.loader.exec_module(bench_train)

TORCH_FRAME = {"filename": "/env/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"}


def frame(name: str, line: int) -> dict:
    return {"filename": f"/repo/src/{name}.py", "line": line, "name": name}


def alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int, size: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def test_live_at_peak_sums_the_blocks_live_at_the_peak_by_their_site():
    trace = [
        alloc(1, 100, frame("model", 3)),  # before the window: still live at the peak
        alloc(2, 500, frame("model", 3)),
        free(2, 500),  # the earlier, higher peak (600) is outside the window
        alloc(3, 50, TORCH_FRAME, frame("optim", 7)),  # torch's frame skipped: optim.py's
        alloc(4, 70),  # no Python frame: autograd's thread
        alloc(5, 30, TORCH_FRAME, frame("optim", 7)),
        {
            "action": "free_completed",
            "addr": 3,
            "size": 50,
            "frames": [],
        },  # no drop: counted at free_requested
        free(5, 30),
        free(3, 50),
        alloc(6, 10, TORCH_FRAME),
    ]
    best, sites = bench_train.live_at_peak(trace, start=3)
    assert best == 250  # 100 + 50 + 70 + 30, after event 5
    assert [(s["site"], s["mib"] * 2**20, s["blocks"]) for s in sites] == [
        ("model.py:3 model", 100, 1),
        ("optim.py:7 optim", 80, 2),
        ("no Python frame (autograd's backward thread)", 70, 1),
    ]
    _, top = bench_train.live_at_peak(trace, start=3, top=1)
    assert [(s["site"], s["mib"] * 2**20, s["blocks"]) for s in top] == [
        ("model.py:3 model", 100, 1),
        ("2 other sites", 150, 3),
    ]
    assert bench_train.site_of([TORCH_FRAME]) == "torch"


def test_live_at_peak_refuses_a_window_past_the_trace():
    with pytest.raises(ValueError, match="the trace has 1 events, none from event 5 on"):
        bench_train.live_at_peak([alloc(1, 8)], start=5)
