"""Timing one row: real batches from the TokenLoader, warm-up then timed steps, peak memory, a profile."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import find_executable_batch_size
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from bench.rungs import TRAIN, Recipe, Role, Trainer, ladder_trainer, tf32_matmuls
from data_prep import DataPrepError, ensure_default_corpus
from data_prep.loader import TokenLoader
from data_prep.manifest import MANIFEST_NAME
from modeling.config import GPTConfig, get_preset
from training.compile_cache import missing_build_tools
from training.metrics import memory_stats
from training.step import is_out_of_memory

ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention", "aten::_cudnn")


@dataclass
class Result:
    label: str  # rung number, or "peer"
    name: str
    change: str
    role: Role = Role.RUNG
    status: str = "ok"  # or "n/a"
    reason: str = ""
    micro_batch_size: int | None = None
    tok_s: float | None = None
    step_ms: float | None = None  # median of the timed steps
    step_ms_all: list[float] = field(default_factory=list)
    compile_s: float | None = None  # first step minus a median step, for compiled rows
    peak_mem_gib: float | None = None
    model_tflops: float | None = None  # achieved model FLOP/s (6N + attention per token), in TFLOP/s
    mfu: float | None = None
    first_loss: float | None = None  # ~ln(vocab) at init in every row: all rows train the same task
    notes: list[str] = field(default_factory=list)
    as_published: bool = True  # peer rows: its own recipe (False: run at rung 11's precision instead)
    profile: list[dict[str, Any]] = field(default_factory=list)  # top ops by self time (--profile-steps)


def flops_per_token(model: nn.Module, config: GPTConfig) -> int:
    """GPT.flops_per_token's 6 N + 12 L T C for any benched model: N is every parameter except embedding tables
    that are only looked up (a table tied to the head is a matmul weight)."""
    head_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookups = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in head_weights
    )
    n = sum(p.numel() for p in model.parameters()) - lookups
    return 6 * n + 12 * config.n_layer * config.block_size * config.n_embd


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    clear_refs = Path("/proc/self/clear_refs")
    if clear_refs.exists():
        clear_refs.write_text("5")  # Linux: reset the peak resident set size (VmHWM) to the current one


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: peak allocated. CPU: the process's peak resident memory since the last reset (runtime included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 2**30
    return memory_stats(device)["mem_rss_peak_gib"]


def peak_kind(precision: str, tf32: bool, device: torch.device) -> str:
    """The peak a row's MFU is taken against: its matmul dtype, and for an fp32 row that runs TF32 on CUDA the TF32
    peak (7x the plain fp32 one on an H100: against that, MFU could pass 100%)."""
    return "tf32" if precision == "fp32" and tf32 and device.type == "cuda" else precision


def profile_ops(run: Callable[[], None], device: torch.device, steps: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Attention kernels seen in `steps` runs, and every op's self time per step and share of the total."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
    events = prof.key_averages()
    kernels = sorted({e.key for e in events if e.key.startswith(ATTENTION_OPS) and "backward" not in e.key})

    def self_us(e: Any) -> float:
        return e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total

    total = sum(self_us(e) for e in events) or 1.0
    ops = [
        {"op": e.key, "ms_per_step": self_us(e) / 1e3 / steps, "share": self_us(e) / total, "calls": e.count // steps}
        for e in sorted(events, key=self_us, reverse=True)
    ]
    return [k.removeprefix("aten::") for k in kernels], ops


def checked_inputs(preset: str, data_dir: Path | None = None, log: Callable[[str], None] = print) -> GPTConfig:
    """A benchmark's --preset and --data-dir, checked before any work: the preset's config, the default corpus
    prepared where --data-dir is a new or empty folder (prepare replaces its folder whole, so it never takes over one
    holding other files). Bad input exits with one `error:` line in the benchmark's own flags."""
    try:
        config = get_preset(preset)  # an unknown name: the message suggests the closest and lists them all
        if data_dir is not None:
            taken = data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir()))
            if taken and not (data_dir / MANIFEST_NAME).is_file():
                raise DataPrepError(
                    f"--data-dir {data_dir} is not a prepared corpus (no {MANIFEST_NAME}) nor an empty folder to "
                    "prepare the default corpus in; pass a folder `python -m data_prep.prepare --out DIR` wrote, or "
                    "a new one"
                )
            ensure_default_corpus(data_dir, log=log)
    except (ValueError, DataPrepError) as err:
        sys.exit(f"error: {err}")
    return config


def device_arg(name: str) -> str:
    """An argparse type for the benchmarks' --device: cuda on a torch that sees no GPU (a CPU-only build, no driver)
    is argparse's one line naming the flag, not CUDA's AssertionError traceback at the first peak probe or tensor."""
    if name == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"cuda, but torch {torch.__version__} sees no CUDA GPU here; give cpu")
    return name


def cannot_compile(device: torch.device, backend: str) -> str | None:
    """What a compile with `backend` lacks here, and how to install it (None where it can run): inductor builds its
    kernels with a compiler (training.compile_cache.missing_build_tools); dynamo's other backends build nothing."""
    return missing_build_tools(device) if backend == "inductor" else None


def check_can_compile(device: torch.device, backend: str) -> None:
    """A benchmark whose rows compile with `backend` exits before any work with one `error:` line where they could
    not (cannot_compile), not with inductor's traceback at its first compiled row."""
    missing = cannot_compile(device, backend)
    if missing is not None:
        sys.exit(f"error: {missing}; this benchmark compiles with it")


@dataclass
class Bench:
    config: GPTConfig
    device: torch.device
    data_dir: Path
    micro_batch_size: int
    warmup: int
    steps: int
    peak_tflops: dict[str, float]  # by peak_kind: bf16, fp32 and on CUDA tf32
    profile_steps: int

    def measure(self, row: Result, make: Callable[[], Trainer], deep_profile: bool, tf32: bool) -> Result:
        """Build a trainer, run warm-up + timed steps on real batches, then profile one step (or
        profile_steps steps when deep_profile) outside the timing; TF32 as the row says, from build to profile."""
        torch.compiler.reset()  # drop the previous row's compiled graphs, then its memory
        gc.collect()
        reset_peak_memory(self.device)
        torch.manual_seed(TRAIN.seed)
        with tf32_matmuls(tf32):
            return self._measure(row, make(), deep_profile, tf32)

    def _measure(self, row: Result, trainer: Trainer, deep_profile: bool, tf32: bool) -> Result:
        loader = TokenLoader(
            self.data_dir, "train", self.config.block_size, trainer.micro_batch_size, seed=TRAIN.seed,
            num_workers=trainer.loader_workers, pin_memory=trainer.pin_memory,
        )  # fmt: skip
        batches = iter(loader)
        losses: list[Tensor] = []

        def one_step() -> None:
            x, y = next(batches)
            x = x.to(self.device, non_blocking=trainer.pin_memory)
            y = y.to(self.device, non_blocking=trainer.pin_memory)
            losses.append(trainer.step(x, y))
            synchronize(self.device)

        times = []
        for _ in range(self.warmup + self.steps):
            start = time.perf_counter()
            one_step()
            times.append(time.perf_counter() - start)
        peak_mem = peak_memory_gib(self.device)
        kernels, ops = profile_ops(one_step, self.device, self.profile_steps if deep_profile else 1)

        timed = times[self.warmup :]
        step_s = statistics.median(timed)
        tok_s = trainer.micro_batch_size * self.config.block_size / step_s
        model_tflops = flops_per_token(trainer.model, self.config) * tok_s / 1e12
        return dataclasses.replace(
            row,
            micro_batch_size=trainer.micro_batch_size,
            tok_s=tok_s,
            step_ms=step_s * 1e3,
            step_ms_all=[t * 1e3 for t in timed],
            compile_s=times[0] - step_s if trainer.compiled else None,
            peak_mem_gib=peak_mem,
            model_tflops=model_tflops,
            mfu=model_tflops / self.peak_tflops[peak_kind(trainer.precision, tf32, self.device)],
            first_loss=losses[0].item(),
            notes=[f"attention kernel: {', '.join(kernels)}"] if kernels else [],
            profile=ops[:25] if deep_profile else [],
        )  # fmt: skip


# A bf16 run on a CPU whose bf16 matmuls are this many times slower than its fp32 ones is not timed. Past
# modeling.cpu_linear.NO_NATIVE_BF16 (3x) bf16 is not native; AVX2-only cores run it 30-300x slower (a small-cpu step
# takes minutes there), while Cascade Lake's 4.5-7x is still timed.
UNTIMED_BF16_SLOWDOWN = 20.0


def untimed_bf16(device: torch.device, bf16_tflops: float, fp32_tflops: float) -> str | None:
    """Why bf16 runs (the ladder's bf16 rows, the peer's recipe) are not timed on this device, or None: a CPU whose
    measured bf16 matmuls are UNTIMED_BF16_SLOWDOWN x slower than its fp32 ones."""
    if device.type == "cpu" and bf16_tflops * UNTIMED_BF16_SLOWDOWN <= fp32_tflops:
        slower = fp32_tflops / bf16_tflops
        return f"this CPU's bf16 matmuls run {slower:.0f}x slower than fp32 (no native bf16): not timed"
    return None


def unless_out_of_memory(row: Result, measure: Callable[[], Result]) -> Result:
    """The measured row, or the row marked out of memory (e.g. rung 0's full logits on a 40 GB card; on the CPU the
    allocator's RuntimeError): the ladder goes on with the next rows instead of aborting."""
    try:
        return measure()
    except RuntimeError as err:
        if not is_out_of_memory(err):
            raise
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dataclasses.replace(row, status="n/a", reason=f"out of memory ({str(err).splitlines()[0][:120]})")


def largest_micro_batch(bench: Bench, measure_at: Callable[[int], Result], base: Result | None, cap: int) -> Result:
    """Rung 10: find_executable_batch_size from cap x base down (halving on out-of-memory, below the base too), then
    every power-of-two multiple of the base micro-batch up to the largest that fits; the fastest tok/s is kept. On CPU
    memory rarely runs out, so the cap bounds the search; bigger batches only help while the cores are not yet
    saturated. `base` is rung 9's row (n/a where it ran out of memory). Raises torch.OutOfMemoryError when not even
    B=1 fits, which unless_out_of_memory reports as the row's n/a."""
    size = bench.micro_batch_size * cap

    def halve() -> int:
        nonlocal size
        size //= 2
        return size

    @find_executable_batch_size(starting_batch_size=size, reduce_batch_size_fn=halve)
    def fits(batch_size: int) -> Result:
        return measure_at(batch_size)

    try:
        tried = [fits()] if cap > 1 else []
    except RuntimeError:
        if size:  # raised by the measurement itself, not accelerate's "No executable batch size found, reached zero."
            raise
        raise torch.OutOfMemoryError(f"nothing fits, B={bench.micro_batch_size * cap} down to B=1") from None
    found = tried[0].micro_batch_size if tried else None
    batch = found // 2 if found else 0
    while batch > bench.micro_batch_size:
        tried.append(measure_at(batch))
        batch //= 2
    if found is None or found > bench.micro_batch_size:  # (the search got below the base only where it did not fit)
        tried.append(base if base is not None else measure_at(bench.micro_batch_size))
    timed = [r for r in tried if r.tok_s is not None]  # not rung 9's row where it ran out of memory
    if not timed:  # cap 1: rung 9's n/a row is all there is
        return tried[0]
    best = max(timed, key=lambda r: r.tok_s)
    largest = max(r.micro_batch_size for r in timed)
    summary = ", ".join(f"B={r.micro_batch_size}: {r.tok_s:,.0f} tok/s" for r in timed)
    best.notes = [
        *best.notes,
        f"largest that fits (cap {cap}x): B={largest}; tried {summary}; kept B={best.micro_batch_size}",
    ]
    return best


def measure_ladder_rung(bench: Bench, row: Result, recipe: Recipe, backend: str, batch_size: int) -> Result:
    make = partial(ladder_trainer, recipe, bench.config, bench.device, batch_size, backend)
    return bench.measure(row, make, deep_profile=False, tf32=recipe.tf32 and bench.device.type == "cuda")
