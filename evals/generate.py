"""Sample text from a trained model.

    python -m evals.generate --run runs/x --prompt "ROMEO:" [--num-samples 3] [--max-new-tokens 100]
                             [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] [--checkpoint step-N]
    python -m evals.generate --model runs/x/export --prompt FILE:prompt.txt --device cpu

An empty prompt starts from <|endoftext|>, i.e. the start of a new document; --temperature 0 is greedy. A sample
ends at <|endoftext|> (the end of a document) or after --max-new-tokens; samples are separated by a line of dashes.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from data_prep import DataPrepError
from data_prep.tokenizer import get_encoding, prompt_tokens
from evals import EvalError
from evals.loading import add_model_args, load_model_from_args
from modeling.config import EOT_ID
from modeling.device import default_device, mps_available
from modeling.runtime import set_up_compute

SEPARATOR = "-" * 15  # between samples, as nanoGPT's sample.py prints them


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: int | None, seed: int = 0, top_p: float = 1.0, num_samples: int = 1
) -> None:
    """EvalError for settings generate_samples cannot sample with (the CLI checks them before loading a model)."""
    if max_new_tokens <= 0:
        raise EvalError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # nan and inf too
        raise EvalError(f"--temperature must be a number >= 0 (0 is greedy decoding), got {temperature}")
    if top_k is not None and top_k <= 0:
        raise EvalError(f"--top-k must be positive (0 on the command line: no cut-off), got {top_k}")
    if not 0 < top_p <= 1:  # nan too
        raise EvalError(f"--top-p must be above 0 and at most 1 (1: no cut-off), got {top_p}")
    if num_samples <= 0:
        raise EvalError(f"--num-samples must be positive, got {num_samples}")
    if num_samples > 1 and temperature == 0:  # transformers' greedy generate refuses num_return_sequences > 1 too
        raise EvalError(
            f"--num-samples {num_samples} at --temperature 0: greedy decoding writes the same text every time, so the "
            f"{num_samples} samples would be one text repeated; give --num-samples 1, or a --temperature above 0 "
            "(e.g. 0.8) for different samples"
        )
    if not -(2**63) <= seed < 2**64:  # the range torch.Generator.manual_seed takes
        raise EvalError(f"--seed must be a whole number from -2**63 to 2**64 - 1, got {seed}")


def generate_samples(
    model: torch.nn.Module,
    prompt: str,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    top_p: float = 1.0,
    num_samples: int = 1,
) -> Iterator[str]:
    """num_samples continuations of the prompt, yielded as each is written: the prompt followed by its sampled
    text, decoded, of up to max_new_tokens tokens, ending before an <|endoftext|> the model writes (a document's
    end), as transformers' generate ends at the export's eos_token_id. One generator, seeded once, draws the samples
    in turn, so the same seed gives the same texts, and the first of several is the one a single sample gives.

    temperature 0 is greedy decoding; top_k None and top_p 1 sample from the whole vocabulary."""
    check_sampling(max_new_tokens, temperature, top_k, seed, top_p, num_samples)
    device = next(model.parameters()).device
    tokens = prompt_tokens(prompt)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(num_samples):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([tokens], device=device), max_new_tokens, temperature=temperature, top_k=top_k,
                generator=generator, top_p=top_p, stop_id=EOT_ID,
            )[0, len(tokens) :].tolist()  # fmt: skip
        yield sample_text(prompt, out)


def sample_text(prompt: str, new_ids: list[int]) -> str:
    """The prompt followed by the sampled ids decoded up to the first <|endoftext|> the model wrote (its document's
    end, not printed): training's samples are cut so too."""
    return prompt + get_encoding().decode(new_ids[: new_ids.index(EOT_ID)] if EOT_ID in new_ids else new_ids)


def read_prompt(prompt: str) -> str:
    """The prompt itself, or with FILE:path (nanoGPT's sample.py's form) that file's text."""
    if not prompt.startswith("FILE:"):
        return prompt
    path = Path(prompt.removeprefix("FILE:"))
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise EvalError(f"--prompt {prompt}: cannot read {path} as UTF-8 text ({err})") from None


def pick_device(name: str | None) -> torch.device:
    """--device's device (cpu, cuda, cuda:1, mps), checked to exist here; without it the default one."""
    if name is None:
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise EvalError(f"--device {name} is not a device name: give cpu, cuda, cuda:N or mps") from None
    count = {"cpu": 1, "cuda": torch.cuda.device_count(), "mps": int(mps_available())}.get(device.type, 0)
    if (device.index or 0) >= count:
        raise EvalError(f"--device {name}: this machine has no such device ({torch.cuda.device_count()} CUDA GPUs); "
                        f"leave --device out to use {default_device()}")  # fmt: skip
    return device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--prompt", default="", help="text to continue, or FILE:path (default: a new document)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples to draw, one after another")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="at most; a sample ends at <|endoftext|>")
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens holding p; 1: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu, cuda, cuda:N or mps (default: cuda, else mps, else cpu)")
    args = parser.parse_args(argv)
    printed = 0
    try:
        top_k = args.top_k or None
        # before the model loads
        check_sampling(args.max_new_tokens, args.temperature, top_k, args.seed, args.top_p, args.num_samples)
        prompt, device = read_prompt(args.prompt), pick_device(args.device)
        model, source = load_model_from_args(args)
        print(f"model: {source}", file=sys.stderr)  # stdout is the text alone
        if (length := len(prompt_tokens(prompt))) > (context := model.config.block_size):
            print(f"note: the prompt is {length:,} tokens, longer than the model's context: the text continues from "
                  f"its last {context:,}", file=sys.stderr)  # fmt: skip
        set_up_compute(device)  # as training and `python -m evals` set their processes up
        model.to(device)
        samples = generate_samples(
            model, prompt, args.max_new_tokens, args.temperature, top_k, args.seed, args.top_p, args.num_samples
        )
        for text in samples:  # each as soon as it is written: a Ctrl-C keeps those printed
            print(f"{SEPARATOR}\n{text}" if printed else text, flush=True)
            printed += 1
    except (EvalError, DataPrepError) as err:  # DataPrepError: the tokenizer could not be provisioned
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        print(f"\nstopped by Ctrl-C after {printed} of {args.num_samples} samples", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader stopped reading (| head): end as a program SIGPIPE stops, without a word
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush would fail again
        sys.exit(141)  # 128 + SIGPIPE, the status a shell reports for such a program


if __name__ == "__main__":
    main()
