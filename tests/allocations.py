"""Counting what a piece of code allocates, on any device (tests that construction is inert: state only at the
first update)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NewStorageBytes(TorchDispatchMode):
    """Bytes of every storage an op creates (outputs whose storage none of its inputs had): views and in-place
    ops allocate nothing, so this counts what a piece of code allocates, on any device."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = set()
        for value in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(value, torch.Tensor):
                seen.add(value.untyped_storage().data_ptr())
        for value in torch.utils._pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                ptr = value.untyped_storage().data_ptr()
                if ptr not in seen and ptr != 0:
                    seen.add(ptr)
                    self.total += value.untyped_storage().nbytes()
        return out
