"""The demo's byte-level GPT (``halfprec.cli.demo_model``): tied head, causal, fp16 on the CPU, config errors."""

from __future__ import annotations

import pytest
import torch
from tests.tolerances import tol

from halfprec.cli.demo_model import GPT, GPTConfig


def test_model_ties_head_to_embedding_and_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, n_embd=8))
    assert model.head.weight is model.tok_emb.weight
    x = torch.randint(256, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256  # changing byte 10 must not change the predictions before it
    assert torch.equal(model(x2)[:, :10], logits[:, :10])
    assert not torch.equal(model(x2)[:, 10:], logits[:, 10:])


def test_model_fp16_on_cpu_keeps_fp16_tensors_and_matches_fp32():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=1, n_embd=32))
    x = torch.randint(256, (2, 16))
    ref = model(x)
    model.half()
    out = model(x)
    out.float().sum().backward()
    assert out.dtype == torch.float16 and all(p.grad.dtype == torch.float16 for p in model.parameters())
    # fp16 weights and activations: ~1e-3 relative rounding per op, a few ops deep.
    torch.testing.assert_close(out.float(), ref, **tol("fp16_forward", torch.float16))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_head=3, n_embd=32), "n_head=3 must divide n_embd=32"),
        (dict(n_layer=0), r"n_layer must be a positive int, got 0"),
    ],
)
def test_model_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)
