"""The speed ladder: a real training step timed per rung, each rung adding one change to the one before.

    python -m bench.ladder --preset small-cpu --device cpu [--micro-batch-size 8] [--steps N] [--warmup N]
        [--out runs/bench] [--peer-dir /path/to/build-nanogpt]

Rung 0 is the seed baseline (modeling.reference.ReferenceGPT, fp32, plain AdamW, eager); rung 11 is the project's
default recipe: train_accel.py's own train_step (training.step) under accelerate_configs/cpu.yaml (1xgpu.yaml on
CUDA). A step is what the training loop does: next batch from the TokenLoader, forward, backward, clip, optimizer
step, zero_grad. Rungs that cannot apply on the device, or run out of memory, are reported as n/a. With --peer-dir,
build-nanogpt's GPT is timed in the same run (bench.peer; `--rungs none` times only the peer). Writes ladder.json,
ladder.md and ladder.png to --out; the Markdown table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import TorchDynamoPlugin, find_executable_batch_size
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from bench import peer
from data_prep import ensure_default_corpus
from data_prep.loader import TokenLoader
from modeling.config import PADDED_VOCAB_SIZE, REAL_VOCAB_SIZE, GPTConfig, get_preset
from modeling.gpt import GPT
from modeling.reference import GELU, LayerNorm, MultiHeadAttention, ReferenceGPT
from training.config import TrainConfig
from training.metrics import dtype_name, measure_matmul_tflops, memory_stats, peak_tflops
from training.optim import build_optimizer
from training.step import Trainer as StepTrainer

REPO = Path(__file__).resolve().parents[1]
TRAIN = TrainConfig()  # lr, betas, weight decay, clip and seed of the project's default run
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention", "aten::_cudnn")
StepFn = Callable[[Tensor, Tensor], Tensor]


# --- rungs 0-10: a recipe, and each rung's change to it ---------------------------------------------------------


Edit = Callable[[nn.Module], None]  # an in-place change to the built model


def reference_gpt(config: GPTConfig, vocab_size: int) -> ReferenceGPT:
    return ReferenceGPT(config, vocab_size=vocab_size)


def our_gpt(config: GPTConfig, vocab_size: int) -> GPT:
    return GPT(dataclasses.replace(config, vocab_size=vocab_size))


def plain_adamw(groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    betas = (TRAIN.beta1, TRAIN.beta2)
    return torch.optim.AdamW(groups, lr=TRAIN.lr, betas=betas, eps=1e-8, foreach=False, fused=False)


def fused_adamw(groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    return build_optimizer(groups, lr=TRAIN.lr, betas=(TRAIN.beta1, TRAIN.beta2), device_type=device.type)


@dataclass(frozen=True)
class Recipe:
    """What rungs 0-10 train with; ladder_trainer builds it. Each rung's change is a function of the recipe
    before it, written in its RUNGS row."""

    model: Callable[[GPTConfig, int], nn.Module] = reference_gpt  # (shape, vocab size) -> model
    edits: tuple[Edit, ...] = ()  # applied in order to the built model
    vocab_size: int = REAL_VOCAB_SIZE
    optimizer: Callable[[list[dict], torch.device], torch.optim.Optimizer] = plain_adamw
    autocast: torch.dtype | None = None
    tf32: bool = False  # CUDA only
    pin_memory: bool = False  # CUDA only
    compile: bool = False
    largest_batch: bool = False  # rung 10: search the micro-batch

    def edit(self, edit: Edit) -> Recipe:
        return dataclasses.replace(self, edits=(*self.edits, edit))

    def build_model(self, config: GPTConfig) -> nn.Module:
        model = self.model(config, self.vocab_size)
        for edit in self.edits:
            edit(model)
        return model


class OnTheFlyMaskAttention(nn.Module):
    """The reference attention (separate q/k/v, unfused scores-softmax-weighted sum) with the causal mask made per
    call by SDPA's math kernel (is_causal) instead of read from a stored (T, T) buffer."""

    def __init__(self, att: MultiHeadAttention) -> None:
        super().__init__()
        self.num_heads, self.head_dim = att.num_heads, att.head_dim
        self.W_query, self.W_key, self.W_value, self.out_proj = att.W_query, att.W_key, att.W_value, att.out_proj
        self.dropout = att.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for w in (
            self.W_query, self.W_key, self.W_value))  # fmt: skip
        with sdpa_kernel(SDPBackend.MATH):  # the fused (flash) kernel is rung 7's change
            ctx = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout.p if self.training else 0.0, is_causal=True
            )
        return self.out_proj(ctx.transpose(1, 2).contiguous().view(b, T, -1))


@torch.no_grad()
def native_layer_norm(ln: LayerNorm) -> nn.LayerNorm:
    native = nn.LayerNorm(ln.scale.numel(), eps=ln.eps)
    native.weight.copy_(ln.scale)
    native.bias.copy_(ln.shift)
    return native


def replace_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module]) -> None:
    """Swap every submodule of type `kind` for make(it), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


def on_the_fly_mask(model: nn.Module) -> None:
    replace_modules(model, MultiHeadAttention, OnTheFlyMaskAttention)


def native_norm_gelu(model: nn.Module) -> None:
    replace_modules(model, LayerNorm, native_layer_norm)
    replace_modules(model, GELU, lambda _: nn.GELU(approximate="tanh"))


def cuda_only(why: str) -> Callable[[torch.device], str | None]:
    return lambda device: None if device.type == "cuda" else f"n/a on {device.type}: {why}"


def multi_device_only(device: torch.device) -> str | None:
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if count < 2:
        return f"n/a: one {device.type} device (DDP needs several)"
    return (
        f"n/a in one process: compare tokens_per_sec_per_device of train_accel.py launched on {count} devices "
        "(e.g. accelerate_configs/8xh100.yaml) with rung 11"
    )


class Role(str, Enum):
    """What a row is: the targets compare the full recipe with the baseline and the peer by role, not label."""

    BASELINE = "baseline"
    RUNG = "rung"
    FULL_RECIPE = "full recipe"
    PEER = "peer"


@dataclass(frozen=True)
class Rung:
    index: int
    name: str
    change: str
    apply: Callable[[Recipe], Recipe]  # this rung's change to the recipe of the rung before
    unavailable: Callable[[torch.device], str | None] = lambda device: None  # why it cannot apply, or None
    role: Role = Role.RUNG


same = lambda recipe: recipe
# Rung 11 is no recipe: it is train_accel.py's own step (full_recipe_trainer), whatever rungs 0-10 did.
RUNGS = (
    Rung(0, "baseline", "ReferenceGPT: fp32, stored mask, hand-written LayerNorm/GELU, vocab 50,257, "
         "plain AdamW (foreach=False, fused=False), eager", same, role=Role.BASELINE),
    Rung(1, "mask on the fly", "causal mask made per call (is_causal, SDPA math kernel) instead of the stored "
         "(T, T) buffer", lambda r: r.edit(on_the_fly_mask)),
    Rung(2, "TF32", "TF32 matmuls and convolutions", lambda r: dataclasses.replace(r, tf32=True),
         cuda_only("TF32 is an NVIDIA tensor-core format")),
    Rung(3, "fused AdamW", "training.optim.build_optimizer: AdamW(fused=True)",
         lambda r: dataclasses.replace(r, optimizer=fused_adamw)),
    Rung(4, "pinned memory", "TokenLoader(pin_memory=True, 2 workers) + non_blocking copies",
         lambda r: dataclasses.replace(r, pin_memory=True), cuda_only("pinning only speeds host-to-GPU copies")),
    Rung(5, "bf16 autocast", "torch.autocast(bfloat16), fp32 master weights",
         lambda r: dataclasses.replace(r, autocast=torch.bfloat16)),
    Rung(6, "native LayerNorm/GELU", "nn.LayerNorm and nn.GELU(tanh) instead of the hand-written ones",
         lambda r: r.edit(native_norm_gelu)),
    Rung(7, "SDPA flash attention", "our GPT: fused qkv + SDPA(is_causal), tied head; loss still F.cross_entropy "
         "on the full logits", lambda r: dataclasses.replace(r, model=our_gpt, edits=())),
    Rung(8, "torch.compile", "torch.compile of model + loss", lambda r: dataclasses.replace(r, compile=True)),
    Rung(9, "vocab 50,304", "embedding and head padded to a multiple of 64",
         lambda r: dataclasses.replace(r, vocab_size=PADDED_VOCAB_SIZE)),
    Rung(10, "largest micro-batch", "accelerate find_executable_batch_size from the cap down, then the fastest "
         "micro-batch of base..cap kept", lambda r: dataclasses.replace(r, largest_batch=True)),
    Rung(11, "full recipe", "train_accel.py's train_step at the base micro-batch: accelerate-prepared GPT with the "
         "fused linear-CE loss, fused AdamW, launch YAML's precision and compile", same, role=Role.FULL_RECIPE),
    Rung(12, "DDP scaling", "data parallel over all devices", same, multi_device_only),
)  # fmt: skip


class PlainLoss(nn.Module):
    """Model plus the seed's loss, F.cross_entropy over the full logits, as one module so that torch.compile sees
    both (as in build-nanogpt, whose forward computes the loss)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        if isinstance(self.model, ReferenceGPT):
            return self.model.loss(x, y)
        logits, _ = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@dataclass
class Trainer:
    step: StepFn  # one optimizer step on a batch; returns the detached loss
    model: nn.Module  # the raw model, for the FLOP count
    compiled: bool
    micro_batch_size: int
    precision: str  # "bf16" or "fp32": the matmul dtype, whose peak MFU is taken against
    tf32: bool = False  # TF32 matmuls for this row only (a global flag: set and reset around each row)
    pin_memory: bool = False
    loader_workers: int = 0  # pinning happens in the loader's pin thread only with workers


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """torch's TF32 flags for one row, restored afterwards, so no row inherits another's setting."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def ladder_trainer(
    recipe: Recipe, config: GPTConfig, device: torch.device, micro_batch_size: int, backend: str
) -> Trainer:
    """Rungs 0-10: the recipe's model, loss, autocast and AdamW in a plain training step."""
    model = recipe.build_model(config)
    if isinstance(model, GPT):
        groups = model.optimizer_groups(TRAIN.weight_decay)
    else:
        groups = [{"params": list(model.parameters()), "weight_decay": TRAIN.weight_decay}]  # as the book does
    model.to(device)
    loss_fn: nn.Module = PlainLoss(model)
    if recipe.compile:
        loss_fn = torch.compile(loss_fn, backend=backend, dynamic=False)  # rung 10 recompiles per batch shape
    optimizer = recipe.optimizer(groups, device)
    params = list(model.parameters())

    def step(x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast(device.type, dtype=recipe.autocast or torch.float32, enabled=recipe.autocast is not None):
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, TRAIN.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    cuda = device.type == "cuda"
    pin = recipe.pin_memory and cuda
    precision = "fp32" if recipe.autocast is None else "bf16"
    return Trainer(step, model, recipe.compile, micro_batch_size, precision, recipe.tf32 and cuda, pin, 2 if pin else 0)


def launch_config(path: Path) -> dict[str, Any]:
    """The launch YAML as `accelerate launch` reads it (accelerate's own config loader)."""
    return load_config_from_file(str(path)).to_dict()


def dynamo_backend(launch: dict[str, Any], override: str | None) -> str:
    return override or str((launch.get("dynamo_config") or {}).get("dynamo_backend", "no")).lower()


def compile_backend(launch: dict[str, Any], override: str | None) -> str:
    """The backend of rungs 8-10 and the compiled peer: rung 11's, or inductor where the launch YAML compiles nothing
    (those rows always compile)."""
    backend = dynamo_backend(launch, override)
    return "inductor" if backend == "no" else backend


def full_recipe_trainer(
    config: GPTConfig, device: torch.device, micro_batch_size: int, launch: dict[str, Any], backend_override: str | None
) -> Trainer:
    """Rung 11: train_accel.py's model, optimizer and train_step under the launch YAML's precision and compile,
    with its TF32 setting and its loader (pinned on CUDA, TrainConfig's workers)."""
    dynamo = launch.get("dynamo_config") or {}
    backend = dynamo_backend(launch, backend_override)
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=launch.get("mixed_precision", "no"),
        dynamo_plugin=TorchDynamoPlugin(
            backend=backend.upper(),
            mode=dynamo.get("dynamo_mode"),
            fullgraph=dynamo.get("dynamo_use_fullgraph"),
            dynamic=dynamo.get("dynamo_use_dynamic"),
        ),
    )
    model = GPT(config)
    optimizer = build_optimizer(
        model.optimizer_groups(TRAIN.weight_decay),
        lr=TRAIN.lr,
        betas=(TRAIN.beta1, TRAIN.beta2),
        device_type=device.type,
    )
    prepared, optimizer = accelerator.prepare(model, optimizer)
    tokens_per_step = micro_batch_size * config.block_size
    trainer = StepTrainer(accelerator, prepared, optimizer, grad_clip=TRAIN.grad_clip, tokens_per_step=tokens_per_step)

    def step(x: Tensor, y: Tensor) -> Tensor:
        return trainer.train_step(iter([(x, y)])).loss

    cuda = device.type == "cuda"
    precision = dtype_name(accelerator.mixed_precision)
    return Trainer(step, model, backend != "no", micro_batch_size, precision, cuda, cuda, TRAIN.num_workers)


# --- measuring ---------------------------------------------------------------------------------------------------


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


@dataclass
class Bench:
    config: GPTConfig
    device: torch.device
    data_dir: Path
    micro_batch_size: int
    warmup: int
    steps: int
    peak_tflops: dict[str, float]  # by precision
    profile_steps: int

    def measure(self, row: Result, make: Callable[[], Trainer], deep_profile: bool, tf32: bool) -> Result:
        """Build a trainer, run warm-up + timed steps on real batches, then profile one step (or
        profile_steps steps when deep_profile) outside the timing; TF32 as the row says, from build to profile."""
        torch.compiler.reset()  # drop the previous row's compiled graphs, then its memory
        gc.collect()
        reset_peak_memory(self.device)
        torch.manual_seed(TRAIN.seed)
        with tf32_matmuls(tf32):
            return self._measure(row, make(), deep_profile)

    def _measure(self, row: Result, trainer: Trainer, deep_profile: bool) -> Result:
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
            mfu=model_tflops / self.peak_tflops[trainer.precision],
            first_loss=losses[0].item(),
            notes=[f"attention kernel: {', '.join(kernels)}"] if kernels else [],
            profile=ops[:25] if deep_profile else [],
        )  # fmt: skip


def unless_out_of_memory(row: Result, measure: Callable[[], Result]) -> Result:
    """The measured row, or the row marked out of memory (e.g. rung 0's full logits on a 40 GB card): the ladder
    goes on with the next rows instead of aborting."""
    try:
        return measure()
    except torch.OutOfMemoryError as err:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dataclasses.replace(row, status="n/a", reason=f"out of memory ({str(err).splitlines()[0][:120]})")


def largest_micro_batch(bench: Bench, measure_at: Callable[[int], Result], base: Result | None, cap: int) -> Result:
    """Rung 10: find_executable_batch_size from cap x base down (halving on out-of-memory), then every power-of-two
    multiple of the base micro-batch up to the largest that fits; the fastest tok/s is kept. On CPU memory rarely
    runs out, so the cap bounds the search; bigger batches only help while the cores are not yet saturated."""
    size = bench.micro_batch_size * cap

    def halve() -> int:
        nonlocal size
        size //= 2
        return size

    @find_executable_batch_size(starting_batch_size=size, reduce_batch_size_fn=halve)
    def fits(batch_size: int) -> Result:
        return measure_at(batch_size)

    tried = [fits()] if cap > 1 else []
    batch = tried[0].micro_batch_size // 2 if tried else 0
    while batch > bench.micro_batch_size:
        tried.append(measure_at(batch))
        batch //= 2
    if all(r.micro_batch_size != bench.micro_batch_size for r in tried):
        tried.append(base if base is not None else measure_at(bench.micro_batch_size))
    best = max(tried, key=lambda r: r.tok_s or 0.0)
    largest = max(r.micro_batch_size or 0 for r in tried)
    summary = ", ".join(f"B={r.micro_batch_size}: {r.tok_s:,.0f} tok/s" for r in tried)
    best.notes = [
        *best.notes,
        f"largest that fits (cap {cap}x): B={largest}; tried {summary}; kept B={best.micro_batch_size}",
    ]
    return best


def measure_ladder_rung(bench: Bench, row: Result, recipe: Recipe, backend: str, batch_size: int) -> Result:
    make = partial(ladder_trainer, recipe, bench.config, bench.device, batch_size, backend)
    return bench.measure(row, make, deep_profile=False, tf32=recipe.tf32 and bench.device.type == "cuda")


def run_ladder(
    bench: Bench, selected: set[int], launch: dict[str, Any], backend_override: str | None, cap: int
) -> list[Result]:
    backend = compile_backend(launch, backend_override)
    results: list[Result] = []
    by_rung: dict[int, Result] = {}
    recipe = Recipe()
    for rung in RUNGS:
        recipe = rung.apply(recipe)
        if rung.index not in selected:
            continue
        row = Result(str(rung.index), rung.name, rung.change, role=rung.role)
        reason = rung.unavailable(bench.device)
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


def run_peers(bench: Bench, peer_dir: Path | None, compiled_backend: str, recipe_precision: str) -> list[Result]:
    """build-nanogpt's GPT trained by its own loop's step, eager and compiled; skipped without its train_gpt2.py.
    Where rung 11 trains in fp32 (cpu.yaml), a third row runs the compiled peer in fp32 too: ours is faster
    partly by picking the CPU's faster precision, and that row shows how much is left without that choice."""
    script = peer.peer_script(peer_dir)
    if script is None:
        where = "no --peer-dir given" if peer_dir is None else f"no {peer.SCRIPT} in {peer_dir}"
        print(f"peer: skipped ({where}; pass --peer-dir with a build-nanogpt checkout to time it)", flush=True)
        return []
    module = peer.load_peer(script)
    rows = [("build-nanogpt eager", None, True), ("build-nanogpt compiled", compiled_backend, True)]
    if recipe_precision == "fp32":
        rows.append(("build-nanogpt compiled, fp32", compiled_backend, False))
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
        with peer.peer_matmul_precision():  # its script's setting, for its rows only
            result = unless_out_of_memory(row, partial(bench.measure, row, make, deep_profile=deep, tf32=True))
        print(summary_line(result), flush=True)
        results.append(result)
    return results


# --- reporting ---------------------------------------------------------------------------------------------------


def summary_line(r: Result) -> str:
    prefix = "" if r.role is Role.PEER else "rung "
    if r.status != "ok":
        return f"{prefix}{r.label} {r.name}: {r.reason}"
    compile_s = f", compile {r.compile_s:.1f} s" if r.compile_s is not None else ""
    return (
        f"{prefix}{r.label} {r.name}: {r.tok_s:,.0f} tok/s, {r.step_ms:.0f} ms/step "
        f"(B={r.micro_batch_size}){compile_s}, loss {r.first_loss:.3f}"
    )


def target_lines(rows: list[Result], measured_bf16_tflops: float | None = None) -> list[str]:
    """The ladder's targets: the full recipe >= 5x rung 0 and >= 1.5x the best peer (as published), all from this
    one run; without a target, the ratio to the peer at rung 11's precision; and, given the bf16 matmul peak measured
    on this GPU, the full recipe's MFU against it (target >= 55%)."""
    measured = [r for r in rows if r.status == "ok"]
    full = next((r for r in measured if r.role is Role.FULL_RECIPE), None)
    baseline = next((r for r in measured if r.role is Role.BASELINE), None)
    peers = [r for r in measured if r.role is Role.PEER]
    if full is None:
        return []
    lines = []
    checks: list[tuple[str, Result, float | None]] = []
    if baseline is not None:
        checks.append((f"rung {baseline.label}", baseline, 5.0))
    published = [r for r in peers if r.as_published]
    if published:
        best = max(published, key=lambda r: r.tok_s or 0.0)
        checks.append((f"best peer ({best.name})", best, 1.5))
    checks += [(f"peer at rung 11's precision ({r.name})", r, None) for r in peers if not r.as_published]
    for what, other, target in checks:
        ratio = (full.tok_s or 0.0) / (other.tok_s or 1.0)
        if target is None:
            lines.append(f"full recipe / {what}: {ratio:.2f}x (no target: not the peer's own recipe)")
        else:
            lines.append(f"full recipe / {what}: {ratio:.2f}x (target >= {target}x): {verdict(ratio >= target)}")
    if measured_bf16_tflops and full.model_tflops:
        mfu = full.model_tflops / measured_bf16_tflops
        lines.append(
            f"full recipe MFU against the measured bf16 matmul peak ({measured_bf16_tflops:.0f} TFLOP/s): {mfu:.1%} "
            f"(target >= 55%): {verdict(mfu >= 0.55)}"
        )
    return lines


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def markdown_table(rows: list[Result]) -> str:
    baseline = next((r for r in rows if r.role is Role.BASELINE and r.status == "ok"), None)
    lines = [
        "| rung | change | tok/s | × rung 0 | step ms | peak mem GiB | MFU | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        change = f"**{r.name}**: {r.change}"
        if r.status != "ok":
            lines.append(f"| {r.label} | {change} ({r.reason}) | n/a | n/a | n/a | n/a | n/a | |")
            continue
        notes = "".join(f"; {n}" for n in r.notes)
        ratio = f"{r.tok_s / baseline.tok_s:.2f}×" if baseline and r.tok_s else ""
        compile_s = f"{r.compile_s:.1f}" if r.compile_s is not None else ""
        lines.append(
            f"| {r.label} | {change} (B={r.micro_batch_size}{notes}) | {r.tok_s:,.0f} | {ratio} | {r.step_ms:.0f} | "
            f"{r.peak_mem_gib:.2f} | {r.mfu:.1%} | {compile_s} |"
        )
    return "\n".join(lines)


def profile_markdown(rows: list[Result], top: int = 12) -> str:
    parts = []
    for r in rows:
        if not r.profile:
            continue
        parts.append(f"Top ops by self time, {r.label} {r.name} (ms per step, share of the step's op time):\n")
        parts.append("| op | ms/step | share | calls/step |\n|---|---:|---:|---:|")
        parts += [f"| {o['op']} | {o['ms_per_step']:.1f} | {o['share']:.1%} | {o['calls']} |" for o in r.profile[:top]]
        parts.append("")
    return "\n".join(parts)


def plot(rows: list[Result], title: str, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.name if r.role is Role.PEER else f"{r.label} {r.name}" for r in rows]
    values = [r.tok_s or 0.0 for r in rows]
    color = {Role.PEER: "tab:orange", Role.FULL_RECIPE: "tab:green"}
    colors = [color.get(r.role, "tab:blue") for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(rows) + 1.5))
    bars = ax.barh(labels, values, color=colors)
    for bar, r in zip(bars, rows):
        text = f" {r.tok_s:,.0f}" if r.status == "ok" else " n/a"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens / s (median step)")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_model()}"


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


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small-cpu", help="model shape (modeling.config presets)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--micro-batch-size", type=int, default=8, help="sequences per step (rung 10 searches above it)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row (the first one compiles)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row; the median is reported")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="results folder")
    p.add_argument("--data-dir", type=Path, default=Path("data/default"), help="prepared corpus (made if missing)")
    p.add_argument("--rungs", type=parse_rungs, default="all", help="all, none (the peer only) or e.g. 0,11")
    p.add_argument("--max-batch-factor", type=int, default=4, help="rung 10's cap, a power of two x micro-batch")
    p.add_argument("--peer-dir", type=Path, default=None, help="a build-nanogpt checkout to time beside rung 11")
    p.add_argument(
        "--accelerate-config", type=Path, default=None, help="rung 11's launch YAML (default: cpu.yaml / 1xgpu.yaml)"
    )
    p.add_argument("--dynamo-backend", default=None, help="override the compile backend of every compiled row")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU peak; default: datasheet or measured")
    p.add_argument("--profile-steps", type=int, default=0, help="profile rung 11 and the compiled peer over N steps")
    return p


def main(argv: list[str] | None = None) -> None:
    prog = "python -m bench.ladder"
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(raw)
    cap = args.max_batch_factor
    if cap < 1 or cap & (cap - 1) or args.warmup < 1 or args.steps < 1:
        raise SystemExit("--max-batch-factor must be a power of two >= 1, --warmup and --steps >= 1")
    device = torch.device(args.device)
    config = get_preset(args.preset)
    ensure_default_corpus(args.data_dir, log=partial(print, flush=True))
    launch_path = args.accelerate_config or REPO / "accelerate_configs" / (
        "cpu.yaml" if device.type == "cpu" else "1xgpu.yaml"
    )
    launch = launch_config(launch_path)
    # MFU of each row against the peak of its matmul dtype: on CPUs without fast bf16 fp32 can be the faster one.
    peaks = {kind: peak_tflops(device, mode, args.peak_tflops) for kind, mode in (("bf16", "bf16"), ("fp32", "no"))}
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
        bench, args.peer_dir, compile_backend(launch, args.dynamo_backend), recipe_precision
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
    """ladder.json, ladder.md and ladder.png in --out; the profiles and the Markdown table printed last."""
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ladder.json").write_text(json.dumps(report, indent=2) + "\n")
    profiles = profile_markdown(rows)
    (args.out / "ladder.md").write_text(markdown + ("\n" + profiles if profiles else ""))
    plot(rows, f"{args.preset} B{args.micro_batch_size}, {device_name(device)}", args.out / "ladder.png")
    print(f"wrote {args.out / 'ladder.json'}, {args.out / 'ladder.md'}, {args.out / 'ladder.png'}\n")
    if profiles:
        print(profiles)
    print(markdown, end="")


if __name__ == "__main__":
    main()
