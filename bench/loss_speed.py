"""The training loss's time and memory at a model's real head: F.cross_entropy over the full logits against
modeling.fused_ce, eager and compiled, forward + backward of one micro-batch.

    python -m bench.loss_speed --preset gpt2-124m --device cuda --micro-batch-size 16 [--precision bf16] [--out DIR]
        [--dynamo-backend inductor] [--chunk-rows 256 1024]

The inputs are one micro-batch's final hidden states (B*T, n_embd) and the tied head (padded vocab, n_embd) as fp32
master weights, under bf16 autocast by default (the GPU YAMLs' precision). Peak memory: on CUDA what the loss
allocated on top of its inputs (max allocated minus allocated before); on CPU the process's peak resident memory.
--chunk-rows times the fused loss at each chunk size given, eager and compiled (default: modeling.fused_ce.CHUNK_ROWS,
the rows then named without it). On CUDA 8.9+ a row times the full logits from the FP8 head (modeling.fp8_head),
compiled. Writes loss_speed.json and loss_speed.md to --out; the Markdown table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from bench.loss_numerics import plain_cross_entropy
from bench.measure import (
    check_can_compile,
    checked_inputs,
    device_arg,
    peak_memory_gib,
    reset_peak_memory,
    synchronize,
)
from bench.report import report_folder, save_report
from data_prep import at_least
from modeling import fp8_head
from modeling.config import REAL_VOCAB_SIZE
from modeling.device import device_name
from modeling.fused_ce import CHUNK_ROWS, cuda_memory_bytes, fused_linear_cross_entropy, takes_full_logits
from modeling.runtime import set_up_compute
from training.compile_cache import set_up_compile_cache

LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]
FORMS = ("eager", "compiled")


def time_loss(
    fn: LossFn, h: Tensor, weight: Tensor, targets: Tensor, precision: str, warmup: int, steps: int
) -> dict[str, float]:
    """Median ms of forward + backward, peak memory in GiB, and the loss (the rows must agree)."""
    device = h.device
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    torch.compiler.reset()
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    times, loss = [], None
    for _ in range(warmup + steps):
        h.grad = weight.grad = None
        start = time.perf_counter()
        with autocast:
            loss = fn(h, weight, targets)
        loss.backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
    else:
        peak = peak_memory_gib(device)
    return {"ms": statistics.median(times[warmup:]) * 1e3, "peak_mem_gib": peak, "loss": loss.item()}


def fp8_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(fp8_head.fp8_logits(h, weight).float(), targets)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.loss_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-124m", help="model shape (modeling.config presets)")
    p.add_argument(
        "--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    p.add_argument("--micro-batch-size", type=at_least(1), default=16, help="sequences of block_size tokens")
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="autocast dtype (fp32: none)")
    p.add_argument("--warmup", type=at_least(0), default=3, help="untimed calls (the first one compiles)")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed calls; the median is reported")
    p.add_argument("--dynamo-backend", default="inductor", help="torch.compile backend of the compiled rows")
    p.add_argument(
        "--chunk-rows", type=at_least(1), nargs="+", default=[CHUNK_ROWS], help="the fused loss's chunk sizes"
    )
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="results folder")
    args = p.parse_args(argv)
    config = checked_inputs(args.preset)
    report_folder(args.out)
    device = torch.device(args.device)
    check_can_compile(device, args.dynamo_backend)
    set_up_compile_cache(device)
    set_up_compute(device)  # as training sets its process up: no page faults on every big buffer
    n = args.micro_batch_size * config.block_size
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, config.n_embd, generator=g).to(device).requires_grad_()
    weight = (torch.randn(config.vocab_size, config.n_embd, generator=g) * 0.02).to(device).requires_grad_()
    targets = torch.randint(0, REAL_VOCAB_SIZE, (n,), generator=g).to(device)
    fns: dict[str, LossFn] = {
        "F.cross_entropy, full logits": plain_cross_entropy,
        "F.cross_entropy, full logits, compiled": torch.compile(plain_cross_entropy, backend=args.dynamo_backend),
    }
    if fp8_head.supported(device):  # the full logits from an FP8 matmul (TrainConfig.fp8_head): CUDA 8.9+ only
        fns["F.cross_entropy, full logits, FP8 head, compiled"] = torch.compile(
            fp8_cross_entropy, backend=args.dynamo_backend
        )
    for chunk_rows in args.chunk_rows:
        fused = functools.partial(fused_linear_cross_entropy, chunk_rows=chunk_rows)
        name = "fused (modeling.fused_ce)" + ("" if args.chunk_rows == [CHUNK_ROWS] else f", {chunk_rows}-row chunks")
        fns[name] = fused
        fns[f"{name}, compiled"] = torch.compile(fused, backend=args.dynamo_backend)
    rows = {}
    for name, fn in fns.items():
        rows[name] = time_loss(fn, h, weight, targets, args.precision, args.warmup, args.steps)
        print(f"{name}: {rows[name]['ms']:.2f} ms, {rows[name]['peak_mem_gib']:.2f} GiB", flush=True)
    what = (
        f"{args.preset}: {n:,} tokens (B={args.micro_batch_size}, T={config.block_size}) x vocab "
        f"{config.vocab_size:,} x n_embd {config.n_embd}, {args.precision}, on {device_name(device)}, "
        f"torch {torch.__version__}, compiled rows: {args.dynamo_backend}; median of {args.steps} forward+backward "
        f"after {args.warmup} warm-up calls"
    )
    memory = "GiB over the inputs (CUDA max allocated)" if device.type == "cuda" else "GiB (process peak RSS)"
    logits_bytes = n * config.vocab_size * (2 if args.precision == "bf16" else 4)
    device_bytes = cuda_memory_bytes(device) if device.type == "cuda" else None
    picks = {mode: takes_full_logits(device.type, mode == "compiled", logits_bytes, device_bytes) for mode in FORMS}
    rule = ", ".join(f"{mode} -> {'full logits' if full else 'fused'}" for mode, full in picks.items())
    what += f"; the model's loss here (modeling.fused_ce.takes_full_logits): {rule}"
    lines = [f"| loss | ms | peak mem {memory} | loss value |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {r['ms']:.2f} | {r['peak_mem_gib']:.2f} | {r['loss']:.5f} |" for k, r in rows.items()]
    markdown = "\n".join([*lines, "", what, ""])
    report = {"setting": what, "device": device_name(device), "torch": torch.__version__, "rows": rows}
    print(markdown, end="")
    save_report(
        {args.out / "loss_speed.json": json.dumps(report, indent=2) + "\n", args.out / "loss_speed.md": markdown}
    )


if __name__ == "__main__":
    main()
