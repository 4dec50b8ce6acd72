"""``Chunk``: the unsharded case of the layout model (a world-size-1 ``Layout`` with ``ALIGN``-aligned params) and
its masters (``Masters``), as the exact and fused strategies build it; ``MasterStore``'s param <-> master mapping."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.chunk import Chunk, MasterStore, chunk_params
from halfprec.optim.layout import ALIGN, Layout, aligned
from halfprec.optim.mesh import local
from halfprec.optim.split import join_master, split_master

from .helpers import mesh_of_one

SHAPES = [(3, 5), (17,), (0,), (2, 2, 9)]  # odd sizes and an empty param


def _params(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(s, generator=g) for s in SHAPES]
    return fp32, [torch.nn.Parameter(v.to(dtype)) for v in fp32]


def test_a_chunk_is_the_world_size_1_layout_with_aligned_params():
    _, params = _params()
    chunk = Chunk(params, params, flat_params=True)
    numels = [p.numel() for p in params]
    ref = Layout(numels, world_size=1, rank=0, bucket_size=10**9, align=True)
    assert chunk.offsets == ref.offsets and chunk.numel == ref.total
    assert all(off % ALIGN == 0 for off in chunk.offsets)
    assert len(chunk.layout.buckets) == 1 and chunk.layout.local_numel == chunk.numel
    # every non-empty param is one whole piece at its global offset (local = global at world size 1)
    for i, n in enumerate(numels):
        pc = chunk.layout.piece_of.get(i)
        assert (pc is None) if n == 0 else (pc.lo, pc.hi, pc.local) == (0, n, chunk.offsets[i])
    assert chunk.numel == sum(aligned(n) for n in numels)


@pytest.mark.parametrize("masters", ["fp32", "split"])
def test_masters_hold_the_fp32_sources_and_the_params_view_the_flat_buffer(masters):
    fp32, params = _params()
    chunk = Chunk(params, fp32, flat_params=True, masters=masters)
    for k, (p, src) in enumerate(zip(params, fp32, strict=True)):
        assert torch.equal(chunk.master(k), src)  # exact either way
        assert p.data_ptr() == chunk.view(chunk.param, k).data_ptr()
    if masters == "split":
        assert chunk.data is None and chunk.master_views == [] and chunk.kernel_buffers()[1] is chunk.low
        # the params are the masters rounded ties away: joined with the low halves they give the sources back
        assert torch.equal(join_master(chunk.view(chunk.param, 1), chunk.view(chunk.low, 1)), fp32[1])
    else:
        assert chunk.low is None and chunk.kernel_buffers() == (chunk.param, chunk.data)
        # the padding between params is zero in both buffers
        used = torch.zeros(chunk.numel, dtype=torch.bool)
        for off, p in zip(chunk.offsets, params, strict=True):
            used[off : off + p.numel()] = True
        assert not chunk.data[~used].any() and not chunk.param[~used].any()
    chunk.round_params()  # fp32: to nearest even; split: the params already are their high halves
    for k, (p, src) in enumerate(zip(params, fp32, strict=True)):
        assert torch.equal(chunk.master(k), src)
        if masters == "fp32":
            assert torch.equal(p.detach(), src.bfloat16())
    chunk.reset_masters()  # the masters become the 16-bit params exactly
    for k, p in enumerate(params):
        assert torch.equal(chunk.master(k), p.detach().float())


def test_fp32_params_are_their_own_masters():
    fp32, _ = _params()
    params = [torch.nn.Parameter(v.clone()) for v in fp32]
    chunk = Chunk(params, params, flat_params=True, masters="split")  # split does not apply to fp32 params
    assert chunk.param is None and chunk.low is None
    for k, p in enumerate(params):
        assert p.data_ptr() == chunk.master_views[k].data_ptr() and torch.equal(p, fp32[k])


@pytest.mark.parametrize("masters", ["fp32", "split"])
def test_fsdp2_shards_are_written_in_place_by_rows_that_stop_at_their_ends(tmp_path, masters):
    """16-bit DTensor params: no flat param; every update row lies inside one shard (never in the padding, which
    is not the shard's), aligned rows only where start, end and shift are multiples of ALIGN, and each row's
    shift from ``anchor`` addresses its shard; the rows cover every element once."""
    from torch.distributed.fsdp import fully_shard

    fp32, _ = _params()
    with mesh_of_one(tmp_path / "store") as mesh:
        module = torch.nn.Module()
        for k, v in enumerate(fp32):
            module.register_parameter(f"p{k}", torch.nn.Parameter(v.bfloat16()))
        fully_shard(module, mesh=mesh)
        params = list(module.parameters())
        chunk = Chunk(params, fp32, flat_params=True, masters=masters)
        chunk.plan_updates(list(range(len(params))), block=32)
        assert chunk.in_place and not chunk.staged and chunk.param is None
        seen = [torch.zeros(p.numel(), dtype=torch.int64) for p in params]
        for rows in chunk.update_rows:
            for (start, end, k), shift in zip(rows.table.tolist(), rows.shift.tolist(), strict=True):
                off = chunk.offsets[k]
                assert off <= start < end <= off + params[k].numel()
                address = chunk.anchor.data_ptr() + (start + shift) * 2
                assert address == local(params[k]).data_ptr() + (start - off) * 2
                assert not rows.aligned or start % ALIGN == end % ALIGN == shift % ALIGN == 0
                seen[k][start - off : end - off] += 1
        assert all(bool((s == 1).all()) for s in seen)
        assert chunk.kernel_buffers()[0] is chunk.anchor
        for k, (p, src) in enumerate(zip(params, fp32, strict=True)):
            assert torch.equal(chunk.master(k), src)
            if masters == "split":  # the shard is the master's high half
                assert torch.equal(local(p), split_master(src)[0])
        chunk.round_params()
        assert masters == "split" or all(
            torch.equal(local(p), s.bfloat16()) for p, s in zip(params, fp32, strict=True)
        )
        chunk.reset_masters()
        assert all(torch.equal(chunk.master(k), local(p).float()) for k, p in enumerate(params))


def test_chunk_params_groups_by_device_and_dtype_in_first_seen_order():
    _, bf16 = _params()
    half = [torch.nn.Parameter(torch.ones(3, dtype=torch.float16))]
    params = [bf16[0], half[0], bf16[1]]
    placed = chunk_params(params, params)
    assert [(c.dtype, idx) for c, idx in placed] == [(torch.bfloat16, [0, 2]), (torch.float16, [1])]


def test_master_store_maps_params_to_shaped_fp32_masters():
    fp32, params = _params()
    store = MasterStore()
    mapping = store.add(params, dict(zip(params, fp32, strict=True)))
    assert store.model_params() == params
    for p, src in zip(params, fp32, strict=True):
        m = mapping[p]
        assert m.dtype == torch.float32 and m.shape == p.shape and torch.equal(m, src)
    # the exact strategy's params stay where they are: the chunk has no flat param buffer
    assert store.chunks[0].param is None
