"""HellaSwag (validation, 10,042 examples): pick which of 4 endings continues a context.

Scored as in build-nanogpt: each ending, with a leading space, is a continuation of the raw `ctx`. The
lowest mean cross-entropy over the ending's tokens wins for `acc_norm` (lm-eval-harness normalizes by the
ending's length in bytes instead, so its acc_norm differs slightly); the lowest summed one for `acc`. For
reference, build-nanogpt reports acc_norm 0.2955 for OpenAI's GPT-2 124M with this scoring; chance is 0.25.
"""

from __future__ import annotations

import tiktoken
import torch
from torch import Tensor

from evals.scoring import Request, Scores

NUM_ENDINGS = 4


def requests(examples: list[dict], encoding: tiktoken.Encoding) -> list[Request]:
    """4 requests per example, in example order."""
    contexts = encoding.encode_ordinary_batch([ex["ctx"] for ex in examples])
    endings = encoding.encode_ordinary_batch([" " + ending for ex in examples for ending in ex["endings"]])
    return [Request(contexts[i // NUM_ENDINGS], ending) for i, ending in enumerate(endings)]


def predictions(scores: Scores) -> dict[str, Tensor]:
    """The chosen ending per example: by mean (`pred_norm`) and by summed (`pred_sum`) NLL."""
    nll = scores.nll.view(-1, NUM_ENDINGS)
    return {"pred_norm": (nll / scores.num_tokens.view(-1, NUM_ENDINGS)).argmin(1), "pred_sum": nll.argmin(1)}


def metrics(examples: list[dict], scores: Scores) -> dict[str, float]:
    labels = torch.tensor([ex["label"] for ex in examples])
    preds = predictions(scores)
    return {
        "hellaswag_acc_norm": (preds["pred_norm"] == labels).double().mean().item(),
        "hellaswag_acc": (preds["pred_sum"] == labels).double().mean().item(),
    }
