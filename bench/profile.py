"""Where rung 11's training step spends its time, and how fast its matmuls alone would be.

    python -m bench.profile --precision bf16 [--preset small-cpu] [--micro-batch-size 8] [--threads N]
        [--warmup 3] [--steps 3] [--data-dir data/default] [--optimizer muon] [--dynamo-backend eager]

Builds the ladder's rung 11 (train_accel.py's train_step under cpu_bf16.yaml for bf16, cpu.yaml for fp32), runs
warm-up steps, then profiles --steps steps with torch.profiler, inductor's generated kernels each recorded under
its own name. Prints the step's self time by kind (matmuls, the fused loss's softmax kernels, LayerNorm/GELU and
the other fused kernels, attention, optimizer, clipping, zeroing, casts and copies, data) and the top ops. Then
the step's matmul bound: every matmul the step ran (op, shapes, strides, dtypes, as the profiler recorded them),
its time per call within the step, and timed alone on fresh tensors, summed per step, beside the step's own time;
last, the step's MFU against the peak train_accel.py and bench.ladder measure (one thread's matmul rate x threads)
and, with several threads, against their rate when each multiplies at once (short of that peak where they share a
core's matmul units).
With --threads 1 both are timed in process CPU time, which other jobs on a shared machine disturb far less than wall
time (the profiler's shares stay wall time); with more threads in wall time, as idle threads spin. A torch whose
profiler records no input strides or dtypes (2.11, on the GPU machines) gets the times within the step alone.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

from bench.measure import check_can_compile, checked_inputs, flops_per_token
from bench.rungs import REPO, STEP_BACKENDS, TRAIN, dynamo_backend, full_recipe_trainer, launch_config
from data_prep import at_least
from data_prep.loader import TokenLoader
from modeling import cpu_linear
from modeling.config import get_preset
from modeling.cpu_attention import bf16_products
from modeling.device import cpu_model
from training.compile_cache import set_up_compile_cache
from training.config import OPTIMIZERS
from training.metrics import cpu_matmul_tflops_at_once, peak_tflops

YAML = {"bf16": "cpu_bf16.yaml", "fp32": "cpu.yaml"}
MUON_STEP = "Optimizer.step#Muon.step"  # the profiler's range around training.optim.Muon.step
ONEDNN_LINEAR = "mkldnn::_linear_pointwise"  # modeling.cpu_linear's fp32 products (AVX-512 AMD): x @ weight.T (+ bias)
MATMULS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", ONEDNN_LINEAR}
BF16_MATH = "bookgpt::bf16_products"  # modeling.cpu_attention's op: its matmuls run in oneDNN's bf16 math mode
ATTENTION = "attention: SDPA flash, or the CPU path's softmax (its matmuls: above)"
LOSS_SOFTMAX = "fused loss: softmax over the vocab (modeling.cpu_softmax's kernel, or inductor's)"
# (kind, test on an op name), first match wins; inductor's kernels are named graph_<i>_cpp_fused_<the ops they fuse>_<n>
KINDS: list[tuple[str, Callable[[str], bool]]] = [
    ("matmul (mm, addmm, bmm)", lambda n: n in MATMULS),
    (
        ATTENTION,
        lambda n: "scaled_dot_product" in n or "flash_attention" in n or "_softmax" in n or "bf16_products" in n,
    ),
    (LOSS_SOFTMAX, lambda n: n == "bookgpt::softmax_grad_" or ("cpp_fused" in n and re.search(r"_exp(_|$)", n))),
    # the whole-matmul attention's causal mask in a kernel of its own (the backward's: its softmax unnamed)
    (ATTENTION, lambda n: "arange" in n and "_gt_" in n),
    ("LayerNorm (inductor)", lambda n: "cpp_fused" in n and "layer_norm" in n),
    ("GELU (inductor)", lambda n: "cpp_fused" in n and ("tanh" in n or "gelu" in n or "sigmoid" in n)),
    ("other fused kernels: residuals, casts, bias grads (inductor)", lambda n: "cpp_fused" in n),
    ("embedding fwd/bwd", lambda n: "embedding" in n or "index" in n),
    ("zeroing (fill_, zero_)", lambda n: n in ("aten::fill_", "aten::zero_") or "zero_grad" in n),
    ("optimizer (AdamW)", lambda n: "adam" in n.lower() or n.startswith("Optimizer.step")),
    ("grad clip (norm, scale)", lambda n: "norm" in n or n in ("aten::mul_", "aten::_foreach_mul_", "aten::stack")),
    ("casts and copies", lambda n: n in ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::to")),
    ("data (next batch)", lambda n: n == "data"),
    ("compiled-graph calls (Python wrappers, guards)", lambda n: "CompiledFxGraph" in n or "Compiled" in n),
]


def kind_of(name: str) -> str:
    return next((kind for kind, test in KINDS if test(name)), "other")


def build_step(
    precision: str,
    preset: str,
    micro_batch_size: int,
    data_dir: Path,
    optimizer: str,
    backend: str | None = None,
    block_size: int | None = None,
) -> tuple[Callable[[], Tensor], float]:
    """Rung 11's step on the next real batch (the loader's read recorded as "data"; it returns the detached loss),
    and its model GFLOP; block_size: another context than the preset's."""
    config = get_preset(preset)
    config.block_size = block_size or config.block_size
    launch = launch_config(REPO / "accelerate_configs" / YAML[precision])
    trainer = full_recipe_trainer(config, torch.device("cpu"), micro_batch_size, launch, backend, optimizer)
    loader = TokenLoader(data_dir, "train", config.block_size, micro_batch_size, seed=TRAIN.seed)
    batches = iter(loader)

    def step() -> Tensor:
        with record_function("data"):
            x, y = next(batches)
        return trainer.step(x, y)

    return step, flops_per_token(trainer.model, config) * micro_batch_size * config.block_size / 1e9


def self_times(prof: profile, steps: int) -> dict[str, float]:
    """Self CPU ms per step by op name (the profiler's events on the calling thread)."""
    return {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}


def matmul_calls(prof: profile, steps: int) -> dict[tuple, tuple[int, float]]:
    """(op, shapes, strides, dtypes) -> (calls per step, ms per call within the step), for every matmul the profiled
    steps ran; strides and dtypes are None where this torch's profiler does not record them (torch < 2.13)."""
    calls: dict[tuple, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.name in MATMULS:
            shapes = tuple(tuple(s) for s in e.input_shapes if s)
            strides = dtypes = None
            if hasattr(e, "structured_input_strides"):
                strides = tuple(tuple(s) for s in e.structured_input_strides if s)[:3]
                dtypes = tuple(d for d, s in zip(e.input_dtypes, e.structured_input_shapes, strict=False) if s)[:3]
            op = f"{e.name} ({BF16_MATH})" if under(e, BF16_MATH) else e.name
            calls[(op, shapes[:3], strides, dtypes)].append(e.self_cpu_time_total / 1e3)
    return {k: (len(v) // steps, statistics.median(v)) for k, v in calls.items()}


def under(event: Any, name: str) -> bool:
    """Whether the profiler event ran inside an op of that name."""
    parent = event.cpu_parent
    while parent is not None and parent.name != name:
        parent = parent.cpu_parent
    return parent is not None


DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16, "double": torch.float64}


def clock() -> float:
    """CPU time of this process with one thread (steady on a busy machine), else wall time."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def time_matmul(op: str, shapes: tuple, strides: tuple, dtypes: tuple, repeats: int = 7) -> tuple[float, float]:
    """Median ms of one call of the op alone on fresh tensors laid out as in the step, and its GFLOP."""
    args = [
        torch.empty_strided(shape, stride, dtype=DTYPES[d]).normal_()
        for shape, stride, d in zip(shapes, strides, dtypes, strict=True)
    ]
    if op == "aten::mm":
        a, b = args[:2]  # a third is out=
        run, flop = (lambda: torch.mm(a, b)), 2 * a.shape[0] * a.shape[1] * b.shape[1]
    elif op == ONEDNN_LINEAR:
        x, weight = args[:2]
        bias = args[2] if len(args) > 2 else None
        run, flop = (lambda: cpu_linear.onednn_linear(x, weight, bias)), 2 * x.numel() * weight.shape[0]
    elif op in ("aten::addmm", "aten::addmm_"):
        c, a, b = args[:3]
        run = (lambda: c.addmm_(a, b)) if op == "aten::addmm_" else (lambda: torch.addmm(c, a, b))
        flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    else:  # bmm (a third is out=), baddbmm (the first is the bias)
        a, b = args[-2:] if op == "aten::baddbmm" else args[:2]
        bmm = bf16_products if op.endswith(f"({BF16_MATH})") else torch.bmm
        run, flop = (lambda: bmm(a, b)), 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    run()
    times = []
    for _ in range(repeats):
        start = clock()
        run()
        times.append(clock() - start)
    return statistics.median(times) * 1e3, flop / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=tuple(YAML), default="bf16", help="bf16: cpu_bf16.yaml, fp32: cpu.yaml")
    p.add_argument("--preset", default="small-cpu")
    p.add_argument("--micro-batch-size", type=at_least(1), default=8)
    p.add_argument("--threads", type=at_least(1), default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--warmup", type=at_least(1), default=3, help="untimed steps (the first compiles)")
    p.add_argument("--steps", type=at_least(1), default=3, help="profiled steps")
    p.add_argument("--data-dir", type=Path, default=Path("data/default"))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="muon: as train_accel.py trains by default")
    p.add_argument(
        "--dynamo-backend", choices=STEP_BACKENDS, help="override the YAML's compile backend (eager: no compile)"
    )
    args = p.parse_args(argv)
    checked_inputs(args.preset, args.data_dir)  # before the threads and inductor are set up; build_step builds it
    launch = launch_config(REPO / "accelerate_configs" / YAML[args.precision])
    check_can_compile(torch.device("cpu"), dynamo_backend(launch, args.dynamo_backend))
    if args.threads:
        torch.set_num_threads(args.threads)
    set_up_compile_cache(torch.device("cpu"))
    inductor_config.cpp.enable_kernel_profile = True  # each generated kernel under its own name in the profile
    step, step_gflop = build_step(
        args.precision, args.preset, args.micro_batch_size, args.data_dir, args.optimizer, args.dynamo_backend
    )
    times = []
    for i in range(args.warmup + args.steps):
        start = clock()
        step()
        if i >= args.warmup:
            times.append(clock() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
    ops = self_times(prof, args.steps)
    total = sum(ops.values())
    step_ms = statistics.median(times) * 1e3
    timing = "CPU time" if torch.get_num_threads() == 1 else "wall time"
    print(
        f"\n{args.preset} B{args.micro_batch_size}, {args.precision} ({YAML[args.precision]}), {args.optimizer}, "
        f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}: step {step_ms:.0f} ms "
        f"{timing} (median of {args.steps} unprofiled), {total:.0f} ms of op self time (wall) per profiled step\n"
    )
    by_kind: dict[str, float] = defaultdict(float)
    for name, ms in ops.items():
        by_kind[kind_of(name)] += ms
    print("| where | ms/step | share |\n|---|---:|---:|")
    for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {ms:.1f} | {ms / total:.1%} |")
    print("\n| top ops by self time | kind | ms/step | share |\n|---|---|---:|---:|")
    for name, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:20]:
        print(f"| `{name[:90]}` | {kind_of(name)} | {ms:.1f} | {ms / total:.1%} |")

    if args.optimizer == "muon":  # Newton-Schulz's matmuls count as matmuls above; Muon's whole step, inclusive:
        muon_ms = sum(e.cpu_time_total for e in prof.key_averages() if e.key == MUON_STEP) / 1e3 / args.steps
        print(
            f"\nMuon's step ({MUON_STEP}, inclusive: its Newton-Schulz matmuls and momentum): {muon_ms:.1f} ms/step, "
            f"{muon_ms / total:.1%} of the op self time"
        )
    print_matmul_bound(matmul_calls(prof, args.steps), by_kind[KINDS[0][0]] * step_ms / total, step_ms)
    # the peak train_accel.py and bench.ladder judge MFU by (one thread's matmul rate x threads, the run's dtype and
    # kernels), measured within a few seconds whatever the CPU: bf16 without native kernels (AVX2) is 30-300x slower
    peak, source = peak_tflops(torch.device("cpu"), "bf16" if args.precision == "bf16" else "no")
    step_tflops = step_gflop / step_ms
    threads = torch.get_num_threads()
    at_once = ""
    if threads > 1:  # is that peak within reach: do the threads each have a core's matmul units of their own?
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
        n = 512  # a small model's matmul, as the start-up probes time
        one, together = cpu_matmul_tflops_at_once(dtype, threads, n)
        print(
            f"\nthreads at once: {threads} threads, each multiplying {n}x{n} {args.precision} matrices of its own, "
            f"{together * 1e3:.0f} GFLOP/s together, {together / one:.2f}x one thread's {one * 1e3:.0f} (about "
            f"{threads}x: cores of their own; less: they share a core's matmul units or its memory bandwidth)"
        )
        at_once = f"; {step_tflops / together:.1%} of the {threads} threads' {together * 1e3:.0f} GFLOP/s at once"
    print(
        f"MFU: the step's model FLOPs (6N + 12LTC, {step_gflop:.0f} GFLOP) at {step_tflops * 1e3:.0f} GFLOP/s, "
        f"{step_tflops / peak:.1%} of {peak * 1e3:.0f} GFLOP/s ({source}){at_once}"
    )


def print_matmul_bound(calls: dict[tuple, tuple[int, float]], in_step_ms: float, step_ms: float) -> None:
    """Each matmul's time per call within the step and timed alone, and the sum alone per step beside the step
    (in_step_ms: the profiled matmul share); without recorded layouts, the times within the step only."""
    rows: list[tuple[Any, ...]] = []
    for (op, shapes, strides, dtypes), (count, step_call_ms) in calls.items():
        operands = shapes[-2:] if op in ("aten::addmm", "aten::addmm_", "aten::baddbmm") else shapes[:2]  # a bias first
        a, b = ("x".join(map(str, s)) for s in operands)
        product = f"{a} @ ({b})ᵀ" if op == ONEDNN_LINEAR else f"{a} @ {b}"  # a linear's weight is (out, in)
        ms, gflop = time_matmul(op, shapes, strides, dtypes) if strides is not None else (None, None)
        rows.append((f"{op} {product}", dtypes[-1] if dtypes else "", count, step_call_ms, ms, gflop))
    print("\n| matmul | dtype | calls/step | ms in step | ms alone | GFLOP/s alone |\n|---|---|---:|---:|---:|---:|")
    for name, dtype, count, step_call_ms, ms, g in sorted(rows, key=lambda r: -r[2] * r[3]):
        alone = " | " if ms is None else f"{ms:.2f} | {g / ms * 1e3:.0f}"
        print(f"| {name} | {dtype} | {count} | {step_call_ms:.2f} | {alone} |")
    if any(r[4] is None for r in rows):
        print(
            f"\nmatmul bound: not timed alone, as torch {torch.__version__}'s profiler records no input strides or "
            f"dtypes (torch 2.13 does); the matmuls took ~{in_step_ms:.0f} ms of the step ({step_ms:.0f} ms)"
        )
        return
    alone = sum(count * ms for _, _, count, _, ms, _ in rows)
    gflop = sum(count * g for _, _, count, _, _, g in rows)
    print(
        f"\nmatmul bound: the step's {sum(r[2] for r in rows)} matmuls ({gflop:.0f} GFLOP) take {alone:.0f} ms alone "
        f"({gflop / alone * 1e3:.0f} GFLOP/s), ~{in_step_ms:.0f} ms within the step; the step ({step_ms:.0f} ms) "
        f"runs at {alone / step_ms:.0%} of its matmul bound"
    )


if __name__ == "__main__":
    main()
