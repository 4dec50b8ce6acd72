"""``bench_train.live_at_peak``: the blocks live at an allocator trace's peak, by the site that allocated them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
bench_train = load_script(ROOT / "benchmarks" / "bench_train.py", "bench_train")

# a device's environment may itself live under a folder named torch: only torch's own folder is skipped
TORCH_DIR = "/opt/torch/venv/site-packages/torch/"
TORCH_FRAME = {"filename": TORCH_DIR + "nn/functional.py", "line": 9, "name": "linear"}


def frame(name: str, line: int) -> dict:
    return {"filename": f"/opt/torch/venv/site-packages/{name}/{name}.py", "line": line, "name": name}


def alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int, size: int) -> dict:
    return {"action": "free_requested", "addr": addr, "size": size, "frames": []}


def sites(trace: list[dict], start: int, top: int = 12) -> tuple[int, list[tuple]]:
    best, rows = bench_train.live_at_peak(trace, TORCH_DIR, start, top)
    return best, [(r["site"], r["mib"] * 2**20, r["blocks"]) for r in rows]


def test_live_at_peak_sums_the_blocks_live_at_the_peak_by_their_innermost_site():
    trace = [
        alloc(1, 100, frame("model", 3), frame("engine", 5)),  # before the window: still live at the peak
        alloc(2, 500, frame("model", 3)),
        free(2, 500),  # the earlier, higher peak (600) is outside the window
        alloc(3, 50, TORCH_FRAME, frame("optim", 7), frame("engine", 5)),  # innermost outside torch: optim's
        {"action": "segment_alloc", "addr": 9, "size": 4096, "frames": []},  # the allocator's, not a block
        alloc(4, 70),  # no Python frame: autograd's thread
        {"action": "oom", "size": 1 << 40, "frames": []},  # no addr
        alloc(5, 30, TORCH_FRAME, frame("optim", 7)),
        {
            "action": "free_completed",
            "addr": 3,
            "size": 50,
            "frames": [],
        },  # no drop: counted at free_requested
        {"action": "snapshot", "addr": 0, "size": 0, "frames": []},
        free(5, 30),
        free(3, 50),
        {"action": "segment_free", "addr": 9, "size": 4096, "frames": []},
        alloc(6, 10, TORCH_FRAME),
    ]
    assert sites(trace, start=3) == (
        250,  # 100 + 50 + 70 + 30
        [("model/model.py:3 model", 100, 1), ("optim/optim.py:7 optim", 80, 2),
         ("no Python frame (autograd's backward thread)", 70, 1)],
    )  # fmt: skip
    assert sites(trace, start=3, top=1) == (
        250,
        [("model/model.py:3 model", 100, 1), ("2 other sites", 150, 3)],
    )
    assert bench_train.site_of([TORCH_FRAME], TORCH_DIR) == "torch"


def test_live_at_peak_counts_the_level_at_the_window_s_opening():
    trace = [
        alloc(1, 100, frame("a", 1)),
        alloc(2, 60, frame("b", 2)),
        free(2, 60),
        alloc(3, 10, frame("c", 3)),
    ]
    # the peak after event 2 (a reset there) is the level it opens at, 160, not the 110 after it
    assert sites(trace, start=2) == (160, [("a/a.py:1 a", 100, 1), ("b/b.py:2 b", 60, 1)])
    # a peak at the window's first event is in it; a tie keeps the first
    assert sites(trace, start=1) == (160, [("a/a.py:1 a", 100, 1), ("b/b.py:2 b", 60, 1)])
    tied = [*trace, alloc(4, 50, frame("d", 4))]  # 160 again after event 4
    assert sites(tied, start=1) == (160, [("a/a.py:1 a", 100, 1), ("b/b.py:2 b", 60, 1)])


def test_live_at_peak_refuses_a_window_past_the_trace():
    with pytest.raises(ValueError, match="the trace has 1 events, none from event 5 on"):
        bench_train.live_at_peak([alloc(1, 8)], TORCH_DIR, start=5)


def test_memory_refuses_the_systems_it_cannot_trace():
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_train.py", "--memory", "--systems", "halfprec,hf-paired"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (
        done.returncode == 2 and "--memory traces the plain-loop systems only; drop hf-paired" in done.stderr
    )
