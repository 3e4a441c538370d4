"""The speed ladder: a real training step timed per rung, each rung adding one change to the one before.

    python -m bench.ladder --preset small-cpu --device cpu [--micro-batch-size 8] [--steps N] [--warmup N]
        [--out runs/bench] [--peer-dir /path/to/build-nanogpt]

Rung 0 is the seed baseline (modeling.reference.ReferenceGPT, fp32, plain AdamW, eager); rung 11 is the project's
default recipe: train_accel.py's own train_step (training.step) under accelerate_configs/cpu.yaml (1xgpu.yaml on
CUDA). A step is what the training loop does: next batch from the TokenLoader, forward, backward, clip, optimizer
step, zero_grad. Rungs that cannot apply on the device, or run out of memory, are reported as n/a, and so are the
bf16 rows (rungs 5-10, the peer's recipe) on a CPU whose bf16 runs 20x slower than fp32 or worse (AVX2-only ones:
bench.measure.untimed_bf16). With --peer-dir, build-nanogpt's GPT is timed in the same run (bench.peer; `--rungs
none` times only the peer). Writes ladder.json, ladder.md and ladder.png to --out; the Markdown table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import accelerate
import torch

from bench import peer
from bench.measure import (
    Bench,
    Result,
    cannot_compile,
    checked_inputs,
    device_arg,
    largest_micro_batch,
    measure_ladder_rung,
    unless_out_of_memory,
    untimed_bf16,
)
from bench.report import (
    markdown_table,
    plot,
    profile_markdown,
    report_folder,
    save_report,
    summary_line,
    target_lines,
)
from bench.rungs import (
    REPO,
    RUNGS,
    STEP_BACKENDS,
    Recipe,
    Role,
    Trainer,
    checked_launch,
    compile_backend,
    dynamo_backend,
    full_recipe_trainer,
    tf32_matmuls,
)
from data_prep import at_least, number_arg
from modeling.config import get_preset
from modeling.device import cpu_model, device_name
from training.compile_cache import set_up_compile_cache
from training.metrics import dtype_name, measure_matmul_tflops, peak_tflops


def run_ladder(
    bench: Bench, selected: set[int], launch: dict[str, Any], backend_override: str | None, cap: int
) -> list[Result]:
    backend = compile_backend(launch, backend_override)
    results: list[Result] = []
    by_rung: dict[int, Result] = {}
    recipe = Recipe()
    untimed = untimed_bf16(bench.device, bench.peak_tflops["bf16"], bench.peak_tflops["fp32"])
    for rung in RUNGS:
        recipe = rung.apply(recipe)
        if rung.index not in selected:
            continue
        row = Result(str(rung.index), rung.name, rung.change, role=rung.role)
        reason = rung.unavailable(bench.device)
        if reason is None and recipe.autocast is not None and rung.role is not Role.FULL_RECIPE:
            reason = untimed
        if reason is None and recipe.compile:  # rung 11 compiles as its launch YAML says
            full = rung.role is Role.FULL_RECIPE
            reason = cannot_compile(bench.device, dynamo_backend(launch, backend_override) if full else backend)
        if reason is not None:
            result = dataclasses.replace(row, status="n/a", reason=reason)
        elif rung.role is Role.FULL_RECIPE:
            make = partial(
                full_recipe_trainer, bench.config, bench.device, bench.micro_batch_size, launch, backend_override
            )
            # train_accel.py's setup turns TF32 on; the flag does nothing off CUDA
            measure = partial(bench.measure, row, make, deep_profile=bench.profile_steps > 0, tf32=True)
            result = unless_out_of_memory(row, measure)
        else:
            measure_at = partial(measure_ladder_rung, bench, row, recipe, backend)
            if recipe.largest_batch:
                base = by_rung.get(9)
                best = partial(largest_micro_batch, bench, measure_at, base and dataclasses.replace(base), cap)
                kept = unless_out_of_memory(row, best)  # may be rung 9's row, at the base micro-batch
                result = dataclasses.replace(kept, label=row.label, name=row.name, change=row.change, role=row.role)
            else:
                result = unless_out_of_memory(row, partial(measure_at, bench.micro_batch_size))
        print(summary_line(result), flush=True)
        by_rung[rung.index] = result
        results.append(result)
    return results


def run_peers(
    bench: Bench, peer_dir: Path | None, module: ModuleType | None, compiled_backend: str, recipe_precision: str
) -> list[Result]:
    """build-nanogpt's GPT (`module`, bench.peer's, loaded from peer_dir's train_gpt2.py) trained by its own loop's
    step, eager and compiled; skipped without its train_gpt2.py (module None). Where rung 11 trains in fp32
    (cpu.yaml), a third row runs the compiled peer in fp32 too: ours is faster partly by picking the CPU's faster
    precision, and that row shows how much is left without that choice."""
    if module is None:
        where = "no --peer-dir given" if peer_dir is None else f"no {peer.SCRIPT} in {peer_dir}"
        print(f"peer: skipped ({where}; pass --peer-dir with a build-nanogpt checkout to time it)", flush=True)
        return []
    script = module.__file__
    rows = [("build-nanogpt eager", None, True), ("build-nanogpt compiled", compiled_backend, True)]
    if recipe_precision == "fp32":
        rows.append(("build-nanogpt compiled, fp32", compiled_backend, False))
    untimed = untimed_bf16(bench.device, bench.peak_tflops["bf16"], bench.peak_tflops["fp32"])
    results = []
    for name, backend, autocast in rows:

        def make(backend: str | None = backend, autocast: bool = autocast) -> Trainer:
            step, model = peer.build_peer_step(module, bench.config, bench.device, backend, autocast)
            precision = "bf16" if autocast else "fp32"
            return Trainer(step, model, backend is not None, bench.micro_batch_size, precision)

        precision = "bf16 autocast" if autocast else "fp32 (its autocast removed, as rung 11; not its recipe)"
        change = f"{script}: its GPT (vocab 50,304), {precision}, clip 1.0, configure_optimizers' AdamW" + (
            ", torch.compile" if backend else ", eager"
        )
        row = Result("peer", name, change, role=Role.PEER, as_published=autocast)
        deep = backend is not None and bench.profile_steps > 0
        reason = untimed if autocast else None
        if reason is None and backend is not None:
            reason = cannot_compile(bench.device, backend)
        if reason is not None:
            result = dataclasses.replace(row, status="n/a", reason=reason)
        else:
            with peer.peer_matmul_precision():  # its script's setting, for its rows only
                result = unless_out_of_memory(row, partial(bench.measure, row, make, deep_profile=deep, tf32=True))
        print(summary_line(result), flush=True)
        results.append(result)
    return results


# --- CLI ---------------------------------------------------------------------------------------------------------


def parse_rungs(text: str) -> set[int]:
    if text == "all":
        return {r.index for r in RUNGS}
    if text == "none":
        return set()
    picked = {int(part) for part in text.split(",")}
    unknown = picked - {r.index for r in RUNGS}
    if unknown:
        raise argparse.ArgumentTypeError(f"no rung {sorted(unknown)}; rungs are 0..{len(RUNGS) - 1}")
    return picked


# --peak-tflops: a positive rate (0 was a ZeroDivisionError traceback at the first row, a negative one negative MFUs)
tflops = number_arg("a number of TFLOP/s", lambda v: v > 0, "a positive number of TFLOP/s")


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small-cpu", help="model shape (modeling.config presets)")
    p.add_argument(
        "--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda")
    )
    p.add_argument(
        "--micro-batch-size", type=at_least(1), default=8, help="sequences per step (rung 10 searches above it)"
    )
    p.add_argument("--warmup", type=at_least(1), default=3, help="untimed steps per row (the first one compiles)")
    p.add_argument("--steps", type=at_least(1), default=10, help="timed steps per row; the median is reported")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="results folder")
    p.add_argument("--data-dir", type=Path, default=Path("data/default"), help="prepared corpus (made if missing)")
    p.add_argument("--rungs", type=parse_rungs, default="all", help="all, none (the peer only) or e.g. 0,11")
    p.add_argument(
        "--max-batch-factor", type=at_least(1), default=4, help="rung 10's cap, a power of two x micro-batch"
    )
    p.add_argument("--peer-dir", type=Path, default=None, help="a build-nanogpt checkout to time beside rung 11")
    p.add_argument(
        "--accelerate-config", type=Path, default=None, help="rung 11's launch YAML (default: cpu.yaml / 1xgpu.yaml)"
    )
    p.add_argument(
        "--dynamo-backend", choices=STEP_BACKENDS, help="every compiled row's compile backend, the peer's too"
    )
    p.add_argument("--peak-tflops", type=tflops, default=None, help="MFU peak; default: datasheet or measured")
    p.add_argument(
        "--profile-steps", type=at_least(0), default=0, help="profile rung 11 and the compiled peer over N steps"
    )
    return p


def main(argv: list[str] | None = None) -> None:
    prog = "python -m bench.ladder"
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(raw)
    cap = args.max_batch_factor
    if cap & (cap - 1):
        raise SystemExit(f"error: --max-batch-factor must be a power of two (1, 2, 4, ...), got {cap}")
    device = torch.device(args.device)
    launch_path = args.accelerate_config or REPO / "accelerate_configs" / (
        "cpu.yaml" if device.type == "cpu" else "1xgpu.yaml"
    )
    launch = checked_launch(launch_path, device, args.dynamo_backend)
    config = checked_inputs(args.preset, args.data_dir, log=partial(print, flush=True))
    script = peer.peer_script(args.peer_dir)
    try:
        module = peer.checked_peer(script) if script else None  # timed after the rungs: checked before them
    except peer.PeerError as err:
        sys.exit(f"error: {err}")
    report_folder(args.out)
    set_up_compile_cache(device)  # rungs 8-11 and the compiled peer compile
    # MFU of each row against the peak of its matmul dtype: on CPUs without fast bf16 fp32 can be the faster one.
    # On CUDA the fp32 rows that allow TF32 (rungs 2-4, rung 11 in fp32, the fp32 peer) against the TF32 peak.
    peaks = {"bf16": peak_tflops(device, "bf16", args.peak_tflops)}
    for kind, tf32 in (("fp32", False), ("tf32", True))[: 2 if device.type == "cuda" else 1]:
        with tf32_matmuls(tf32):  # peak_tflops reads the TF32 setting of the moment
            peaks[kind] = peak_tflops(device, "no", args.peak_tflops)
    peak = {kind: tflops for kind, (tflops, _) in peaks.items()}
    # A GPU's datasheet peak is the MFU convention; the MFU target is against what its bf16 matmuls really sustain.
    measured_bf16 = measure_matmul_tflops(device, torch.bfloat16) if device.type == "cuda" else None
    peak_text = ", ".join(f"{kind} {tflops:.3f} TFLOP/s ({source})" for kind, (tflops, source) in peaks.items())
    if measured_bf16:
        peak_text += f"; measured bf16 matmul {measured_bf16:.0f} TFLOP/s"
    bench = Bench(
        config, device, args.data_dir, args.micro_batch_size, args.warmup, args.steps, peak, args.profile_steps
    )
    shape = f"L{config.n_layer} H{config.n_head} E{config.n_embd} T{config.block_size} B{args.micro_batch_size}"
    where = f"{device_name(device)}, {torch.get_num_threads()} threads"
    print(f"{args.preset} ({shape}) on {where}; peaks: {peak_text}", flush=True)

    recipe_precision = dtype_name(launch.get("mixed_precision", "no"))
    rows = run_ladder(bench, args.rungs, launch, args.dynamo_backend, cap) + run_peers(
        bench, args.peer_dir, module, compile_backend(launch, args.dynamo_backend), recipe_precision
    )
    command = f"{prog} {shlex.join(raw)}".strip()
    write_report(args, command, rows, launch_path, peaks, measured_bf16, peak_text)


def write_report(
    args: argparse.Namespace,
    command: str,
    rows: list[Result],
    launch_path: Path,
    peaks: dict[str, tuple[float, str]],
    measured_bf16: float | None,
    peak_text: str,
) -> None:
    """The profiles and the Markdown table printed, then ladder.json, ladder.md and ladder.png written in --out."""
    device, config = torch.device(args.device), get_preset(args.preset)
    targets = target_lines(rows, measured_bf16)
    report = {
        "command": command,
        "device": device_name(device),
        "device_type": device.type,
        "cpu_model": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "preset": args.preset,
        "model_config": dataclasses.asdict(config),
        "micro_batch_size": args.micro_batch_size,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "launch_config": str(launch_path),
        "peak_tflops": {kind: tflops for kind, (tflops, _) in peaks.items()},
        "peak_tflops_source": {kind: source for kind, (_, source) in peaks.items()},
        "measured_bf16_tflops": measured_bf16,
        "rows": [dataclasses.asdict(r) for r in rows],
        "targets": targets,
    }
    table = markdown_table(rows)
    footer = [
        f"`{command}` on {device_name(device)} ({torch.get_num_threads()} threads), torch {torch.__version__}, "
        f"accelerate {accelerate.__version__}. Median of {args.steps} timed steps after {args.warmup} warm-up steps; "
        f"compile s = first step minus a median step. MFU against the peak of the row's matmul dtype: {peak_text}. "
        + ("Peak mem: max allocated." if device.type == "cuda" else "Peak mem: process peak RSS while the row ran."),
        *targets,
    ]
    markdown = "\n".join([table, "", *footer, ""])
    profiles = profile_markdown(rows)
    if profiles:
        print(profiles)
    print(markdown)
    files = {
        args.out / "ladder.json": json.dumps(report, indent=2) + "\n",
        args.out / "ladder.md": markdown + ("\n" + profiles if profiles else ""),
        args.out / "ladder.png": plot(rows, f"{args.preset} B{args.micro_batch_size}, {device_name(device)}"),
    }
    save_report(files)
    print(f"wrote {', '.join(str(path) for path in files)}")


if __name__ == "__main__":
    main()
