"""FP32 master storage: one flat fp32 buffer per (device, model dtype), with a per-param view of it.

A ``MasterChunk`` owns the flat master data (allocated at construction), a flat fp32 gradient buffer
(allocated on the first gradient copy, never at construction) and the ``nn.Parameter`` views that the wrapped
optimizer sees. Offsets are padded to ``ALIGN`` elements so that the fused kernels can treat a chunk as one
vector; padding stays zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["ALIGN", "MasterChunk", "MasterStore", "LOW_PRECISION"]

ALIGN = 16  # elements (64 bytes of fp32)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class MasterChunk:
    """Masters for the params of one device and one 16-bit dtype, in one flat fp32 buffer."""

    def __init__(self, params: Sequence[torch.nn.Parameter], sources: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.device = self.params[0].device
        self.model_dtype = self.params[0].dtype
        self.offsets: list[int] = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += _aligned(p.numel())
        self.numel = total
        self.data = torch.zeros(total, dtype=torch.float32, device=self.device)
        self.grad: torch.Tensor | None = None
        self.masters: list[torch.nn.Parameter] = []
        for p, src, off in zip(self.params, sources, self.offsets, strict=True):
            view = self.data[off : off + p.numel()].view(p.shape)
            view.copy_(src.detach())
            self.masters.append(torch.nn.Parameter(view, requires_grad=True))

    def grad_views(self) -> list[torch.Tensor]:
        if self.grad is None:
            self.grad = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return [
            self.grad[off : off + p.numel()].view(p.shape)
            for p, off in zip(self.params, self.offsets, strict=True)
        ]


class MasterStore:
    """All master chunks of one optimizer, and the mapping between model params and their masters."""

    def __init__(self) -> None:
        self.chunks: list[MasterChunk] = []
        self._grad_views: dict[int, list[torch.Tensor]] = {}

    def add(self, params: Iterable[torch.nn.Parameter], originals: dict[torch.Tensor, torch.Tensor]) -> dict:
        """Create masters for ``params`` (16-bit, trainable); ``originals`` maps a param to its best fp32 value.

        Returns ``{param: master}``.
        """
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        mapping = {}
        for group in by_key.values():
            chunk = MasterChunk(group, [originals.get(p, p) for p in group])
            self.chunks.append(chunk)
            mapping.update(zip(chunk.params, chunk.masters, strict=True))
        return mapping

    def pairs(self) -> Iterable[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        for chunk in self.chunks:
            yield from zip(chunk.params, chunk.masters, strict=True)

    def master_params(self) -> list[torch.nn.Parameter]:
        return [m for chunk in self.chunks for m in chunk.masters]

    def model_params(self) -> list[torch.nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.params]

    def check_devices(self) -> None:
        """Raise when a model param has moved off its master's device since the masters were made."""
        for chunk in self.chunks:
            for p in chunk.params:
                if p.device != chunk.device:
                    raise RuntimeError(
                        f"a param of shape {tuple(p.shape)} is on {p.device} but its FP32 master is on "
                        f"{chunk.device}: the model moved after the optimizer was wrapped. Move the model to its "
                        "device first, then build and wrap the optimizer (halfprec does not move masters and "
                        "optimizer state behind your back)"
                    )

    def copy_grads_in(self) -> list[torch.Tensor]:
        """Point each master's ``.grad`` at its fp32 view and fill it from the model grad, or set it to None.

        Returns the master grads that were filled (still scaled).
        """
        filled_dst: list[torch.Tensor] = []
        filled_src: list[torch.Tensor] = []
        for i, chunk in enumerate(self.chunks):
            views = self._grad_views.get(i)
            if views is None:
                views = self._grad_views[i] = chunk.grad_views()
            for p, m, view in zip(chunk.params, chunk.masters, views, strict=True):
                if p.grad is None:
                    m.grad = None
                    continue
                m.grad = view
                filled_dst.append(view)
                filled_src.append(p.grad)
        if filled_dst:
            torch._foreach_copy_(filled_dst, filled_src)
        return filled_dst

    def clear_grads(self) -> None:
        for m in self.master_params():
            m.grad = None

    @torch.no_grad()
    def copy_params_out(self) -> None:
        """Round every master to its model param's dtype (round to nearest even) and store it in place."""
        params, masters = self.model_params(), self.master_params()
        if params:
            torch._foreach_copy_([p.data for p in params], masters)

    @torch.no_grad()
    def refresh_from_params(self) -> None:
        params, masters = self.model_params(), self.master_params()
        if params:
            torch._foreach_copy_(masters, [p.data for p in params])
