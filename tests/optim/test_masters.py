"""``Masters``: a rank's masters in local coordinates, fp32 or split (the bf16 param shard plus the low
halves), on a 2-rank layout built in this process (no process group: the layout is index math)."""

from __future__ import annotations

import pytest
import torch

from halfprec.optim.layout import Layout
from halfprec.optim.masters import Masters
from halfprec.optim.split import split_master

NUMELS = [9, 41, 3, 70]  # odd sizes: shards cut params at unaligned offsets


def _build(rank: int, *, split: bool, ties: bool = False) -> tuple[Layout, torch.Tensor, Masters, dict]:
    layout = Layout(NUMELS, world_size=2, rank=rank, bucket_size=64)
    g = torch.Generator().manual_seed(0)
    sources = {i: torch.randn(n, generator=g) for i, n in enumerate(NUMELS)}
    if (
        ties
    ):  # the fp32 value halfway between two bf16 values, with an even top half: RNE keeps it, split rounds up
        sources[1][0] = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)
    param = torch.zeros(layout.total, dtype=torch.bfloat16)
    for i, src in sources.items():
        param[layout.offsets[i] : layout.offsets[i] + NUMELS[i]].copy_(src)
    masters = Masters(layout, sources, param=param, split=split, device=param.device)
    masters.make_pieces()
    return layout, param, masters, sources


def _model_space(layout: Layout, masters: torch.Tensor) -> dict[int, tuple[int, torch.Tensor]]:
    return {i: (pc.lo, masters[pc.local : pc.local + pc.numel]) for i, pc in layout.piece_of.items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_split_masters_join_to_the_fp32_masters(rank):
    layout, _, fp32, sources = _build(rank, split=False, ties=True)
    _, param, split, _ = _build(rank, split=True, ties=True)
    assert split.fp32 is None and split.low.dtype == torch.int16 and split.kernel_buffer is split.low
    assert fp32.low is None and fp32.kernel_buffer is fp32.fp32
    assert torch.equal(split.join(), fp32.join())
    for i, (lo, value) in _model_space(layout, fp32.fp32).items():
        assert torch.equal(value, sources[i][lo : lo + value.numel()])
        assert torch.equal(split.pieces[i], value)  # the pieces view the joined values
    # the whole param buffer holds every param's master rounded ties away, on every rank
    tie = param[layout.offsets[1]].view(torch.int16)
    assert (
        tie
        == split_master(sources[1][:1])[0].view(torch.int16)
        != sources[1][:1].bfloat16().view(torch.int16)
    )


def test_release_drops_the_joined_values():
    _, _, split, _ = _build(0, split=True)
    split.join()
    split.release()
    assert split.joined is None
    assert all(p.untyped_storage().nbytes() == 4 for p in split.pieces.values())  # one expanded element


@pytest.mark.parametrize("split", [False, True])
def test_load_restore_and_reset(split):
    layout, param, masters, _ = _build(0, split=split)
    new = torch.randn(layout.local_numel, generator=torch.Generator().manual_seed(1))
    masters.load(new)
    assert torch.equal(masters.join(), new)
    joined = masters.join()
    for i, pc in layout.piece_of.items():  # a checkpoint load writes into the pieces
        masters.pieces[i].data.copy_(joined[pc.local : pc.local + pc.numel] * 2)
    masters.restore()
    assert torch.equal(masters.join(), new * 2)
    masters.round_into_params()  # fp32: to nearest even; split: the params are the high halves already
    for b, lo, hi in masters.shards():
        local = masters.join()[b.local : b.local + b.shard]
        assert torch.equal(local, (new * 2)[b.local : b.local + b.shard])
        if not split:
            assert torch.equal(param[lo:hi], local.bfloat16())
    masters.reset()  # the masters become the param shards exactly
    for b, lo, hi in masters.shards():
        assert torch.equal(masters.join()[b.local : b.local + b.shard], param[lo:hi].float())
    assert not split or not masters.low.any()


def test_without_a_flat_param_buffer_every_piece_needs_a_source_and_split_is_refused():
    layout = Layout(NUMELS, world_size=1, rank=0, bucket_size=10**6)
    sources = {i: torch.full((n,), float(i)) for i, n in enumerate(NUMELS)}
    masters = Masters(layout, sources, param=None, split=False, device=torch.device("cpu"))
    for i, pc in layout.piece_of.items():
        assert torch.equal(masters.fp32[pc.local : pc.local + pc.numel], sources[i])
    masters.round_into_params()  # nothing to round into: no error, masters unchanged
    masters.reset()
    assert torch.equal(masters.join()[layout.offsets[1] : layout.offsets[1] + NUMELS[1]], sources[1])
    with pytest.raises(ValueError, match="flat param buffer"):
        Masters(layout, sources, param=None, split=True, device=torch.device("cpu"))


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_params_of_their_own_hold_what_the_flat_buffer_would(rank, split):
    """``params=``: each param's own 16-bit tensor (FSDP2's shards, written in place) instead of a flat buffer:
    the same masters, and loads, rounding and resets write the rank's pieces of those tensors."""
    layout, flat, reference, sources = _build(rank, split=split, ties=True)
    own = [torch.zeros(n, dtype=torch.bfloat16) for n in NUMELS]
    if not split:  # a param without a source takes its 16-bit weight from its tensor
        for i, t in enumerate(own):
            t.copy_(sources[i])
    masters = Masters(layout, sources, param=None, params=own, split=split, device=flat.device)
    masters.make_pieces()
    assert torch.equal(masters.join(), reference.join())
    for i, t in enumerate(own):
        assert not split or torch.equal(t, flat[layout.offsets[i] : layout.offsets[i] + NUMELS[i]])
    new = torch.randn(layout.local_numel, generator=torch.Generator().manual_seed(1))
    masters.load(new)
    masters.round_into_params()
    for i, pc in layout.piece_of.items():
        value = new[pc.local : pc.local + pc.numel]
        high = split_master(value)[0] if split else value.bfloat16()
        assert torch.equal(own[i][pc.lo : pc.hi], high)
    masters.reset()
    for i, pc in layout.piece_of.items():
        assert torch.equal(masters.join()[pc.local : pc.local + pc.numel], own[i][pc.lo : pc.hi].float())
    moved = [t.clone() for t in own]
    masters.point_params(moved)
    moved[0].fill_(1.0)
    masters.reset()
    pc = layout.piece_of.get(0)
    assert pc is None or bool((masters.join()[pc.local : pc.local + pc.numel] == 1.0).all())
    with pytest.raises(ValueError, match="not both"):
        Masters(layout, sources, param=flat, params=own, split=split, device=flat.device)
