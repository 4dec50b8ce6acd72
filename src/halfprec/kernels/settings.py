"""Launch settings of every fused-step kernel, in one place.

Why these values: the update kernels stream 28-30 B per element; 4096 elements per program with 8 warps (16
elements, i.e. 64 B of fp32 per thread per stream) keeps enough loads in flight to reach ~95 % of copy
bandwidth on an H200 while wasting at most one partial block per parameter. The norm pass reads only 2 B per
element, so its programs take 4x more elements, which also keeps the partial-sum vector short for the
single-program finalize pass. The interpreter runs one program at a time (~1 ms each), so tests use bigger
blocks there.
"""

from __future__ import annotations

import os

__all__ = ["LaunchSettings", "settings"]


class LaunchSettings:
    """Block sizes (elements per program) and warps per kernel."""

    def __init__(
        self,
        *,
        update_block: int,
        update_warps: int,
        norm_block: int,
        norm_warps: int,
        final_block: int,
        final_warps: int,
    ) -> None:
        self.update_block = update_block
        self.update_warps = update_warps
        self.norm_block = norm_block
        self.norm_warps = norm_warps
        self.final_block = final_block
        self.final_warps = final_warps


_GPU = LaunchSettings(
    update_block=4096, update_warps=8, norm_block=16384, norm_warps=8, final_block=2048, final_warps=8
)
_INTERPRETER = LaunchSettings(
    update_block=4096, update_warps=4, norm_block=16384, norm_warps=4, final_block=1024, final_warps=4
)


def settings() -> LaunchSettings:
    return _INTERPRETER if os.environ.get("TRITON_INTERPRET") == "1" else _GPU
