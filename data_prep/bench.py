"""Data pipeline throughput on the embedded corpus; prints a Markdown table.

python -m data_prep.bench [--batches 2000]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from itertools import islice
from pathlib import Path

import datasets
import torch

from data_prep.loader import TokenLoader
from data_prep.prepare import prepare, tokenize_batch
from data_prep.sources import iter_documents
from data_prep.tokenizer import get_encoding


def bench_tokenize(num_proc: int) -> tuple[float, int]:
    """Seconds and tokens for the datasets.map tokenization of the default corpus."""
    ds = datasets.Dataset.from_list([{"text": d.text} for d in iter_documents("default")])
    get_encoding()  # load outside the timing; forked workers inherit it
    start = time.perf_counter()
    out = ds.map(
        tokenize_batch, batched=True, batch_size=8, num_proc=num_proc if num_proc > 1 else None, keep_in_memory=True
    )
    seconds = time.perf_counter() - start
    return seconds, sum(len(t) for t in out["tokens"])


def bench_loader(data_dir: Path, num_workers: int, batches: int, block_size: int = 256, micro_batch: int = 8) -> float:
    """Seconds for `batches` micro-batches, after the first (which includes worker start-up)."""
    loader = TokenLoader(data_dir, "train", block_size, micro_batch, num_workers=num_workers)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    for _ in islice(it, batches):
        pass
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_prep.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2000, help="loader batches to time")
    args = parser.parse_args(argv)
    datasets.disable_progress_bars()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for num_proc in (1, 2):
            seconds, tokens = bench_tokenize(num_proc)
            rows.append((f"tokenize default corpus (datasets.map), num_proc={num_proc}", tokens / seconds, None))
        for num_proc in (1, 2):
            start = time.perf_counter()
            manifest = prepare("default", tmp / f"data{num_proc}", num_proc=num_proc)
            seconds = time.perf_counter() - start
            total = sum(s["num_tokens"] for s in json.loads(manifest.read_text())["splits"].values())
            rows.append((f"prepare default end to end, num_proc={num_proc}", total / seconds, None))
        for workers in (0, 2):
            seconds = bench_loader(tmp / "data1", workers, args.batches)
            rate = args.batches / seconds
            rows.append((f"TokenLoader block 256 x micro-batch 8, num_workers={workers}", rate * 256 * 8, rate))
    print(f"Data pipeline, {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads\n")
    print("| what | tokens/s | batches/s |\n|---|---:|---:|")
    for what, tokens_per_s, batches_per_s in rows:
        print(f"| {what} | {tokens_per_s:,.0f} | {'' if batches_per_s is None else f'{batches_per_s:,.0f}'} |")


if __name__ == "__main__":
    main()
