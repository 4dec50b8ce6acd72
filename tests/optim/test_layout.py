"""The flat layout (pure Python): every element of every param is owned by exactly one rank, shards are equal."""

from __future__ import annotations

import random

import pytest
import torch

from halfprec.optim.layout import PAD, Layout


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", range(4))
def test_pieces_partition_every_param(world, seed):
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 3, 9, 41, 341, 4231]) for _ in range(rng.randint(1, 12))]
    bucket = rng.choice([1, 40, 500, 10_000])
    layouts = [Layout(numels, world_size=world, rank=r, bucket_size=bucket) for r in range(world)]
    for i, n in enumerate(numels):
        owned = sorted((pc.lo, pc.hi) for lay in layouts for pc in lay.pieces if pc.param == i)
        covered = 0
        for lo, hi in owned:
            assert lo == covered  # contiguous, no overlap
            covered = hi
        assert covered == n
    ref = layouts[0]
    for b in ref.buckets:
        assert b.numel % (world * PAD) == 0 and b.shard * world == b.numel
        assert sum(numels[i] for i in b.params) <= b.numel
    for lay in layouts:
        assert lay.local_numel == sum(b.shard for b in lay.buckets)
        for pc in lay.pieces:  # the piece sits where the local index space says
            b = lay.buckets[pc.bucket]
            start, _ = b.shard_range(lay.rank)
            assert pc.local - b.local == lay.offsets[pc.param] + pc.lo - start


def test_params_are_never_split_across_buckets_and_big_params_get_their_own():
    lay = Layout([10, 10, 100, 5], world_size=2, rank=0, bucket_size=25)
    assert [b.params for b in lay.buckets] == [(0, 1), (2,), (3,)]


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_size"):
        Layout([1], world_size=1, rank=0, bucket_size=0)
    with pytest.raises(ValueError, match="rank 2"):
        Layout([1], world_size=2, rank=2, bucket_size=8)


def test_importing_the_package_is_light():
    import subprocess
    import sys

    code = (
        "import sys, halfprec.distributed as d; "
        "print(any(m.startswith('torch.distributed.checkpoint') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert torch.cuda.is_initialized() is False


def test_align_starts_every_param_on_a_multiple_of_align():
    from halfprec.optim.layout import ALIGN, aligned

    numels = [3, 17, 0, 40, 1]
    for world in (1, 2, 3):
        for r in range(world):
            lay = Layout(numels, world_size=world, rank=r, bucket_size=64, align=True)
            assert all(off % ALIGN == 0 for off in lay.offsets)
            for b in lay.buckets:  # a bucket holds the aligned sizes of its params
                assert sum(aligned(numels[i]) for i in b.params) <= b.numel
    plain = Layout(numels, world_size=1, rank=0, bucket_size=10**6)
    assert plain.offsets == [0, 3, 20, 20, 60]  # unaligned: back to back
