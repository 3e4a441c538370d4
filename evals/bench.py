"""HellaSwag scoring speed of a randomly initialized preset (speed does not depend on the weights).

python -m evals.bench --preset gpt2-124m [--limit 200] [--batch-size 32] [--bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from data_prep.tokenizer import get_encoding
from evals.runner import DEFAULT_BATCH_SIZE, run_task
from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.runtime import set_up_compute


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--limit", type=int, default=200, help="HellaSwag examples to score")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as in a bf16 training run")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    set_up_compute(torch.device(device))  # as `python -m evals` sets its process up
    model = GPT(get_preset(args.preset)).to(device)
    encoding = get_encoding()
    run_task(model, "hellaswag", encoding, limit=args.batch_size // 4 or 1, batch_size=args.batch_size)  # warm-up
    autocast = torch.autocast(device, torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    start = time.perf_counter()
    with autocast:
        run_task(model, "hellaswag", encoding, limit=args.limit, batch_size=args.batch_size)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    precision = "bf16" if args.bf16 else "fp32"
    print(
        f"{args.preset} on {device} ({torch.get_num_threads()} threads, {precision}): {args.limit} HellaSwag "
        f"examples in {seconds:.1f} s = {args.limit / seconds:.1f} examples/s "
        f"(full set: {10_042 / (args.limit / seconds) / 60:.1f} min)"
    )


if __name__ == "__main__":
    main()
