"""Score a run folder or an HF-format export on the eval tasks and print a Markdown table.

    python -m evals --run runs/x [--tasks hellaswag,lambada] [--limit N] [--checkpoint step-N] [--batch-size 32]
    python -m evals --model runs/x/export --tasks hellaswag
    python -m training.launch -q --config_file accelerate_configs/cpu_ddp2.yaml -m evals --run runs/x  # ranks split it

A run folder is scored at its newest checkpoint (or --checkpoint), else at its export/ folder. Precision
comes from --mixed-precision, else the accelerate launch config; plain `python -m` runs in fp32.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from accelerate import Accelerator

from data_prep import DataPrepError, at_least
from data_prep.tokenizer import get_encoding
from evals import EvalError
from evals.loading import add_model_args, load_model_from_args
from evals.runner import DEFAULT_BATCH_SIZE, TASKS, TaskRun, parse_tasks, run_task
from modeling.cpu_linear import cpu_matmul_speeds, emulated_bf16
from modeling.device import accelerator_needs_cpu, quiet_deepspeed
from modeling.disk import DiskFull, atomic_write_bytes, cannot_write, disk_full_reported
from modeling.runtime import dtype_name, exit_process, finish, joined, report_error, set_up_compute


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evals", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of: {', '.join(TASKS)}")
    parser.add_argument("--limit", type=at_least(1), help="score only the first N examples of each task")
    parser.add_argument("--batch-size", type=at_least(1), default=DEFAULT_BATCH_SIZE, help="sequences per forward")
    parser.add_argument(
        "--mixed-precision", choices=["no", "bf16", "fp16"], help="autocast dtype (default: the launch config's)"
    )
    parser.add_argument("--json", help="also write the metrics and per-example predictions to this JSON file")
    return parser


def check_json_path(path: str | None) -> None:
    """EvalError where --json could not be written once the eval has run: its folder is missing or not writable, or
    it is one."""
    if path is None:
        return
    if Path(path).is_dir():
        raise EvalError(f"--json {path} is a folder; pass a file path such as {Path(path) / 'evals.json'}")
    if not Path(path).parent.is_dir():
        raise EvalError(f"--json {path}: the folder {Path(path).parent} does not exist; create it or pass another path")
    if (why := cannot_write(path)) is not None:
        raise EvalError(f"--json {path}: {why}; pass another path")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        check_json_path(args.json)  # before the eval, not after it
        tasks = parse_tasks(args.tasks)
        quiet_deepspeed()  # accelerate imports it under a DeepSpeed or FSDP launch, where installed
        accelerator = joined(Accelerator(cpu=accelerator_needs_cpu(), mixed_precision=args.mixed_precision))
        if accelerator.device.type == "cpu" and accelerator.mixed_precision == "fp16":  # before the model is read
            raise EvalError(  # and the table would say fp16 above fp32's scores
                "fp16 (--mixed-precision or the launch config) does not apply on a CPU: accelerate autocasts to fp16 "
                "on GPUs only; pass --mixed-precision bf16 or no"
            )
        if accelerator.device.type == "cpu" and accelerator.mixed_precision == "bf16" and accelerator.is_main_process:
            print_bf16_warning()
        model, source = load_model_from_args(args)
        # VML warmed up (1 and 2 processes score alike only with no sloppier first exp), freed memory kept (each
        # batch's logits, far over glibc's mmap limit, reuse the last batch's pages)
        set_up_compute(accelerator.device)
        model.to(accelerator.device)
        encoding = get_encoding()
        runs = {task: run_task(model, task, encoding, args.limit, args.batch_size, accelerator) for task in tasks}
    except (EvalError, DataPrepError) as err:  # DataPrepError: the tokenizer could not be provisioned
        report_error(f"error: {err}")  # once, by the first process to report it, under a multi-process launch
        exit_process(1)
    status = 0
    if accelerator.is_main_process:
        print(f"{source} | {accelerator.num_processes} process(es), {dtype_name(accelerator.mixed_precision)}\n")
        print(markdown_table(runs))
        if args.json:
            status = save_json(Path(args.json), to_json(source, runs))
    # on gloo (2+ CPU processes) this skips a teardown that can abort after the work is done
    finish(accelerator, status)


def print_bf16_warning() -> None:
    """One `warning:` line on stderr where this CPU emulates bf16 matmuls (AVX2-only cores run them 30-300x slower
    than fp32): the eval would take many times fp32's time for nothing. Measures both (~1 s), as training does."""
    if emulated := emulated_bf16(cpu_matmul_speeds()):
        print(f"warning: {emulated}; evaluate in fp32 with --mixed-precision no", file=sys.stderr, flush=True)


def save_json(path: Path, report: dict) -> int:
    """Write --json whole or not at all once the scores are printed; a disk that fills up (checked writable at the
    start, but not for room) is one `error:` line below them, status 1."""
    try:
        with disk_full_reported(path, "the scores are printed above"):
            atomic_write_bytes(path, (json.dumps(report, indent=1) + "\n").encode())
    except DiskFull as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


def markdown_table(runs: dict[str, TaskRun]) -> str:
    lines = ["| task | metric | value | examples |", "| --- | --- | ---: | ---: |"]
    for task, run in runs.items():
        n = len(run.examples)
        for name, value in run.metrics.items():
            metric = name.removeprefix(f"{task}_")
            shown = f"{value:.2f}" if metric == "ppl" else f"{value:.4f} ({round(value * n)} correct)"
            lines.append(f"| {task} | {metric} | {shown} | {n} |")
    return "\n".join(lines)


def to_json(source: str, runs: dict[str, TaskRun]) -> dict:
    return {
        "source": source,
        "metrics": {name: value for run in runs.values() for name, value in run.metrics.items()},
        "examples": {task: len(run.examples) for task, run in runs.items()},
        "predictions": {task: {k: v.tolist() for k, v in run.predictions.items()} for task, run in runs.items()},
    }


if __name__ == "__main__":
    main()
