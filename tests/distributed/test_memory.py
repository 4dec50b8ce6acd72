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


def _sharded(dtype=torch.bfloat16, **options):
    model = torch.nn.Linear(3, 2).to(dtype)
    return ShardedMixedPrecisionOptimizer(
        torch.optim.AdamW(model.parameters()), named_parameters=model, **options
    )


# (options, dtype of the model, message): split masters where they cannot be kept
SPLIT_ERRORS = [
    (
        {"masters": "split", "impl": "torch"},
        torch.bfloat16,
        r"masters='split' needs the fused local step, got impl='torch'",
    ),
    (
        {"masters": "split"},
        torch.bfloat16,
        r"needs the fused local step, got impl='torch'.*impl='triton'",
    ),  # CPU: auto
    (
        {"masters": "split", "impl": "triton"},
        torch.float16,
        r"only for bf16 params, got torch.float16 params",
    ),
    (
        {"masters": "split", "impl": "triton", "param_dtype": torch.float16},
        torch.float32,
        r"torch.float16 params",
    ),
    (
        {"masters": "split", "impl": "triton"},
        torch.float32,
        r"keeps the masters of bf16 params, got torch.float32",
    ),
    (
        {"masters": "bf16", "impl": "triton"},
        torch.bfloat16,
        r"masters must be one of \('fp32', 'split'\), got 'bf16'",
    ),
]


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize(("options", "dtype", "message"), SPLIT_ERRORS)
def test_split_masters_refused_where_they_cannot_be_kept(options, dtype, message):
    with pytest.raises(ValueError, match=message):
        _sharded(dtype, **options)


@pytest.mark.usefixtures("one_rank")
def test_split_masters_join_and_refresh():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)  # fp32: cast to bf16, the masters start from the fp32 weights
    originals = [p.detach().clone().reshape(-1) for p in model.parameters()]
    inner = torch.optim.AdamW(model.parameters())
    opt = ShardedMixedPrecisionOptimizer(
        inner, named_parameters=model, impl="triton", masters="split", param_dtype=torch.bfloat16
    )
    assert "masters='split'" in repr(opt) and opt.flat_master is None
    for master, original, p in zip(opt.master_params(), originals, model.parameters(), strict=True):
        assert torch.equal(master, original)  # exact fp32 masters
        assert p.dtype == torch.bfloat16
    opt.refresh_masters()  # the masters become the bf16 weights exactly: low halves 0
    assert not opt.flat_low.any()
    for master, p in zip(opt.master_params(), model.parameters(), strict=True):
        assert torch.equal(master, p.detach().float().reshape(-1))
