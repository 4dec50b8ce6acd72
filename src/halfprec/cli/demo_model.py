"""A small byte-level GPT for ``halfprec demo``: small enough to learn visibly on two CPU cores in a minute.

Shapes, everywhere below: ``B`` batch, ``T`` sequence length, ``C`` embedding width, ``H`` heads, ``V = 256``
(one token per byte, so there is no tokenizer to download or train).

The usual pre-norm transformer (GPT-2 style), whose output head shares its weight with the token embedding:
that tie matters to halfprec, as one tensor is reachable under two names, and checkpoints must store it once
and restore the tie.

16-bit matmuls on CPU: without AVX512-FP16 (fp16) or AVX512-BF16/AMX (bf16) torch runs them through a
generic loop, ~15x slower than fp32 (2-core AVX2 EPYC: 927 tokens/s in bf16 against 15,694 in fp32). So on
CPU the two matmul ops (``Linear`` and attention) multiply their 16-bit inputs in fp32 and round the result
to 16 bits: the arithmetic of GPU tensor cores (16-bit products are exact in fp32, fp32 accumulation, one
rounding). Weights, grads and activations between ops stay 16-bit. On CUDA the ops run as written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


def _matmul_op(op, x: torch.Tensor, *others: torch.Tensor | None, **kwargs) -> torch.Tensor:
    """``op(x, *others)``, in fp32 and rounded back on 16-bit CPU inputs (see the module docstring)."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.device.type != "cpu":
        return op(x, *others, **kwargs)
    return op(x.float(), *(None if t is None else t.float() for t in others), **kwargs).to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear``, with 16-bit-on-CPU matmuls done in fp32 and rounded back (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul_op(F.linear, x, self.weight, self.bias)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model sizes. The defaults train at a few thousand tokens/s on two CPU cores."""

    vocab_size: int = 256
    """One token per byte value."""

    seq_len: int = 128
    """Longest context the position table covers."""

    n_layer: int = 3
    """Transformer blocks."""

    n_head: int = 4
    """Attention heads; must divide ``n_embd``."""

    n_embd: int = 128
    """Residual stream width."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_head={self.n_head} must divide n_embd={self.n_embd}; "
                f"pick n_embd as a multiple of n_head"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> three (B, H, T, C/H): heads become a batch dimension for SDPA.
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = _matmul_op(F.scaled_dot_product_attention, q, k, v, is_causal=True)  # position t sees 0..t
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT: ``forward(idx)`` maps ``(B, T)`` int64 bytes to ``(B, T, V)`` next-byte logits; the
    loss is left to the caller, so the demo's loop shows it."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one tensor, two names
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two residual branches, so their output projections start
        # smaller to keep the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence of {T} tokens is longer than GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)

    def num_params(self) -> int:
        """Distinct parameters (the tied head is counted once, as ``parameters()`` yields it once)."""
        return sum(p.numel() for p in self.parameters())
