"""Evaluation speed of a randomly initialized preset (speed does not depend on the weights): HellaSwag scoring, or
with --generate, sampling as `python -m evals.generate` does.

python -m evals.bench --preset gpt2-124m [--limit 200] [--batch-size 32] [--bf16]
python -m evals.bench --preset gpt2-124m --generate 40 [--prompt-tokens 900] [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from data_prep import DataPrepError, at_least
from data_prep.tokenizer import get_encoding
from evals import EvalError
from evals.data import TASK_DATA
from evals.runner import DEFAULT_BATCH_SIZE, run_task
from modeling.config import EOT_ID, REAL_VOCAB_SIZE, get_preset
from modeling.device import device_name
from modeling.gpt import GPT
from modeling.runtime import set_up_compute


def time_generation(model: GPT, prompt_tokens: int, new_tokens: int) -> float:
    """Seconds to sample new_tokens (temperature 0.8, top-k 50: evals.generate's defaults) after prompt_tokens random
    ids (the end-of-text id alone for 0, as generate_samples starts a new document); all new_tokens, through any
    end-of-text id, which ends a sample in evals.generate."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(0)
    if prompt_tokens:
        prompt = torch.randint(0, REAL_VOCAB_SIZE, (1, prompt_tokens), generator=generator, device=device)
    else:
        prompt = torch.full((1, 1), EOT_ID, device=device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(prompt, new_tokens, temperature=0.8, top_k=50, generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evals.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--limit", type=at_least(1), default=200, help="HellaSwag examples to score")
    parser.add_argument("--batch-size", type=at_least(1), default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as in a bf16 training run")
    parser.add_argument("--generate", type=at_least(1), metavar="N", help="time sampling N tokens instead of scoring")
    parser.add_argument("--prompt-tokens", type=at_least(0), default=0, help="with --generate: the prompt's length")
    args = parser.parse_args(argv)
    try:
        run_bench(args)
    except (EvalError, DataPrepError) as err:  # DataPrepError: the tokenizer could not be provisioned
        sys.exit(f"error: {err}")


def run_bench(args: argparse.Namespace) -> None:
    """Time what `args` asks for and print one line; EvalError for an unknown preset, before any model is built."""
    try:
        config = get_preset(args.preset)
    except ValueError as err:  # an unknown preset: the message suggests the closest and lists them all
        raise EvalError(str(err)) from None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    set_up_compute(torch.device(device))  # as `python -m evals` and `python -m evals.generate` set theirs up
    model = GPT(config).to(device).eval()
    precision = "bf16" if args.bf16 else "fp32"
    autocast = torch.autocast(device, torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    # the CPU by its model, as the other benchmarks name it: its rates differ by CPU far more than by thread count
    where = f"{args.preset} on {device_name(torch.device(device))} ({torch.get_num_threads()} threads, {precision})"
    if args.generate is not None:
        with autocast:
            time_generation(model, min(args.prompt_tokens, 8), 2)  # warm-up
            seconds = time_generation(model, args.prompt_tokens, args.generate)
        print(f"{where}: {args.generate} tokens after {args.prompt_tokens} in {seconds:.2f} s = "
              f"{args.generate / seconds:.1f} tokens/s")  # fmt: skip
        return
    encoding = get_encoding()
    run_task(model, "hellaswag", encoding, limit=args.batch_size // 4 or 1, batch_size=args.batch_size)  # warm-up
    start = time.perf_counter()
    with autocast:
        scored = len(run_task(model, "hellaswag", encoding, limit=args.limit, batch_size=args.batch_size).examples)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    rate = scored / seconds  # a --limit past the set scores the whole set
    print(
        f"{where}: {scored} HellaSwag examples in {seconds:.1f} s = {rate:.1f} examples/s "
        f"(full set: {TASK_DATA['hellaswag'].num_examples / rate / 60:.1f} min)"
    )


if __name__ == "__main__":
    main()
