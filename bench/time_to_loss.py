"""Time to loss: recipes trained side by side on the same tokens and machine, val loss against tokens and seconds.

    python -m bench.time_to_loss [--recipe today --recipe default --recipe build-nanogpt] [--seeds 3]
        [--config configs/cpu_small.yaml] [--set "--max-steps 30"] [--peer-dir /path/to/build-nanogpt]
        [--accelerate-config accelerate_configs/cpu.yaml] [--eval-every 5] [--baseline today] [--target 6.32]
        [--out runs/ttl]

A recipe is TrainConfig flags on top of --config (configs/cpu_small.yaml on the CPU; on CUDA TrainConfig's defaults,
the GPT-2 124M recipe), then --set, which applies to every recipe: `today` is the AdamW
recipe `make train` ran before Muon, `default` is --config as it stands, NAME="FLAGS" is any other (a sweep point), and
`build-nanogpt` is the peer's GPT, configure_optimizers and get_lr (bench.peer) at --config's shape, steps and batch. A
time budget (time_budget_minutes) is off here: every recipe runs its max_steps, so recipes compare at the same tokens on
any machine. Ours run through train_accel.py's own setup, Trainer.train_step and evaluate (precision and compile from
the accelerate YAML); the peer through its own step, on the same loader and val set. Seed s gives every recipe the same
data order (and our recipes the same init). Seconds count train steps only, the first (compiling) step at the median
step's time. Writes curves.json and curves.png to --out and prints the table last: tokens and seconds to --target
(default: the --baseline recipe's mean final val loss) and the val loss at --budget-tokens (default: the baseline's
tokens).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shlex
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from bench import peer
from bench.measure import untimed_bf16
from bench.report import report_folder, save_report
from bench.rungs import REPO, checked_launch
from data_prep import DataPrepError, at_least
from evals.plot import png_bytes
from modeling.cpu_linear import cpu_matmul_speeds
from modeling.device import cpu_model, device_name
from training.compile_cache import set_up_compile_cache
from training.config import ConfigError, TrainConfig, parse_config
from training.loop import Run, evaluate, setup, trainer_for
from training.pick_cpu_config import pick

# The recipe `make train` ran before this benchmark chose a new one (configs/cpu_small.yaml at that time).
TODAY = (
    "--preset small-cpu --optimizer adamw --lr 1e-3 --lr-schedule cosine --max-steps 60 --warmup-steps 6 "
    "--total-batch-tokens 8192"
)
BUILTIN = {"today": TODAY, "default": ""}
PEER = "build-nanogpt"
# What the benchmark's runs leave out: it keeps its own curves, so no checkpoints, samples or exports; and no time
# budget: recipes compare at the tokens their max_steps give, on any machine. Each starts afresh (an earlier
# benchmark's run folder of the same name is moved into its previous-<time>/).
QUIET = (
    "--eval-interval 0 --sample-interval 0 --checkpoint-interval 0 --export-hf false --eval-tasks '' "
    "--time-budget-minutes 0 --resume never"
)


@dataclasses.dataclass
class Curve:
    recipe: str
    seed: int
    tokens: list[int]  # after each eval's step
    seconds: list[float]  # train-step seconds up to that step
    val_loss: list[float]  # evaluate(): eval_windows windows spread over the val split
    val_loss_opening: list[float]  # the earlier val loss: the split's first eval_windows windows
    tokens_per_step: int
    compile_s: float  # the first step's extra time (compile, warm-up), left out of `seconds`


def parse_recipe(text: str) -> tuple[str, str | None]:
    """`today`, `default`, `build-nanogpt` or NAME=FLAGS -> (name, flags); the peer's flags are None."""
    if text == PEER:
        return text, None
    if text in BUILTIN:
        return text, BUILTIN[text]
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(
            f"a recipe is one of {', '.join([*BUILTIN, PEER])} or NAME=FLAGS, got {text!r}"
        )
    return name, flags


def train_curve(
    run: Run, step: Callable[[], None], model: nn.Module, args: argparse.Namespace, name: str, seed: int
) -> Curve:
    """Train with `step` to run.total_steps (or --until-tokens, the schedule unchanged), evaluating `model` on
    evaluate(run)'s val set every --eval-every steps and at the end."""
    tokens_per_step, eval_every = run.cfg.total_batch_tokens, args.eval_every
    steps = (
        run.total_steps if args.until_tokens is None else min(run.total_steps, -(-args.until_tokens // tokens_per_step))
    )
    evaluated = dataclasses.replace(run, model=model)
    opening = opening_windows(evaluated)
    curve = Curve(name, seed, [], [], [], [], tokens_per_step, 0.0)

    def record(tokens: int, seconds: float) -> None:
        curve.tokens.append(tokens)
        curve.seconds.append(seconds)
        curve.val_loss.append(evaluate(evaluated)["val_loss"])
        curve.val_loss_opening.append(evaluate(opening)["val_loss"])

    record(0, 0.0)
    step_s: list[float] = []
    for taken in range(1, steps + 1):
        started = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - started)
        if taken % eval_every and taken != steps:
            continue
        median = statistics.median(step_s[1:] or step_s)
        record(taken * tokens_per_step, median + sum(step_s[1:]))  # the compiling first step counted as a median one
        curve.compile_s = step_s[0] - median
        print(
            f"{name} seed {seed} step {taken}: val {curve.val_loss[-1]:.4f} (opening {curve.val_loss_opening[-1]:.4f}),"
            f" {curve.seconds[-1]:.0f} s",
            flush=True,
        )
    return curve


def opening_windows(run: Run) -> Run:
    """The run with the earlier val set: the val split's first eval_windows windows, in order (one book's opening),
    so the numbers restate on both definitions. One process: the benchmark runs no DDP."""
    windows = copy.copy(run.val_windows)
    windows.indices = windows.mine = np.arange(len(windows.indices), dtype=np.int64)
    return dataclasses.replace(run, val_windows=windows)


def ours(run: Run) -> tuple[Callable[[], None], nn.Module]:
    """train_accel.py's step: Trainer.train_step (grad_accum micro-batches, clip, update, schedule) and its verdict."""
    trainer, batches = trainer_for(run, stop=False), iter(run.train_loader)

    def step() -> None:
        trainer.train_step(batches)
        trainer.settle()

    return step, run.model


class Autocast(nn.Module):
    """The peer evaluated as its script does: under bf16 autocast."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self.model(x, y)


def peers(run: Run, module: object, backend: str | None) -> tuple[Callable[[], None], nn.Module]:
    """build-nanogpt's step (its GPT, AdamW and get_lr over this run's warmup and steps) on the run's loader."""
    device = run.accelerator.device
    schedule = (run.cfg.warmup_steps, run.total_steps)
    peer_step, model = peer.build_peer_step(
        module, run.model_config, device, backend, grad_accum=run.grad_accum, schedule=schedule
    )
    batches = iter(run.train_loader)

    def step() -> None:
        pairs = [next(batches) for _ in range(run.grad_accum)]
        x, y = (torch.cat(parts).to(device) for parts in zip(*pairs, strict=True))
        peer_step(x, y)

    return step, Autocast(model)


def recipe_config(args: argparse.Namespace, name: str, flags: str | None, seed: int) -> TrainConfig:
    """The TrainConfig a recipe trains for this seed; ConfigError for flags it does not take."""
    out_dir = args.out / "runs" / f"{name}-seed{seed}"
    base = ["--config", str(args.config)] if args.config else []
    argv = list(base)
    for what, text in ((f"recipe {name}'s flags", flags or ""), ("--set", args.set)):
        try:
            argv += shlex.split(text)
        except ValueError as err:  # shlex's: an unclosed quote
            raise ConfigError(f"{what} {text!r}: {str(err).lower()}") from None
    argv += [*shlex.split(QUIET), "--seed", str(seed), "--out-dir", str(out_dir)]
    try:
        return parse_config(argv)[0]
    except ConfigError as err:
        raise ConfigError(f"recipe {name}: {err}") from None


def run_recipe(args: argparse.Namespace, name: str, flags: str | None, seed: int, module: object) -> Curve:
    cfg = recipe_config(args, name, flags, seed)
    torch._dynamo.reset()  # each run compiles its own model (inductor's cache keeps that cheap)
    run = setup(cfg)
    if flags is None:
        backend = None if os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO") == "NO" else "inductor"
        with peer.peer_matmul_precision():
            return train_curve(run, *peers(run, module, backend), args, name, seed)
    return train_curve(run, *ours(run), args, name, seed)


# --- the table, the plot ------------------------------------------------------------------------------------------


def crossing(xs: list[float], losses: list[float], target: float) -> float | None:
    """Where the curve first reaches target, linear between evals; None if it never does."""
    for i in range(1, len(losses)):
        if losses[i] <= target:
            a, b = losses[i - 1], losses[i]
            return xs[i - 1] + (xs[i] - xs[i - 1]) * (a - target) / (a - b) if a > target else xs[i]
    return None


def at(xs: list[float], losses: list[float], x: float) -> float | None:
    """The val loss at x, linear between evals; None past the curve's end."""
    for i in range(1, len(xs)):
        if xs[i] >= x:
            return losses[i - 1] + (losses[i] - losses[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return None


def spread(values: list[float | None], fmt: str) -> str:
    """mean ± sample standard deviation over the seeds that got a value; `k/n` when some did not."""
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    sd = statistics.stdev(got) if len(got) > 1 else 0.0
    text = f"{format(statistics.mean(got), fmt)} ± {format(sd, fmt)}"
    return text if len(got) == len(values) else f"{text} ({len(got)}/{len(values)} seeds)"


# The two val definitions every curve carries: today's (evaluate) and the earlier one (the opening windows).
VAL_KEYS = {"val_loss": "val split, spread windows", "val_loss_opening": "val split's opening (the earlier val set)"}


def val_targets(curves: list[Curve], baseline: str, target: float | None) -> dict[str, float]:
    """The val loss to reach on each val definition: `target` (0 included), else the baseline recipe's mean final."""
    if target is not None:
        return dict.fromkeys(VAL_KEYS, target)
    finals = {key: [getattr(c, key)[-1] for c in curves if c.recipe == baseline] for key in VAL_KEYS}
    return {key: statistics.mean(values) for key, values in finals.items()}


def summarize(curves: list[Curve], key: str, target: float, budget: int) -> list[dict]:
    rows = []
    for name in dict.fromkeys(c.recipe for c in curves):
        mine = [c for c in curves if c.recipe == name]
        tokens = [crossing(c.tokens, getattr(c, key), target) for c in mine]
        seconds = [crossing(c.seconds, getattr(c, key), target) for c in mine]
        rows.append(
            {
                "recipe": name,
                "seeds": len(mine),
                "tokens_to_target": tokens,
                "seconds_to_target": seconds,
                "val_at_budget": [at(c.tokens, getattr(c, key), budget) for c in mine],
                "final_val": [getattr(c, key)[-1] for c in mine],
                "final_tokens": mine[0].tokens[-1],
                "tokens_per_sec": [c.tokens[-1] / c.seconds[-1] for c in mine],
            }
        )
    return rows


def markdown(rows: list[dict], key: str, target: float, budget: int) -> str:
    lines = [
        f"{VAL_KEYS[key]}:\n",
        f"| recipe | seeds | tokens to val {target:.3f} | seconds to val {target:.3f} | val @ {budget:,} tokens "
        "| final val (tokens) | tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['seeds']} | {spread(r['tokens_to_target'], ',.0f')} "
            f"| {spread(r['seconds_to_target'], '.0f')} | {spread(r['val_at_budget'], '.3f')} "
            f"| {spread(r['final_val'], '.3f')} ({r['final_tokens']:,}) | {spread(r['tokens_per_sec'], ',.0f')} |"
        )
    return "\n".join(lines)


TITLE_CHARS = 150  # of the plot's 9-point title: what its 12-inch width holds, with a margin


def plot(curves: list[Curve], target: float, title: str) -> bytes:
    """Val loss against tokens and against train-step seconds, one color per recipe, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(c.recipe for c in curves))}
    for ax, key, label in ((axes[0], "tokens", "tokens"), (axes[1], "seconds", "train-step seconds")):
        for c in curves:
            first = c is next(d for d in curves if d.recipe == c.recipe)
            ax.plot(getattr(c, key), c.val_loss, color=colors[c.recipe], alpha=0.8, label=c.recipe if first else None)
        ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("val loss")
    axes[0].legend()
    # the command, wrapped at its spaces: a long --set or --peer-dir ran past both edges of the figure
    wrapped = (textwrap.fill(line, TITLE_CHARS, break_on_hyphens=False) for line in title.split("\n"))
    fig.suptitle("\n".join(wrapped), fontsize=9)
    fig.tight_layout()
    return png_bytes(fig)


# --- CLI ---------------------------------------------------------------------------------------------------------


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument(
        "--recipe", type=parse_recipe, action="append", help="today, default, build-nanogpt or NAME=FLAGS (repeat)"
    )
    p.add_argument("--seeds", type=at_least(1), default=3, help="seeds per recipe (0, 1, ...)")
    p.add_argument(
        "--config", type=Path, default=None, help="the recipes' base (default: cpu_small.yaml; none on CUDA)"
    )
    p.add_argument("--set", default="", help="TrainConfig flags applied to every recipe, e.g. '--max-steps 30'")
    p.add_argument(
        "--accelerate-config",
        type=Path,
        default=None,
        help="precision and compile (default: the faster precision's CPU YAML, as make train picks it; on CUDA "
        "1xgpu.yaml)",
    )
    p.add_argument(
        "--peer-dir", type=Path, default=None, help="a build-nanogpt checkout (its recipe is skipped without)"
    )
    p.add_argument("--eval-every", type=at_least(1), default=5, help="optimizer steps between val losses")
    p.add_argument(
        "--until-tokens",
        type=at_least(1),
        default=None,
        help="stop every recipe here (its lr schedule still spans its steps)",
    )
    p.add_argument("--baseline", default="today", help="the recipe --target and --budget-tokens default to")
    p.add_argument("--target", type=float, default=None, help="val loss to reach (default: the baseline's final)")
    p.add_argument(
        "--budget-tokens", type=at_least(1), default=None, help="token budget (default: the baseline's tokens)"
    )
    p.add_argument("--out", type=Path, default=Path("runs/time_to_loss"), help="results folder")
    return p


def launch_env(path: Path, device: torch.device) -> dict[str, str]:
    """The variables `accelerate launch` would set from the YAML for precision and compile (read by setup()): its
    dynamo_config's keys as ACCELERATE_<KEY> (the GPU YAMLs' dynamo_use_regional_compilation among them)."""
    launch = checked_launch(path, device)
    dynamo = {"dynamo_backend": "NO"} | (launch.get("dynamo_config") or {})
    return {"ACCELERATE_MIXED_PRECISION": str(launch.get("mixed_precision", "no"))} | {
        f"ACCELERATE_{key.upper()}": str(value) for key, value in dynamo.items() if value is not None
    }


def main(argv: list[str] | None = None) -> None:
    prog = "python -m bench.time_to_loss"
    raw = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    args = parser.parse_args(raw)
    if args.target is not None and not (math.isfinite(args.target) and args.target >= 0):  # no run would reach it
        parser.error(f"argument --target: a val loss is a finite number >= 0, got {args.target}")
    recipes = args.recipe or [parse_recipe(r) for r in ("today", "default", PEER)]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # ~1 s of matmuls, measured only where a choice hangs on them (the peer's bf16, the launch YAML when none is
    # given): a flag rejected below is said at once
    speeds = None
    script = peer.peer_script(args.peer_dir)
    if script is None:
        where = "no --peer-dir given" if args.peer_dir is None else f"no {peer.SCRIPT} in {args.peer_dir}"
        skip_peer = f"{where}; pass --peer-dir with a build-nanogpt checkout"
    else:  # its recipe trains in bf16
        speeds = cpu_matmul_speeds() if device.type == "cpu" else None
        skip_peer = untimed_bf16(device, speeds["bf16"], speeds["no"]) if speeds else None
    if any(flags is None for _, flags in recipes) and skip_peer:
        print(f"{PEER}: skipped ({skip_peer})", flush=True)
        recipes = [(name, flags) for name, flags in recipes if flags is not None]
    if args.target is None and all(name != args.baseline for name, _ in recipes):  # checked before hours of training
        raise SystemExit(
            f"error: no --target and no `{args.baseline}` recipe to take it from; pass --target VAL_LOSS or name one"
            " of the recipes with --baseline"
        )
    try:
        module = peer.checked_peer(script, schedule=True) if script else None
    except peer.PeerError as err:
        raise SystemExit(f"error: {err}") from None
    if args.config is None and device.type == "cpu":
        args.config = REPO / "configs" / "cpu_small.yaml"
    try:
        for name, flags in recipes:  # every recipe's flags, before any trains or this process is set up for it
            recipe_config(args, name, flags, 0)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    if args.accelerate_config is not None:
        launch_path = args.accelerate_config
    elif device.type == "cpu":  # the faster precision here, as `make train` picks it
        yaml, line = pick(speeds or cpu_matmul_speeds())
        print(line, flush=True)
        launch_path = REPO / yaml
    else:
        launch_path = REPO / "accelerate_configs" / "1xgpu.yaml"
    os.environ.update(launch_env(launch_path, device))
    set_up_compile_cache(device)
    report_folder(args.out)

    curves = []
    try:
        for seed in range(args.seeds):  # seed-major: machine noise spreads over the recipes alike
            curves += [run_recipe(args, name, flags, seed, module) for name, flags in recipes]
    except (ConfigError, DataPrepError) as err:  # DataPrepError: --data-dir (in --set or --config) not a corpus
        sys.exit(f"error: {err}")
    baseline = [c for c in curves if c.recipe == args.baseline]
    targets = val_targets(curves, args.baseline, args.target)
    budget = args.budget_tokens or (baseline[0].tokens[-1] if baseline else min(c.tokens[-1] for c in curves))
    tables = {key: summarize(curves, key, targets[key], budget) for key in VAL_KEYS}
    command = f"{prog} {shlex.join(raw)}".strip()
    where = f"{device_name(device)}, {torch.get_num_threads()} threads, {launch_path.name}"
    report = {
        "command": command,
        "cpu_model": cpu_model(),
        "device": where,
        "targets": targets,
        "budget_tokens": budget,
        "recipes": {name: flags for name, flags in recipes},
        "tables": tables,
        "curves": [dataclasses.asdict(c) for c in curves],
    }
    print(f"\n{command}\n{where}; seconds: train steps only, shared-machine noise included")
    for key, rows in tables.items():
        print("\n" + markdown(rows, key, targets[key], budget))
    save_report(
        {
            args.out / "curves.json": json.dumps(report, indent=1),
            args.out / "curves.png": plot(curves, targets["val_loss"], f"{command}\n{where}"),
        }
    )


if __name__ == "__main__":
    main()
