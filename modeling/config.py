"""Model shape: the GPTConfig dataclass and the named presets every other part of the project refers to."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

# Properties of the GPT-2 BPE tokenizer: ids 0..50255 are merges, 50256 is <|endoftext|>. The model's
# embedding may be padded past this (see GPTConfig.vocab_size), but ids >= REAL_VOCAB_SIZE are never tokens.
REAL_VOCAB_SIZE = 50257
EOT_ID = 50256  # <|endoftext|>: the document separator, also GPT-2's bos/eos
PADDED_VOCAB_SIZE = 50304  # REAL_VOCAB_SIZE rounded up to a multiple of 64 for fast kernels


@dataclass
class GPTConfig:
    n_layer: int = 12  # transformer blocks; GPT-2 small's depth
    n_head: int = 12  # attention heads; n_embd // n_head = 64 is the head size GPT-2 uses at every scale
    n_embd: int = 768  # residual stream width; GPT-2 small's
    block_size: int = 1024  # longest context (learned positions); GPT-2's n_positions
    vocab_size: int = PADDED_VOCAB_SIZE  # the GPT-2 ids, padded for fast kernels
    dropout: float = 0.0  # 0 for pretraining: one pass over the data rarely overfits, and it costs speed
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has them (needed for HF export)

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}) "
                "so every head gets the same size"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


PRESETS: dict[str, GPTConfig] = {
    # The four GPT-2 sizes from the paper (parameter counts with the padded 50,304 vocab, tied head).
    "gpt2-124m": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-350m": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-774m": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-1558m": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    # Smoke tests and tiny end-to-end runs: a step takes milliseconds on a laptop CPU.
    "tiny-cpu": GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
    # The project's CPU benchmark shape (micro-batch 8 x T 256 = 2,048 tokens per step).
    "small-cpu": GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256),
    # `make train`'s shape: half as wide, so twice the tokens in its 5 CPU minutes (the tied 50,304-id head is most
    # of the work at these widths), and a lower val loss at the end (BENCHMARKS.md, "Time to loss").
    "mini-cpu": GPTConfig(n_layer=4, n_head=2, n_embd=128, block_size=256),
}


def get_preset(name: str) -> GPTConfig:
    """A fresh copy of the named preset (so callers may mutate it), or a ValueError that lists the valid names."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown model preset {name!r}.{hint} Valid presets: {', '.join(PRESETS)}")
    return GPTConfig(**vars(PRESETS[name]))
