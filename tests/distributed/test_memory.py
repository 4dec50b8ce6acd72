"""Bytes per param the sharded optimizer holds at world size 1 after its first step (one gloo rank in this
process; the fused local step in Triton's interpreter on CPU): the storages of its buffers, counted once each.

With AdamW and N = 1 the design's model (docs/distributed.md) is 2 (param) + 2 (grad) + 12 (master, m, v) = 16 B
per element at either stage when the grads are reduced in the 16-bit dtype (``reduce_dtype="param"``: the kernel
reads the 16-bit grad shard, which at stage 1 and N = 1 is the grad buffer itself); an fp32 grad shard adds 4
(stage 1) or 2 (stage 2, where it replaces the 16-bit shard). Split masters (``masters="split"``) take 2 in
place of the 4 of the fp32 master. Elements: the layout's padded total.
"""

from __future__ import annotations

import pytest
import torch

from halfprec.distributed import ShardedMixedPrecisionOptimizer

# (stage, reduce_dtype, masters, bytes per element after the first step)
BYTES = [
    (1, "param", "fp32", 16),
    (2, "param", "fp32", 16),
    (1, "fp32", "fp32", 20),
    (2, "fp32", "fp32", 18),
    (1, "param", "split", 14),
    (2, "param", "split", 14),
    (1, "fp32", "split", 18),
    (2, "fp32", "split", 16),
]


def held_bytes(model: torch.nn.Module, opt: ShardedMixedPrecisionOptimizer) -> int:
    """Bytes of the distinct storages behind the params, grads, flat buffers and optimizer state."""
    reducer = opt.reducer
    tensors = [opt.flat_param, opt.flat_master, opt.flat_low, reducer.flat_grad, reducer.grad_shard]
    tensors += [t for p in model.parameters() for t in (p, p.grad)]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None
    }
    return sum(storages.values())


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(("stage", "reduce_dtype", "masters", "per_element"), BYTES)
def test_adamw_bytes_per_param_at_world_size_one(stage, reduce_dtype, masters, per_element):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5)).bfloat16()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = ShardedMixedPrecisionOptimizer(
        inner, named_parameters=model, stage=stage, reduce_dtype=reduce_dtype, impl="triton", masters=masters
    )
    opt.backward(model(torch.randn(8, 33, dtype=torch.bfloat16)).float().square().mean())
    opt.step()
    assert not opt.step_was_skipped
    assert opt.reducer.grad_shard.dtype == (torch.bfloat16 if reduce_dtype == "param" else torch.float32)
    assert held_bytes(model, opt) == per_element * opt.layout.total
