"""Batched log-likelihood of continuations given contexts: the one primitive HellaSwag and LAMBADA share.

Each request is scored as in lm-eval-harness: the tokens of context + continuation, truncated from the left
to block_size + 1 tokens (the model sees block_size of them), and the model's next-token predictions at the
continuation's positions give its summed negative log-likelihood and whether greedy (argmax) decoding would
reproduce it. If the continuation alone is longer than block_size, only its last block_size tokens are scored.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import Tensor

from modeling.config import REAL_VOCAB_SIZE
from modeling.gpt import GPT

PAD_ID = 0  # any real id: padded positions come after a row's tokens, so causal attention never sees them


@dataclass(frozen=True)
class Request:
    context: list[int]
    continuation: list[int]


@dataclass
class Scores:
    """Per-request results, in request order (identical on every rank)."""

    nll: Tensor  # (N,) float64: summed NLL in nats over the scored continuation tokens
    num_tokens: Tensor  # (N,) int64: scored continuation tokens
    greedy: Tensor  # (N,) bool: argmax equals the continuation token at every scored position


@torch.no_grad()
def score_requests(
    model: torch.nn.Module,
    requests: list[Request],
    block_size: int,
    batch_size: int,
    accelerator: Accelerator | None = None,
) -> Scores:
    """Score `requests` with `model`, `batch_size` rows per forward.

    `model` is a GPT, or a wrapper whose `model(idx)` returns `(logits, _)` (an FSDP or DeepSpeed engine).

    With an accelerator, batches are dealt round-robin to the ranks and the results summed over them. Batches
    are formed before they are dealt, so each batch's contents and floating-point results do not depend on the
    number of processes: 1 and N processes give identical scores.
    """
    if accelerator is None:
        rank, world_size = 0, 1
        device = next(model.parameters()).device
        autocast = contextlib.nullcontext
    else:
        rank, world_size, device = accelerator.process_index, accelerator.num_processes, accelerator.device
        autocast = accelerator.autocast
    logits_at = _logits_fn(model)
    rows = [_truncate(r, block_size) for r in requests]
    # Longest first: batches of similar lengths waste little on padding, and an out-of-memory shows at once.
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    results = torch.zeros(len(rows), 3, dtype=torch.float64, device=device)  # nll, num_tokens, greedy
    for round_start in range(0, math.ceil(len(batches) / world_size) * world_size, world_size):
        index = round_start + rank
        if index >= len(batches):
            # Sharded engines (FSDP, DeepSpeed ZeRO-3) gather weights inside forward, so every rank must run as
            # many forwards as the others; this rank has no batch left, so it runs a throwaway one.
            with autocast():
                model(torch.full((1, 1), PAD_ID, device=device))
            continue
        batch = batches[index]
        with autocast():
            nll, greedy = _score_batch(logits_at, [rows[i] for i in batch], device)
        ids = torch.tensor(batch, device=device)
        results[ids, 0] = nll
        results[ids, 1] = torch.tensor([rows[i][1] for i in batch], dtype=torch.float64, device=device)
        results[ids, 2] = greedy.double()
    if world_size > 1:
        results = accelerator.reduce(results, "sum")  # each row is nonzero on one rank only: a + 0 is exact
    results = results.cpu()
    return Scores(nll=results[:, 0], num_tokens=results[:, 1].long(), greedy=results[:, 2].bool())


def _logits_fn(model: torch.nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """(inputs (B, T), mask (B, T)) -> logits over the real vocabulary (the embedding is padded past it) at the
    masked positions (M, REAL_VOCAB_SIZE)."""
    if isinstance(model, GPT) and not _fsdp_sharded(model):
        # The vocab-sized head runs only where a token is scored: most of a small model's compute is there.
        head = lambda hidden: F.linear(hidden, model.lm_head.weight[:REAL_VOCAB_SIZE])
        return lambda inputs, mask: head(model.hidden_states(inputs)[mask])
    return lambda inputs, mask: model(inputs)[0][mask][:, :REAL_VOCAB_SIZE]


def _fsdp_sharded(model: torch.nn.Module) -> bool:
    """FSDP2 makes the GPT it shards an FSDPGPT (a GPT), whose own parameters (embeddings, head) are gathered only
    around forward(): scored through anything else, they may still be shards, and a rank's collectives (here and
    in the throwaway forwards above) would not pair with the other ranks'. Not imported where nothing sharded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def _truncate(request: Request, block_size: int) -> tuple[list[int], int]:
    """(at most block_size + 1 tokens, how many of the last ones are scored)."""
    if not request.context or not request.continuation:
        raise ValueError("every request needs a non-empty context and continuation")
    tokens = (request.context + request.continuation)[-(block_size + 1) :]
    return tokens, min(len(request.continuation), len(tokens) - 1)


def _score_batch(
    logits_at: Callable[[Tensor, Tensor], Tensor], rows: list[tuple[list[int], int]], device: torch.device
) -> tuple[Tensor, Tensor]:
    width = max(len(tokens) for tokens, _ in rows) - 1
    inputs = [tokens[:-1] + [PAD_ID] * (width + 1 - len(tokens)) for tokens, _ in rows]
    # -1 marks positions that are not scored: the context's and the padding's.
    targets = [
        [-1] * (len(tokens) - 1 - scored) + tokens[-scored:] + [-1] * (width + 1 - len(tokens))
        for tokens, scored in rows
    ]
    inputs, targets = torch.tensor(inputs, device=device), torch.tensor(targets, device=device)
    mask = targets >= 0
    scored_logits = logits_at(inputs, mask).float()
    scored_targets = targets[mask]
    token_nll = scored_logits.logsumexp(-1) - scored_logits.gather(1, scored_targets[:, None]).squeeze(1)
    token_miss = scored_logits.argmax(-1) != scored_targets
    # Back to (rows, width) to sum per row: a plain sum is deterministic on GPUs too (index_add_ is not).
    nll = torch.zeros(targets.shape, dtype=torch.float64, device=device)
    nll[mask] = token_nll.double()
    miss = torch.zeros(targets.shape, dtype=torch.bool, device=device)
    miss[mask] = token_miss
    return nll.sum(1), ~miss.any(1)
