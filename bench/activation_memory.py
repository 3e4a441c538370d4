"""Peak memory of one training step on the CPU with and without activation checkpointing.

    python -m bench.activation_memory [--layers 12] [--width 256] [--context 512] [--micro-batch-size 16]

Each setting runs in a fresh process (peak RSS only grows): the model, its gradients, AdamW's state, one forward
and backward of the fused loss in fp32, at a shape where activations dominate the weights. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from data_prep import at_least
from modeling.config import GPTConfig
from modeling.device import cpu_model
from modeling.gpt import GPT
from training.metrics import peak_rss_bytes
from training.optim import build_optimizer

MIB = 2**20
HEADS = 4  # --width is split over them


def one_step(shape: GPTConfig, micro_batch_size: int, checkpointed: bool) -> dict[str, float]:
    """One AdamW step of a fresh model; peak RSS before the step (weights, state) and after it, in MiB."""
    torch.manual_seed(0)
    model = GPT(shape)
    model.activation_checkpointing = checkpointed
    optimizer = build_optimizer(model.optimizer_groups(0.1), lr=1e-4, betas=(0.9, 0.95), device_type="cpu")
    x = torch.randint(0, 50257, (micro_batch_size, shape.block_size))
    for p in model.parameters():  # gradients and AdamW's moments exist before the measured step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    before = peak_rss_bytes()
    start = time.perf_counter()
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    return {"before_mib": before / MIB, "peak_mib": peak_rss_bytes() / MIB, "step_s": seconds}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.activation_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layers", type=at_least(1), default=12)
    parser.add_argument("--width", type=at_least(HEADS), default=256, help=f"a multiple of {HEADS}, the heads")
    parser.add_argument("--context", type=at_least(1), default=512)
    parser.add_argument("--micro-batch-size", type=at_least(1), default=16)
    parser.add_argument("--child", choices=["plain", "checkpointed"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.width % HEADS:  # else GPTConfig's ValueError traceback, in each child's output
        parser.error(f"argument --width: must be a multiple of {HEADS} (the heads), got {args.width}")
    shape = GPTConfig(n_layer=args.layers, n_head=HEADS, n_embd=args.width, block_size=args.context)
    if args.child:
        print(json.dumps(one_step(shape, args.micro_batch_size, args.child == "checkpointed")))
        return
    rows = {}
    for mode in ("plain", "checkpointed"):
        cmd = [sys.executable, "-m", "bench.activation_memory", *(argv or sys.argv[1:]), "--child", mode]
        rows[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(
        f"L{args.layers} C{args.width} T{args.context} micro-batch {args.micro_batch_size}, fp32, torch "
        f"{torch.__version__}, CPU: {cpu_model()}\n"
    )
    print("| activation checkpointing | peak RSS before the step (MiB) | peak RSS of the step (MiB) | step (s) |")
    print("|---|---:|---:|---:|")
    for mode, r in rows.items():
        print(f"| {mode} | {r['before_mib']:,.0f} | {r['peak_mib']:,.0f} | {r['step_s']:.2f} |")
    extra = {mode: r["peak_mib"] - r["before_mib"] for mode, r in rows.items()}
    print(f"\nthe step's own memory: {extra['plain']:,.0f} MiB plain, {extra['checkpointed']:,.0f} MiB checkpointed")


if __name__ == "__main__":
    main()
