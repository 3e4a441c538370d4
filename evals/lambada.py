"""LAMBADA (OpenAI's variant, test, 5,153 passages): predict a passage's last word from the rest.

`lambada_acc`: greedy decoding reproduces every token of the target word (" word", leading space included).
`lambada_ppl`: exp of the mean NLL per target token over all examples. lm-eval-harness's `perplexity`
averages the NLL per word instead (a word is 1.27 tokens on average), so its figure is higher than ours.
"""

from __future__ import annotations

import math

import tiktoken
from torch import Tensor

from evals.scoring import Request, Scores


def requests(examples: list[dict], encoding: tiktoken.Encoding) -> list[Request]:
    """1 request per example."""
    contexts = encoding.encode_ordinary_batch([ex["context"] for ex in examples])
    targets = encoding.encode_ordinary_batch([ex["target"] for ex in examples])
    return [Request(context, target) for context, target in zip(contexts, targets)]


def predictions(scores: Scores) -> dict[str, Tensor]:
    """Whether each target word was predicted greedily (`correct`) and its NLL in nats (`nll`)."""
    return {"correct": scores.greedy, "nll": scores.nll}


def metrics(examples: list[dict], scores: Scores) -> dict[str, float]:
    return {
        "lambada_acc": scores.greedy.double().mean().item(),
        "lambada_ppl": math.exp(scores.nll.sum().item() / scores.num_tokens.sum().item()),
    }
