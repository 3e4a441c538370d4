"""The GPT-2 model, read top to bottom: attention, MLP, block, model (after nanoGPT's model.py).

Parameter names are GPT-2's own (wte, wpe, h.N.ln_1, attn.c_attn, ...), so converting to and from
transformers' GPT2LMHeadModel is a transpose and a vocab slice (see hf_export.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from modeling import cpu_attention
from modeling.config import REAL_VOCAB_SIZE, GPTConfig
from modeling.cpu_linear import Linear
from modeling.fused_ce import linear_cross_entropy


class LayerKV:
    """One attention layer's keys and values of the tokens a generation has read so far (GPT.generate), so that each
    new token's step runs the blocks on that token alone instead of on the whole context again. Buffers of block_size
    positions, allocated at the first write in the dtype of what is written, filled in order. A plain class, not a
    dataclass: FSDP2 rebuilds the dataclasses among a module's inputs, and the writes must reach this object."""

    def __init__(self, max_len: int) -> None:
        self.max_len, self.length = max_len, 0
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' keys and values (B, nh, T, hs) after those stored; return all of them, in order."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None or self.v is None:
            shape = (*k.shape[:2], self.max_len, k.shape[3])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        self.k[:, :, start:end], self.v[:, :, start:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # q, k and v for all heads in one matmul; Linear: nn.Linear, trained through oneDNN in fp32 on AMD AVX-512 CPUs
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, kv: LayerKV | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        past = 0 if kv is None else kv.length
        if kv is not None:
            keys, values = kv.append(k, v)  # (B, nh, past + T, hs)
        if past:  # new tokens after stored ones: each attends to all of those and causally among the new ones
            # (is_causal would align the mask to the first key, not to the first new token)
            mask = None if T == 1 else torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p)
        elif cpu_attention.takes(q, dropout_p):  # a CPU at short context: whole batched matmuls beat flash's blocks
            y = cpu_attention.causal_attention(q, k, v)
        else:  # is_causal masks inside the fused kernel, so no (T, T) mask buffer is stored or read
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class TanhGELU(nn.Module):
    """GPT-2's GELU ("gelu_new"; the exact erf GELU would break HF parity): 0.5 x (1 + tanh(u)), u = sqrt(2/pi)
    (x + 0.044715 x^3). Compiled, it takes the identity 0.5 (1 + tanh(u)) = sigmoid(2u), in fp32: inductor's CPU
    kernels run sigmoid (one exp) 2-3x faster than tanh, and it stays accurate where 1 + tanh(u) cancels (x < -3).
    Eager keeps F.gelu's one kernel (BENCHMARKS.md, "Attention as whole matmuls, and GELU through its sigmoid")."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.compiler.is_compiling():
            return F.gelu(x, approximate="tanh")
        x32 = x.float()  # bf16/fp16 under autocast: the math in fp32, as F.gelu does, one rounding at the end
        u = math.sqrt(2 / math.pi) * (x32 + 0.044715 * x32 * x32 * x32)
        return (x32 * torch.sigmoid(2 * u)).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = TanhGELU()
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: the residual stream itself is never normalized, which keeps deep stacks stable."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, kv: LayerKV | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), kv)
        return x + self.mlp(self.ln_2(x))


class LMHead(Linear):
    """The output head (the token embedding's matrix, tied): the logits of hidden states, or, given targets, the
    training loss in the form modeling.fused_ce picks. The loss is this module's forward so that a compile of the head
    compiles it: regional compilation (the GPU YAMLs, `accelerate config`'s offer) compiles each repeated block and
    every other leaf module on its own, and the model's own code around them runs eagerly: the loss computed there
    cost a CPU's bf16 FSDP2 step 15-25% (BENCHMARKS.md, "The loss under regional compilation")."""

    def forward(self, x: Tensor, targets: Tensor | None = None, fp8: bool = False) -> Tensor:
        if targets is None:
            return super().forward(x)
        return linear_cross_entropy(x.flatten(0, 1), self.weight, targets.flatten(), fp8=fp8)


VOCAB_ROWS = ("transformer.wte.weight", "lm_head.weight")  # one tied embedding/head matrix, listed under both names


def real_vocab_rows(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """state_dict with the embedding/head cut to GPT-2's 50,257 ids: the rows past them are padding, never tokens."""
    return {key: t[:REAL_VOCAB_SIZE] if key in VOCAB_ROWS else t for key, t in state_dict.items()}


class GPT(nn.Module):
    # The block class FSDP2 shards one at a time when the launch YAML names none (accelerate reads the transformers
    # attribute; `accelerate config`'s default answer), so every FSDP2 YAML shards per Block.
    _no_split_modules = [Block.__name__]

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),  # learned positions, as in GPT-2
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        # Trade compute for memory: store only each block's input and recompute its activations in backward
        # (training.config.TrainConfig.activation_checkpointing sets it; not part of the architecture).
        self.activation_checkpointing = False
        # The head's logits from an FP8 matmul where the loss takes the full logits (training.config's fp8_head,
        # set only on CUDA 8.9+; modeling.fp8_head); not part of the architecture either.
        self.fp8_head = False
        self.tie_weights()

        # GPT-2 init: N(0, 0.02) everywhere, zero biases, LayerNorm at (1, 0); the projections that write
        # into the residual stream are scaled by 1/sqrt(2 * n_layer) (two per block) so the stream's
        # variance does not grow with depth.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def tie_weights(self) -> None:
        """Weight tying (GPT-2): one matrix both embeds the ids and scores them; saves vocab x n_embd params. Called
        again by accelerate (the transformers method's name) after its FSDP2 ram-efficient loading moved the model to
        the meta device, which gives each module its own copy."""
        self.transformer.wte.weight = self.lm_head.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def hidden_states(self, idx: Tensor, cache: list[LayerKV] | None = None) -> Tensor:
        """Final (ln_f-normalized) hidden states (B, T, n_embd) for token ids idx (B, T); with a cache (one LayerKV
        per layer), of the tokens that follow those it holds, which it then holds too."""
        start = cache[0].length if cache else 0
        seq_len = start + idx.shape[1]
        if seq_len > self.config.block_size:
            raise ValueError(f"sequence length {seq_len} exceeds block_size {self.config.block_size}")
        pos = torch.arange(start, seq_len, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.transformer.h):
            if cache:
                x = block(x, cache[i])
            elif self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # keeps only x; backward recomputes the block
            else:
                x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """(logits over the padded vocab (B, T, vocab_size), None) without targets; (None, mean loss) with
        targets (B, T), where -100 marks positions to ignore. The loss's form (the full logits or the fused, chunked
        one) is modeling.fused_ce.takes_full_logits's per-device rule."""
        x = self.hidden_states(idx)
        if targets is None:
            return self.lm_head(x), None
        return None, self.lm_head(x, targets, fp8=self.fp8_head)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        top_p: float | None = None,
        stop_id: int | None = None,
    ) -> Tensor:
        """Append max_new_tokens sampled ids to idx (B, T) and return it. temperature 0 is greedy; top_k keeps
        the k likeliest ids, top_p the fewest likeliest whose probabilities sum to top_p (nucleus sampling, after
        top_k, as transformers orders them). Padded ids (>= REAL_VOCAB_SIZE) are never emitted. With stop_id
        (<|endoftext|>: a document's end) it returns early once every row has emitted it; rows that emitted it
        before go on, so cut each at its first. Call model.eval() first.

        While the sequence fits in block_size, each layer keeps the keys and values of the tokens read (LayerKV), so
        a new token's step runs on that token alone: gpt2-124m on 2 CPU threads writes 40 tokens after 900 in 4 s
        instead of 62 (BENCHMARKS.md, "Evaluation speed"), its logits those of the whole context to rounding
        (tests/modeling/test_gpt.py)."""
        if not 0 <= temperature < math.inf:  # nan and inf too
            raise ValueError(f"temperature must be a number >= 0, got {temperature}")
        if top_k is not None and top_k <= 0:  # topk(0) would leave no id to sample
            raise ValueError(f"top_k must be positive (None: no cut-off), got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (None: no cut-off), got {top_p}")
        block_size, cache = self.config.block_size, None
        stopped = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            if idx.shape[1] <= block_size:  # the keys and values of the tokens before are kept: the new one's step
                if cache is None:
                    cache = [LayerKV(block_size) for _ in self.transformer.h]
                x = self.hidden_states(idx[:, cache[0].length :], cache)
            else:  # the context slides past the learned positions' end: every position shifts, so all is recomputed
                x = self.hidden_states(idx[:, -block_size:])
            # Only the last position is sampled from, so only it goes through the (big) head.
            # the real ids only: padded or not (a model from --init-from is not), the same model samples alike
            logits = self.lm_head(x[:, -1, :]).float()[:, :REAL_VOCAB_SIZE]  # (B, 50,257)
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                # shifted first: a tiny temperature then sends the others to -inf, not the likeliest to inf (nan)
                logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits[logits < kth] = float("-inf")
                if top_p is not None and top_p < 1:  # drop each id whose likelier ids already hold top_p
                    probs, order = F.softmax(logits, dim=-1).sort(dim=-1, descending=True)
                    drop = probs.cumsum(dim=-1) - probs >= top_p  # never the likeliest: 0 before it
                    logits[torch.zeros_like(drop).scatter(-1, order, drop)] = float("-inf")  # back in id order
                next_id = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
            if stop_id is not None:
                stopped |= next_id[:, 0] == stop_id
                if stopped.all():
                    break
        return idx

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count, the tied wte/lm_head matrix counted once. exclude_embeddings subtracts only the
        position embeddings (nanoGPT's convention): the token embedding is also the output head."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs (forward + backward) per token at full context, for MFU: 6 * N + 12 * L * T * C
        (PaLM appendix B, nanoGPT's estimate_mfu). N = num_params(exclude_embeddings=True): every weight
        and bias including the tied head (a matmul), without the position table (a lookup). The second term
        is attention's q.k scores and weighted sum of v (T = block_size): 2 x 2*T*C FLOPs per token per layer
        forward, x3 with backward."""
        c = self.config
        return 6 * self.num_params(exclude_embeddings=True) + 12 * c.n_layer * c.block_size * c.n_embd

    def optimizer_groups(self, weight_decay: float, muon: bool = False) -> list[dict]:
        """AdamW parameter groups: decay every tensor with 2+ dims (matmul weights and the tied embedding),
        not biases or LayerNorm gains. Each group has a "name" ("decay" / "no_decay") for logging, e.g.
        f'{g["name"]}: {len(g["params"])} tensors, {sum(p.numel() for p in g["params"]):,} params'.
        With muon, the blocks' matrices (c_attn, c_proj, c_fc) leave "decay" for a last group "muon" of their
        own, for torch.optim.Muon; the tied embedding/head and wpe stay in "decay" (Muon is for hidden layers)."""
        params = [p for p in self.parameters() if p.requires_grad]
        hidden = {id(p) for p in self.transformer.h.parameters() if p.dim() == 2} if muon else set()
        groups = [
            {"name": "decay", "params": [p for p in params if p.dim() >= 2 and id(p) not in hidden],
             "weight_decay": weight_decay},
            {"name": "no_decay", "params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]  # fmt: skip
        if muon:
            groups.append(
                {"name": "muon", "params": [p for p in params if id(p) in hidden], "weight_decay": weight_decay}
            )
        return groups
