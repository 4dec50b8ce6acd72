"""Launch settings of every fused-step kernel, in one place.

Why these values: the update kernels stream 28-30 B per element; 2048 elements per program with 4 warps (16
elements, i.e. 64 B of fp32 per thread per stream) keeps enough loads in flight to reach ~95 % of copy bandwidth on
an H200 while wasting at most one partial block per parameter. Measured at 268M bf16 AdamW on an H200 with FMA
contraction off (2026-12-03, fp32 / split masters): 2048/4 1.967 / 1.808 ms, 2048/8 2.065 / 1.818, 4096/8 2.316 /
1.905, 4096/16 2.262 / 1.868, 8192/8 2.593 / 2.575 (with contraction on, 4096/8 took 2.008 / 1.847). The norm pass
reads only 2 B per element, so its programs take 32x more elements with 16 warps (2026-12-02: 162 us with 16384/8,
156 us with 32768/16, 130 us with 65536/16), which also keeps the partial-sum vector short for the single-program
finalize pass. The interpreter runs one program at a time (~1 ms each), so tests use bigger blocks there.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from . import interpreted

__all__ = ["NO_FMA", "LaunchSettings", "pin_settings", "settings", "unpin_settings"]

# The kernels that update masters compile without FMA contraction: which multiply-add the compiler fuses depends on
# the code around it, so two branches with the same arithmetic rounded differently (on the H200, the split-master and
# fp32-master AdamW updates put 1,523 of 1.19M masters 1 ulp apart after two steps; with contraction off, none over
# 30 steps). Without it every multiply and add rounds once, as in the interpreter.
NO_FMA = {"enable_fp_fusion": False}


@dataclass(frozen=True, kw_only=True)
class LaunchSettings:
    """Block sizes (elements per program) and warps per kernel."""

    update_block: int
    update_warps: int
    norm_block: int
    norm_warps: int
    final_block: int
    final_warps: int
    replay: int = 1  # 1: a launch that ran before replays from a CUDA graph (launch.py); 0: Triton launches


_GPU = LaunchSettings(
    update_block=2048, update_warps=4, norm_block=65536, norm_warps=16, final_block=2048, final_warps=8
)
_INTERPRETER = LaunchSettings(
    update_block=4096, update_warps=4, norm_block=16384, norm_warps=4, final_block=1024, final_warps=4
)


_pinned = threading.local()  # .value: the settings read once for a launch group (launch.together), if any


def pin_settings() -> None:
    """Read the settings and have ``settings()`` return them on this thread until ``unpin_settings()``: a fused
    step's launches read them five times or more, and each read is two environment lookups of host time."""
    _pinned.value = None
    _pinned.value = settings()


def unpin_settings() -> None:
    """``settings()`` reads the environment again."""
    _pinned.value = None


def settings() -> LaunchSettings:
    """The settings in force; ``HALFPREC_LAUNCH="norm_block=32768,update_warps=4"`` overrides fields (for sweeps)."""
    if (cfg := getattr(_pinned, "value", None)) is not None:
        return cfg
    base = _INTERPRETER if interpreted() else _GPU
    override = os.environ.get("HALFPREC_LAUNCH")
    if not override:
        return base
    fields = dict(vars(base))
    for item in override.split(","):
        key, _, value = item.partition("=")
        if key.strip() not in fields:
            raise ValueError(f"HALFPREC_LAUNCH: unknown field {key!r}; known: {sorted(fields)}")
        fields[key.strip()] = int(value)
    return LaunchSettings(**fields)
