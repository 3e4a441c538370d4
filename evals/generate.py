"""Sample text from a trained model.

    python -m evals.generate --run runs/x --prompt "ROMEO:" [--max-new-tokens 100] [--temperature 0.8]
                             [--top-k 50] [--seed 0] [--checkpoint step-N]
    python -m evals.generate --model runs/x/export --prompt "Once upon a time"

An empty prompt starts from <|endoftext|>, i.e. the start of a new document; --temperature 0 is greedy.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from data_prep import DataPrepError
from data_prep.tokenizer import get_encoding, prompt_tokens
from evals import EvalError
from evals.loading import add_model_args, load_model_from_args
from modeling.device import default_device
from modeling.runtime import set_up_compute


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, seed: int = 0) -> None:
    """EvalError for settings generate_text cannot sample with (the CLI checks them before loading a model)."""
    if max_new_tokens <= 0:
        raise EvalError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # nan and inf too
        raise EvalError(f"--temperature must be a number >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise EvalError(f"--top-k must be positive (0 on the command line: no cut-off), got {top_k}")
    if not -(2**63) <= seed < 2**64:  # the range torch.Generator.manual_seed takes
        raise EvalError(f"--seed must be a whole number from -2**63 to 2**64 - 1, got {seed}")


def generate_text(
    model: torch.nn.Module,
    prompt: str,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, decoded; the same seed gives the same text.

    temperature 0 is greedy decoding; top_k None samples from the whole vocabulary."""
    check_sampling(max_new_tokens, temperature, top_k, seed)
    device = next(model.parameters()).device
    tokens = prompt_tokens(prompt)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([tokens], device=device), max_new_tokens, temperature=temperature, top_k=top_k,
            generator=generator,
        )  # fmt: skip
    return prompt + get_encoding().decode(out[0, len(tokens) :].tolist())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k or None, args.seed)  # before the model loads
        model, source = load_model_from_args(args)
        print(f"model: {source}", file=sys.stderr)  # stdout is the text alone
        device = default_device()
        set_up_compute(device)  # as training and `python -m evals` set their processes up
        model.to(device)
        print(generate_text(model, args.prompt, args.max_new_tokens, args.temperature, args.top_k or None, args.seed))
    except (EvalError, DataPrepError) as err:  # DataPrepError: the tokenizer could not be provisioned
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
