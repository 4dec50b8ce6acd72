"""The demo's corpus (``halfprec.cli.demo_data``): Python's standard library as bytes, split by file, batches that
are a function of seed, split and step."""

from __future__ import annotations

import pytest
import torch

from halfprec.cli.demo_data import load_corpus, stdlib_files


def test_corpus_split_is_deterministic_and_by_file():
    a, b = load_corpus(max_bytes=3_000_000), load_corpus(max_bytes=3_000_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    files = stdlib_files()[: a.n_files]
    val = b"".join(p.read_bytes() for i, p in enumerate(files) if i % 10 == 9)
    train = b"".join(p.read_bytes() for i, p in enumerate(files) if i % 10 != 9)
    assert bytes(a.val.numpy()) == val and bytes(a.train.numpy()) == train
    assert all("site-packages" not in p.parts for p in stdlib_files())


def test_batches_are_a_function_of_seed_split_and_step():
    c = load_corpus(max_bytes=1_000_000)
    x, y = c.batch("train", step=5, batch_size=3, seq_len=17, seed=0)
    x2, y2 = c.batch("train", step=5, batch_size=3, seq_len=17, seed=0)
    assert x.shape == y.shape == (3, 17) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte
    assert not torch.equal(x, c.batch("train", step=6, batch_size=3, seq_len=17, seed=0)[0])
    assert not torch.equal(x, c.batch("train", step=5, batch_size=3, seq_len=17, seed=1)[0])
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        c.batch("test", step=0, batch_size=1, seq_len=4, seed=0)
