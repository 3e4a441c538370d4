"""The seed baseline: a plain GPT as taught in "Build a Large Language Model (From Scratch)", chapter 5.

Everything hand-written (LayerNorm, GELU, attention with a stored causal mask and separate q/k/v
projections), an untied output head and the unpadded 50,257 vocab. It is rung 0 of the speed ladder and an
independent oracle in the tests: `ReferenceGPT.from_gpt(gpt)` copies our GPT's weights into it, after which
both give the same logits on the real vocab columns.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from modeling.config import REAL_VOCAB_SIZE, GPTConfig
from modeling.gpt import GPT


class LayerNorm(nn.Module):
    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # biased, as LayerNorm defines it
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class GELU(nn.Module):
    """The tanh approximation GPT-2 was trained with."""

    def forward(self, x: Tensor) -> Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class MultiHeadAttention(nn.Module):
    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int, qkv_bias: bool
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        # 1 above the diagonal = a future position this query may not see
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x: Tensor) -> Tensor:
        b, T, _ = x.shape
        # (b, T, d_out) -> (b, num_heads, T, head_dim)
        queries = self.W_query(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)

        attn_scores = queries @ keys.transpose(2, 3)  # (b, num_heads, T, T)
        attn_scores = attn_scores.masked_fill(self.mask.bool()[:T, :T], float("-inf"))
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context = (attn_weights @ values).transpose(1, 2).contiguous().view(b, T, -1)  # (b, T, d_out)
        return self.out_proj(context)


class FeedForward(nn.Module):
    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(emb_dim, 4 * emb_dim), GELU(), nn.Linear(4 * emb_dim, emb_dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, qkv_bias: bool) -> None:
        super().__init__()
        self.att = MultiHeadAttention(cfg.n_embd, cfg.n_embd, cfg.block_size, cfg.dropout, cfg.n_head, qkv_bias)
        self.ff = FeedForward(cfg.n_embd)
        self.norm1 = LayerNorm(cfg.n_embd)
        self.norm2 = LayerNorm(cfg.n_embd)
        self.drop_shortcut = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop_shortcut(self.att(self.norm1(x)))
        return x + self.drop_shortcut(self.ff(self.norm2(x)))


class ReferenceGPT(nn.Module):
    """Takes the shape (n_layer, n_head, n_embd, block_size, dropout) from a GPTConfig; vocab_size is its own
    because the baseline is unpadded. The book's default init (PyTorch's), no weight tying."""

    def __init__(self, cfg: GPTConfig, vocab_size: int = REAL_VOCAB_SIZE, qkv_bias: bool = False) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop_emb = nn.Dropout(cfg.dropout)
        self.trf_blocks = nn.Sequential(*[TransformerBlock(cfg, qkv_bias) for _ in range(cfg.n_layer)])
        self.final_norm = LayerNorm(cfg.n_embd)
        self.out_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)

    def forward(self, in_idx: Tensor) -> Tensor:
        """Logits (B, T, vocab_size) for token ids in_idx (B, T)."""
        T = in_idx.shape[1]
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(T, device=in_idx.device))
        x = self.trf_blocks(self.drop_emb(x))
        return self.out_head(self.final_norm(x))

    def loss(self, in_idx: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy over all positions, computed from the full logits as the book does."""
        return F.cross_entropy(self(in_idx).flatten(0, 1), targets.flatten())

    @classmethod
    @torch.no_grad()
    def from_gpt(cls, gpt: GPT) -> ReferenceGPT:
        """A ReferenceGPT holding gpt's weights: c_attn split into W_query/W_key/W_value, the tied head copied
        into tok_emb and out_head, and both cut to the real vocab. Biases gpt lacks (bias=False) become 0."""
        cfg = gpt.config
        vocab_size = min(cfg.vocab_size, REAL_VOCAB_SIZE)
        ref = cls(cfg, vocab_size=vocab_size, qkv_bias=cfg.bias).to(gpt.lm_head.weight.dtype)

        def copy_linear(dst: nn.Linear, weight: Tensor, bias: Tensor | None) -> None:
            dst.weight.copy_(weight)
            if dst.bias is not None:
                dst.bias.copy_(bias if bias is not None else torch.zeros_like(dst.bias))

        def copy_norm(dst: LayerNorm, src: nn.LayerNorm) -> None:
            dst.scale.copy_(src.weight)
            dst.shift.copy_(src.bias if src.bias is not None else torch.zeros_like(dst.shift))

        ref.tok_emb.weight.copy_(gpt.transformer.wte.weight[:vocab_size])
        ref.pos_emb.weight.copy_(gpt.transformer.wpe.weight)
        for dst, src in zip(ref.trf_blocks, gpt.transformer.h, strict=True):
            c_attn = src.attn.c_attn
            q_b, k_b, v_b = c_attn.bias.chunk(3) if c_attn.bias is not None else (None, None, None)
            q_w, k_w, v_w = c_attn.weight.chunk(3)  # rows: q, k, v, each (n_embd, n_embd)
            copy_linear(dst.att.W_query, q_w, q_b)
            copy_linear(dst.att.W_key, k_w, k_b)
            copy_linear(dst.att.W_value, v_w, v_b)
            copy_linear(dst.att.out_proj, src.attn.c_proj.weight, src.attn.c_proj.bias)
            copy_linear(dst.ff.layers[0], src.mlp.c_fc.weight, src.mlp.c_fc.bias)
            copy_linear(dst.ff.layers[2], src.mlp.c_proj.weight, src.mlp.c_proj.bias)
            copy_norm(dst.norm1, src.ln_1)
            copy_norm(dst.norm2, src.ln_2)
        copy_norm(ref.final_norm, gpt.transformer.ln_f)
        ref.out_head.weight.copy_(gpt.lm_head.weight[:vocab_size])
        return ref
