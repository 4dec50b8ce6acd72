"""Flat buffers of the fused optimizers: one chunk per (device, param dtype).

A chunk holds, for its params in group order, at offsets padded to ``ALIGN`` elements:

* ``param``: the 16-bit weights (the params' ``.data`` become views of it), or None for fp32 params, whose
  ``.data`` become views of ``master`` (they are their own masters);
* ``grad``: a buffer of the params' dtype that their ``.grad`` are views of, so backward accumulates into it
  (made by ``make_grad`` at the first grad, not at construction);
* ``master``: fp32 masters; ``state[name]``: fp32 optimizer state (``exp_avg``, ``sum``, ...), added by
  ``add_state`` at the first update (construction allocates only ``master`` and ``param``);
* ``norm_table`` / ``update_table``: int64 [programs, 3] rows (start, end, global param index) that split every
  param into kernel blocks without crossing a param boundary, so each program reads one param's scalars.
Rows end at the param's end rounded up to ``ALIGN``: the padding is zero in every buffer and an update keeps it
zero (zero grad, zero master, zero state), and with block starts and ends known to be multiples of 16 the
compiler can vectorize the loads and the mask (unaligned ends made every access scalar: 1.56x the floor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import aligned, aligned_offsets

__all__ = ["Chunk", "build_table"]


def build_table(
    offsets: Sequence[int], sizes: Sequence[int], indices: Sequence[int], block: int, device: torch.device
) -> torch.Tensor:
    rows: list[tuple[int, int, int]] = []
    for off, n, gi in zip(offsets, sizes, indices, strict=True):
        end = off + aligned(n)
        rows.extend((s, min(s + block, end), gi) for s in range(off, end, block))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(device)


class Chunk:
    """The flat buffers of the params of one device and dtype (see the module docstring)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        indices: Sequence[int],
        originals: dict[torch.Tensor, torch.Tensor],
        *,
        norm_block: int,
        update_block: int,
    ) -> None:
        self.params = list(params)
        self.indices = list(indices)
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        self.offsets, total = aligned_offsets(p.numel() for p in self.params)
        self.numel = total
        sizes = [p.numel() for p in self.params]
        dev = self.device
        self.master = torch.zeros(total, dtype=torch.float32, device=dev)
        self.param = None if self.dtype == torch.float32 else torch.zeros(total, dtype=self.dtype, device=dev)
        self.grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []
        self.state: dict[str, torch.Tensor] = {}
        self.master_views = self._views(self.master)
        with torch.no_grad():
            for p, m in zip(self.params, self.master_views, strict=True):
                m.copy_(originals.get(p, p.data))
            if self.param is not None:
                for p, v in zip(self.params, self._views(self.param), strict=True):
                    v.copy_(p.data)
                    p.data = v
            else:
                for p, m in zip(self.params, self.master_views, strict=True):
                    p.data = m
        self.norm_table = build_table(self.offsets, sizes, self.indices, norm_block, dev)
        self.update_table = build_table(self.offsets, sizes, self.indices, update_block, dev)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets, strict=True)]

    def make_grad(self) -> None:
        self.grad = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        self.grad_views = self._views(self.grad)

    def state_views(self, name: str) -> list[torch.Tensor]:
        return self._views(self.state[name])

    def add_state(self, name: str) -> None:
        if name not in self.state:
            self.state[name] = torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def write_params(self) -> None:
        """Round the masters into the 16-bit params (round to nearest even), after a load."""
        if self.param is not None:
            self.param.copy_(self.master)
