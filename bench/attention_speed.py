"""The CPU attention's speed and accuracy: torch's flash kernel (F.scaled_dot_product_attention, is_causal) against
modeling.cpu_attention's whole batched matmuls, one layer's forward + backward at a preset's shape, eager and compiled.

    python -m bench.attention_speed [--preset small-cpu] [--micro-batch-size 8] [--precision bf16]
        [--seq-lens 256 512 1024] [--threads N] [--rounds 3] [--steps 15] [--out DIR]
        [--step-rounds 3 [--step-steps 10] [--optimizer muon] [--dynamo-backend eager] [--data-dir data/default]]

q, k and v are laid out as the model makes them (heads split from one (B, T, 3C) projection, in the run's dtype) and
the output goes back to (B, T, C), as in modeling.gpt. Each round times every form in turn (the same process, so a
noisy machine slows them alike): the median of --steps calls after a warm-up; a row's figures are the medians over the
rounds, its ratio to flash the range over the rounds. The errors are relative (Frobenius) against flash in fp64 on the
same rounded inputs, for the output and for the projection's gradient. "model takes" says which form modeling.gpt
picks at that length in training (modeling.cpu_attention.takes).

A layer alone is not the step: with --step-rounds, rung 11's whole training step (bench.profile.build_step: the
model, optimizer and precision of cpu_bf16.yaml or cpu.yaml, on real batches, at each of --seq-lens) is timed with
each form, each in a process of its own in turn (the form forced by modeling.cpu_attention.MAX_T, 0 or T, a
constant torch.compile guards on), the median of --step-steps steps after --warmup, with each form's first loss
(the same model and batch: they agree to the precision's rounding). Writes attention_speed.json, .md and .png
(the layer's forward and backward times as bars) to --out; the Markdown tables are printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.loss_numerics import relative_errors
from bench.measure import check_can_compile, checked_inputs
from bench.profile import YAML, build_step
from bench.report import report_folder, save_report
from bench.rungs import REPO, STEP_BACKENDS, TRAIN, dynamo_backend, launch_config
from data_prep import at_least
from evals.plot import png_bytes
from modeling import cpu_attention
from modeling.device import cpu_model
from modeling.runtime import set_up_compute
from training.compile_cache import set_up_compile_cache
from training.config import OPTIMIZERS

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]
FORMS: dict[str, Attention] = {
    "flash": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "whole matmuls": cpu_attention.causal_attention,
}
MODES = ("eager", "compiled")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer(attention: Attention, n_head: int) -> Callable[[Tensor], Tensor]:
    """The attention of one modeling.gpt block from its (B, T, 3C) projection to its (B, T, C) output."""

    def run(qkv: Tensor) -> Tensor:
        B, T, C3 = qkv.shape
        q, k, v = (t.view(B, T, n_head, C3 // 3 // n_head).transpose(1, 2) for t in qkv.split(C3 // 3, dim=2))
        return attention(q, k, v).transpose(1, 2).reshape(B, T, C3 // 3)

    return run


def time_calls(
    run: Callable[[Tensor], Tensor], qkv: Tensor, grad: Tensor, warmup: int, steps: int
) -> tuple[float, float]:
    """Median ms of the forward and of the backward over `steps` calls after `warmup` untimed ones."""
    forward, backward = [], []
    for _ in range(warmup + steps):
        qkv.grad = None
        start = time.perf_counter()
        out = run(qkv)
        middle = time.perf_counter()
        out.backward(grad)
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return statistics.median(forward[warmup:]) * 1e3, statistics.median(backward[warmup:]) * 1e3


def output_and_grad(run: Callable[[Tensor], Tensor], qkv: Tensor, grad: Tensor) -> list[Tensor]:
    """The layer's output and qkv's gradient, on a fresh leaf of the same values."""
    qkv = qkv.detach().requires_grad_()
    out = run(qkv)
    return [out.detach(), *torch.autograd.grad(out, qkv, grad)]


def measure_length(T: int, args: argparse.Namespace, n_head: int, n_embd: int) -> list[dict]:
    """Every form, eager and compiled, at sequence length T: a row each."""
    dtype = DTYPES[args.precision]
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(args.micro_batch_size, T, 3 * n_embd, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(args.micro_batch_size, T, n_embd, generator=g).to(dtype)
    q_like = qkv[..., : n_embd // n_head].unsqueeze(1)  # what the model's attention sees: a (B, 1, T, d) view
    model_takes = "whole matmuls" if cpu_attention.takes(q_like, 0.0) else "flash"
    autocast = torch.autocast("cpu", dtype=dtype) if dtype == torch.bfloat16 else contextlib.nullcontext()
    runs = {}
    for mode in MODES:
        for name, attention in FORMS.items():
            fn = layer(attention, n_head)
            runs[(name, mode)] = torch.compile(fn, dynamic=False) if mode == "compiled" else fn
    want = output_and_grad(layer(FORMS["flash"], n_head), qkv.double(), grad.double())  # outside autocast
    with autocast:
        errors = {key: relative_errors(output_and_grad(run, qkv, grad), want) for key, run in runs.items()}
        rounds: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in runs}
        for _ in range(args.rounds):
            for key, run in runs.items():
                rounds[key].append(time_calls(run, qkv, grad, args.warmup, args.steps))
    rows = []
    for (name, mode), timings in rounds.items():
        flash = rounds[("flash", mode)]
        ratios = [(f + b) / (ff + fb) for (f, b), (ff, fb) in zip(timings, flash, strict=True)]
        forward = statistics.median(f for f, _ in timings)
        backward = statistics.median(b for _, b in timings)
        out_error, grad_error = errors[(name, mode)]
        rows.append({
            "seq_len": T, "form": name, "mode": mode, "forward_ms": forward, "backward_ms": backward,
            "total_ms": forward + backward, "vs_flash_min": min(ratios), "vs_flash_max": max(ratios),
            "out_error": out_error, "grad_error": grad_error, "model_takes": model_takes,
        })  # fmt: skip
        print(
            f"T {T} {name}, {mode}: {forward:.2f} + {backward:.2f} ms, {min(ratios):.2f}-{max(ratios):.2f}x flash's "
            f"time; error against fp64: out {out_error:.2e}, dqkv {grad_error:.2e}",
            flush=True,
        )
    return rows


def step_of(form: str, args: argparse.Namespace, T: int) -> dict:
    """Rung 11's step at context T with the model's attention in `form`, in this process: the median ms of
    --step-steps steps after --warmup, and the first step's loss."""
    # before the model is compiled: takes() then leaves every length to flash, or T to the whole matmuls
    cpu_attention.MAX_T = 0 if form == "flash" else T
    torch.manual_seed(TRAIN.seed)  # the same initial weights in both forms' processes
    step, _ = build_step(
        args.precision, args.preset, args.micro_batch_size, args.data_dir, args.optimizer, args.dynamo_backend, T
    )
    first_loss = step().item()
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.step_steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"form": form, "step_ms": statistics.median(times) * 1e3, "first_loss": first_loss}


def measure_steps(args: argparse.Namespace, argv: list[str], T: int) -> list[dict]:
    """--step-rounds rounds of the step at context T with each form, each in a child process (this command with
    --step-of, its --seq-lens T)."""
    rounds = []
    for round_ in range(1, args.step_rounds + 1):
        steps = {}
        for form in FORMS:
            child = subprocess.run(
                [sys.executable, "-m", "bench.attention_speed", *argv, "--step-of", form, "--seq-lens", str(T)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            if child.returncode != 0:
                sys.exit(f"error: the step with {form} attention failed (exit status {child.returncode}); its output "
                         "is above")  # fmt: skip
            steps[form] = json.loads(child.stdout.splitlines()[-1])
        whole, flash = steps["whole matmuls"], steps["flash"]
        rounds.append({"seq_len": T, "round": round_, "whole_ms": whole["step_ms"], "flash_ms": flash["step_ms"],
                       "ratio": whole["step_ms"] / flash["step_ms"], "whole_first_loss": whole["first_loss"],
                       "flash_first_loss": flash["first_loss"]})  # fmt: skip
        print(f"T {T} step: whole matmuls {whole['step_ms']:.1f} ms, flash {flash['step_ms']:.1f} ms (first loss "
              f"{whole['first_loss']:.5f} / {flash['first_loss']:.5f})", flush=True)  # fmt: skip
    return rounds


def step_markdown(rounds: list[dict]) -> str:
    lines = ["| T | step round | whole matmuls ms | flash ms | whole / flash | first loss, whole / flash |",
             "|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    lines += [
        f"| {r['seq_len']} | {r['round']} | {r['whole_ms']:.1f} | {r['flash_ms']:.1f} | {r['ratio']:.3f} | "
        f"{r['whole_first_loss']:.5f} / {r['flash_first_loss']:.5f} |"
        for r in rounds
    ]
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| T | form | mode | forward ms | backward ms | total ms | × flash | out error | dqkv error | model takes |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = f"{r['vs_flash_min']:.2f}" + (
            f"-{r['vs_flash_max']:.2f}" if f"{r['vs_flash_max']:.2f}" != f"{r['vs_flash_min']:.2f}" else ""
        )
        lines.append(
            f"| {r['seq_len']} | {r['form']} | {r['mode']} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | "
            f"{r['total_ms']:.2f} | {ratio} | {r['out_error']:.2e} | {r['grad_error']:.2e} | {r['model_takes']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], title: str) -> bytes:
    """Forward and backward ms as stacked horizontal bars, one per row, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"T {r['seq_len']} {r['form']}, {r['mode']}" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.5))
    forward = [r["forward_ms"] for r in rows]
    ax.barh(labels, forward, color="tab:blue", label="forward")
    ax.barh(labels, [r["backward_ms"] for r in rows], left=forward, color="tab:orange", label="backward")
    for i, r in enumerate(rows):
        ax.text(r["total_ms"], i, f" {r['total_ms']:.2f}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per call (one layer's attention, median)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.15)
    ax.legend()
    fig.tight_layout()
    return png_bytes(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.attention_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small-cpu", help="model shape (modeling.config presets)")
    p.add_argument("--micro-batch-size", type=at_least(1), default=8, help="sequences per call")
    p.add_argument("--precision", default="bf16", choices=tuple(DTYPES), help="bf16: cpu_bf16.yaml, fp32: cpu.yaml")
    p.add_argument(
        "--seq-lens", type=at_least(1), nargs="+", default=None, help="sequence lengths (default: block_size)"
    )
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--rounds", type=at_least(1), default=3, help="rounds of every form in turn")
    p.add_argument(
        "--warmup", type=at_least(0), default=3, help="untimed calls of a form before each round's timed ones"
    )
    p.add_argument("--steps", type=at_least(1), default=15, help="timed calls of a form per round; the median is kept")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="results folder")
    p.add_argument(
        "--step-rounds", type=at_least(0), default=0, help="rounds of rung 11's step with each form (0: none)"
    )
    p.add_argument(
        "--step-steps", type=at_least(1), default=10, help="timed steps per form and round; the median is kept"
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="the step's (muon: train_accel.py's)")
    p.add_argument("--dynamo-backend", choices=STEP_BACKENDS, help="the step's compile backend (default: the YAML's)")
    p.add_argument("--data-dir", type=Path, default=Path("data/default"), help="the step's corpus")
    p.add_argument("--step-of", choices=tuple(FORMS), help=argparse.SUPPRESS)  # a child of --step-rounds
    args = p.parse_args(argv)
    config = checked_inputs(args.preset, args.data_dir if args.step_rounds or args.step_of else None)
    if args.step_of is None:
        report_folder(args.out)
    device = torch.device("cpu")
    launch = launch_config(REPO / "accelerate_configs" / YAML[args.precision])
    check_can_compile(device, dynamo_backend(launch, args.dynamo_backend) if args.step_of else "inductor")
    if args.threads:
        torch.set_num_threads(args.threads)
    set_up_compile_cache(device)
    lengths = args.seq_lens or [config.block_size]
    if args.step_of:
        print(json.dumps(step_of(args.step_of, args, lengths[0])))
        return
    set_up_compute(device)  # as training sets its process up
    rows = []
    for T in lengths:
        rows += measure_length(T, args, config.n_head, config.n_embd)
    steps = []
    for T in lengths if args.step_rounds else []:
        steps += measure_steps(args, sys.argv[1:] if argv is None else argv, T)
    what = (
        f"{args.preset}'s attention (B={args.micro_batch_size}, {config.n_head} heads of "
        f"{config.n_embd // config.n_head}), {args.precision}, on CPU: {cpu_model()}, {torch.get_num_threads()} "
        f"threads, torch {torch.__version__}; the median of {args.steps} calls per round over {args.rounds} "
        f"round(s), compiled rows: inductor; errors against fp64"
    )
    table = "\n".join([markdown(rows), "", what, ""])
    if steps:
        table += "\n".join([
            "", step_markdown(steps), "",
            f"rung 11's step ({YAML[args.precision]}, {args.optimizer}, {args.preset} B={args.micro_batch_size}): "
            f"the median of {args.step_steps} steps after {args.warmup}, each form in a "
            "process of its own, in turn", "",
        ])  # fmt: skip
    print(table, end="")
    save_report({
        args.out / "attention_speed.json": json.dumps({"setting": what, "rows": rows, "steps": steps}, indent=2)
        + "\n",
        args.out / "attention_speed.md": table,
        args.out / "attention_speed.png": plot(rows, f"{args.preset} attention, {args.precision}, {cpu_model()}"),
    })  # fmt: skip


if __name__ == "__main__":
    main()
