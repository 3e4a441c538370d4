"""Throughput, MFU, memory, the run's trackers (metrics.jsonl, TensorBoard, W&B) and the loss-curve plot."""

from __future__ import annotations

import json
import re
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.tracking import (
    GeneralTracker,
    TensorBoardTracker,
    WandBTracker,
    get_available_trackers,
    on_main_process,
)
from accelerate.utils import LoggerType

from data_prep.manifest import MANIFEST_NAME
from evals.plot import save_png
from modeling.cpu_linear import cpu_matmul_speeds, emulated_bf16, matmul
from modeling.disk import append_bytes, disk_full_reported
from modeling.runs import METRICS_FILE, read_metrics
from modeling.runtime import dtype_name
from training.compile_cache import EAGER_YAML, cpp_compiler
from training.config import ConfigError

# Dense peak TFLOP/s per GPU product (vendor datasheets, no sparsity): bf16 (fp16 runs at the same rate), tf32
# (what fp32 matmuls run as while TF32 is allowed) and fp32 (CUDA cores, TF32 off).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H200 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
}
# torch.cuda.get_device_name() -> PEAK_TFLOPS product, first match wins: the variants before the plain name (an
# H100 without NVL/PCIe in its name, e.g. "NVIDIA H100 80GB HBM3", is the SXM part), whole words only (L4 is
# not L40S, A10 is not A100).
GPU_PRODUCTS: tuple[tuple[str, str], ...] = (
    (r"\bH100\b.*\bNVL\b", "H100 NVL"),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b", "H100 SXM"),
    (r"\bH200\b.*\bNVL\b", "H200 NVL"),
    (r"\bH200\b", "H200 SXM"),
    (r"\bA100\b", "A100"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"\bA10\b", "A10"),
)


def gpu_product(name: str) -> str | None:
    """The PEAK_TFLOPS product of a CUDA device name, or None when the table has no datasheet figure for it."""
    return next((product for pattern, product in GPU_PRODUCTS if re.search(pattern, name, re.IGNORECASE)), None)


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype, n: int | None = None, seconds: float = 0.5
) -> float:
    """Achieved TFLOP/s of a square matmul, within about `seconds` whatever the hardware: the practical peak where
    no datasheet figure applies (CPUs, unknown GPUs). The best of several short windows, as other work on a shared
    machine (or a VM's neighbours) only ever slows it down.

    On GPU, n defaults to 8192 (smaller ones leave an H100's SMs idle), timed in synced bursts of 8. On CPU, one
    thread's rate times the threads torch uses (the peak of perfect scaling): a threaded matmul waits at every
    barrier for threads other jobs have descheduled, which distorts fp32 (threaded) more than emulated bf16 and
    so the hint's comparison. n defaults to the largest size up to 2048 that fits the budget (_grow_cpu_matmul).
    fp32 takes the kernels the model's linears use (oneDNN's on AMD CPUs with AVX-512: modeling.cpu_linear)."""
    if device.type != "cpu":
        return _best_tflops(device, dtype, n or 8192, seconds)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threads * _best_tflops(device, dtype, n, seconds)
    finally:
        torch.set_num_threads(threads)


def _best_tflops(device: torch.device, dtype: torch.dtype, n: int | None, seconds: float) -> float:
    """measure_matmul_tflops on the current threads; n None: grown on CPU."""
    cuda = device.type == "cuda"
    deadline = time.perf_counter() + seconds
    best = 0.0
    if n is None:
        n, best = _grow_cpu_matmul(dtype, seconds)
    burst = 8 if cuda else 1  # matmuls between GPU syncs: the sync's few µs stay out of the figure
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    matmul(a, b)  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    window = (deadline - time.perf_counter()) / 5
    for _ in range(5):
        if time.perf_counter() >= deadline and best:
            break
        iters, start = 0, time.perf_counter()
        while not iters or time.perf_counter() - start < window:  # at least one burst per window
            for _ in range(burst):
                matmul(a, b)
            if cuda:
                torch.cuda.synchronize(device)  # count only finished work
            iters += burst
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def _grow_cpu_matmul(dtype: torch.dtype, seconds: float) -> tuple[int, float]:
    """The CPU matmul size to time within `seconds`, and the best TFLOP/s seen on the way there: n starts at 128
    and doubles up to 2048 while the next size (8x the work) is predicted to take under a tenth of the budget, as a
    CPU without native kernels for dtype (bf16 on AVX2-only cores) is 30-300x slower than one with them."""
    n, t = 128, _time_one_matmul(dtype, 128)
    best = 2 * n**3 / t
    while n < 2048 and 8 * t < seconds / 10:
        n *= 2
        t = _time_one_matmul(dtype, n)
        best = max(best, 2 * n**3 / t)
    return n, best / 1e12


def _time_one_matmul(dtype: torch.dtype, n: int) -> float:
    """Seconds of one n x n CPU matmul, after a warm-up call (oneDNN builds its kernel on the first)."""
    a = torch.randn(n, n, dtype=dtype)
    matmul(a, a)
    start = time.perf_counter()
    matmul(a, a)
    return time.perf_counter() - start


def cpu_matmul_tflops_at_once(
    dtype: torch.dtype, threads: int, n: int = 512, seconds: float = 1.0
) -> tuple[float, float]:
    """(one thread's TFLOP/s, `threads` threads' together) of n x n CPU matmuls, each thread multiplying matrices of
    its own at the same time as the others, with no barrier between their matmuls; the best of three windows each,
    alternating. measure_matmul_tflops counts the first times the threads as the peak; the second falls short of
    that where the threads share one core's matmul units (two hyperthreads: a VM's vCPUs may be, whatever the
    topology it shows) or its memory bandwidth. Sustained rates, so other work on the cores lowers them: compare
    on a quiet machine (BENCHMARKS.md has a busy VM's figure beside a quiet one's)."""

    def window(count: int) -> float:
        operands = [(torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)) for _ in range(count)]
        for a, b in operands:
            matmul(a, b)  # warm-up (oneDNN builds its kernel on the first), here: a failure is the caller's
        done = [0] * count
        ready = threading.Barrier(count + 1)

        def work(i: int) -> None:
            torch.set_num_threads(1)  # this thread's OpenMP team too: a new thread's is OMP_NUM_THREADS
            a, b = operands[i]
            ready.wait()
            end = time.perf_counter() + seconds / 6
            while not done[i] or time.perf_counter() < end:
                matmul(a, b)
                done[i] += 1

        workers = [threading.Thread(target=work, args=(i,)) for i in range(count)]
        for worker in workers:
            worker.start()
        ready.wait()
        start = time.perf_counter()
        for worker in workers:
            worker.join()
        return 2 * n**3 * sum(done) / (time.perf_counter() - start) / 1e12

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the warm-ups too
    try:
        rounds = [(window(1), window(threads)) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    return max(one for one, _ in rounds), max(together for _, together in rounds)


def cuda_matmul_kind(mixed_precision: str) -> str:
    """The tensor-core rate a CUDA run's matmuls get: bf16 (or fp16) autocast, else fp32 as TF32 when allowed."""
    if mixed_precision in ("bf16", "fp16"):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _kind_label(kind: str) -> str:
    return f"{kind} (fp32 matmuls run as TF32)" if kind == "tf32" else kind


def datasheet_peak(device_name: str, kind: str) -> tuple[float, str] | None:
    """(TFLOP/s, source) for a CUDA device name and cuda_matmul_kind, or None for a product not in PEAK_TFLOPS."""
    product = gpu_product(device_name)
    if product is None:
        return None
    return PEAK_TFLOPS[product][kind], f"datasheet {product} dense {_kind_label(kind)}"


def peak_tflops(device: torch.device, mixed_precision: str, override: float | None = None) -> tuple[float, str]:
    """Per-device peak TFLOP/s for MFU and where the figure came from, naming the matmul dtype it is for: on CUDA
    the exact product's datasheet figure (fp32 runs are judged against the TF32 peak only while TF32 is allowed,
    and the source says so), else a measured matmul of the run's dtype."""
    if override is not None:
        return override, "config"
    if device.type == "cuda":
        kind = cuda_matmul_kind(mixed_precision)
        name = torch.cuda.get_device_name(device)
        datasheet = datasheet_peak(name, kind)
        if datasheet is not None:
            return datasheet
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        return measure_matmul_tflops(device, dtype), f"measured {_kind_label(kind)} matmul ({name}: no datasheet entry)"
    kind = "bf16" if mixed_precision in ("bf16", "fp16") else "fp32"
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    threads = f" (1 thread × {torch.get_num_threads()})" if device.type == "cpu" else ""
    return measure_matmul_tflops(device, dtype), f"measured {kind} matmul{threads}"


# A run's start-up, phase by phase in the order they run: the metrics.jsonl key's middle -> the words on screen.
STARTUP_PHASES = {
    "imports": "python + imports",
    "config": "config",
    "accelerator": "accelerator",
    "data": "data",
    "model": "model",
    "prepare": "prepare",
    "resume": "resume",
    "outputs_check": "outputs check",
    "probes": "probes",
    "step0_eval": "step-0 eval",
    "first_step": "first step",  # "+ compile" added where torch.compile runs (startup_line)
}


class StartupClock:
    """Where the time from the process's start to the end of its first optimizer step went: lap(phase) counts the
    time since the last lap (or mark) as that phase's (STARTUP_PHASES); the time after a mark() and before the next
    lap is "other". The process's start comes from the OS, so the interpreter's start and the imports count too."""

    def __init__(self) -> None:
        import psutil  # accelerate's own dependency

        now = time.perf_counter()
        self.started = now - max(0.0, time.time() - psutil.Process().create_time())
        self.seconds = {"imports": now - self.started}
        self._mark = now

    def mark(self) -> None:
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    def row(self) -> dict[str, float]:
        """metrics.jsonl's start-up row, as of now: time_to_first_step_s and startup_<phase>_s for each phase timed,
        then startup_other_s (the rest)."""
        total = time.perf_counter() - self.started
        row = {"time_to_first_step_s": total}
        row |= {f"startup_{phase}_s": self.seconds[phase] for phase in STARTUP_PHASES if phase in self.seconds}
        row["startup_other_s"] = total - sum(self.seconds.values())
        return row


def startup_line(row: dict[str, float], compiled: bool) -> str:
    """The start-up row on one line: `start-up: 12.3 s to the first step (python + imports 2.1, ..., other 0.1)`;
    `compiled`: torch.compile runs in the first step, which is then named "first step + compile"."""
    words = STARTUP_PHASES | ({"first_step": "first step + compile"} if compiled else {})
    timed = [(words, row.get(f"startup_{phase}_s")) for phase, words in words.items()]
    timed = [(words, seconds) for words, seconds in timed if seconds is not None] + [("other", row["startup_other_s"])]
    parts = ", ".join(f"{words} {seconds:.1f}" for words, seconds in timed)
    return f"start-up: {row['time_to_first_step_s']:.1f} s to the first step ({parts})"


def precision_name(mixed_precision: str) -> str:
    """accelerate's mixed_precision as the run log says it."""
    return dtype_name(mixed_precision) + ("" if mixed_precision == "no" else " mixed precision")


# A CPU's faster matmul dtype, as the CPU launch YAMLs choose it (mixed_precision 'no' = fp32).
CPU_YAML = {"no": "accelerate_configs/cpu.yaml", "bf16": "accelerate_configs/cpu_bf16.yaml"}
# fp32's several-process CPU launch YAML: it compiles nothing, so it runs wherever a launch YAML does
CPU_DDP_YAML = "accelerate_configs/cpu_ddp2.yaml"
FASTER_BY = 1.3  # below this, the measurement noise of a shared machine could decide


def runnable_cpu_yamls() -> dict[str, str]:
    """The one-process CPU launch YAML of each precision that runs here, by mixed_precision value: CPU_YAML's, which
    compile, where a C++ compiler works; else fp32's that does not compile (there is no bf16 one)."""
    return CPU_YAML if cpp_compiler() is not None else {"no": EAGER_YAML}


def cpu_precision_hint(mixed_precision: str) -> str | None:
    """On CPU, a one-line hint when the other CPU precision's matmuls are clearly faster than those of the launch
    YAML's: bf16 is 2-4x fp32 on AMX or Zen 4/5 cores, ~0.5x on AVX-512-bf16 Xeons and ~1/100 on AVX2-only cores
    (no native bf16). None when the YAML's choice is right (or not a CPU one), or where no YAML of the other
    precision runs here (bf16 without a C++ compiler). Measures both (~1 s)."""
    if mixed_precision not in CPU_YAML:
        return None
    (other,) = set(CPU_YAML) - {mixed_precision}
    yamls = runnable_cpu_yamls()
    if other not in yamls:
        return None
    return precision_advice(mixed_precision, cpu_matmul_speeds(), yamls)


def precision_advice(mixed_precision: str, tflops: dict[str, float], yamls: dict[str, str] = CPU_YAML) -> str | None:
    """cpu_precision_hint's verdict, one line, from matmul TFLOP/s by mixed_precision value ('no', 'bf16'), naming
    the other precision's YAML in yamls."""
    (other,) = set(CPU_YAML) - {mixed_precision}
    if tflops[other] < FASTER_BY * tflops[mixed_precision]:
        return None
    name, other_name = dtype_name(mixed_precision), dtype_name(other)
    speeds = f"{other_name} {tflops[other] * 1e3:.3g} GFLOP/s, {name} {tflops[mixed_precision] * 1e3:.3g} GFLOP/s"
    ratio = tflops[other] / tflops[mixed_precision]
    # said as the YAML's setting, with examples: the launch may be the user's own, or one of several processes
    examples = f"{yamls[other]} for one process" + (f", {CPU_DDP_YAML} for two" if other == "no" else "")
    # the launch's precision may be its YAML's or accelerate launch's flag, which overrides the YAML's: both said
    flag = (
        f"or pass --mixed_precision {other} to accelerate launch (a --mixed_precision given there overrides the YAML's)"
    )
    if mixed_precision == "bf16" and (emulated := emulated_bf16(tflops)):
        return (
            f"warning: {emulated}; set mixed_precision: '{other}' (fp32) in the launch YAML instead ({examples}), "
            f"{flag}"
        )
    return (
        f"hint: this CPU multiplies {other_name} matrices {ratio:.1f}x faster than {name} ({speeds}): "
        f"mixed_precision: '{other}' in the launch YAML ({examples}), {flag}, should train "
        "faster (a step gains less than its matmuls)"
    )


def gpu_precision_hint(mixed_precision: str, bf16_supported: bool, gpu_name: str) -> str | None:
    """A one-line warning when a bf16 launch YAML meets a GPU without bf16 (T4, V100 and older: emulated or
    unsupported), naming the fp16 YAML; None otherwise."""
    if mixed_precision != "bf16" or bf16_supported:
        return None
    return (
        f"warning: this GPU ({gpu_name}) has no native bf16; launch with accelerate_configs/1xgpu_fp16.yaml "
        "(fp16 autocast with loss scaling; for several GPUs set mixed_precision: fp16 in your YAML)"
    )


def memory_stats(device: torch.device) -> dict[str, float]:
    """GiB: CUDA peak allocated/reserved, or the process's peak resident memory on CPU."""
    gib = 2**30
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        }
    peak = peak_rss_bytes()
    return {} if peak is None else {"mem_rss_peak_gib": peak / gib}


def rss_bytes(ru_maxrss: int, platform: str) -> int:
    """getrusage()'s ru_maxrss in bytes: macOS counts bytes, Linux and the BSDs KiB."""
    return ru_maxrss if platform == "darwin" else ru_maxrss * 1024


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory: getrusage() on POSIX, psutil's peak working set on Windows (which has
    no `resource` module); None where neither says."""
    try:
        import resource
    except ImportError:
        import psutil  # accelerate's own dependency

        return getattr(psutil.Process().memory_info(), "peak_wset", None)
    return rss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, sys.platform)


# pip's name for each tracker accelerate can log to, where it differs from accelerate's name for it
TRACKER_PACKAGES = {"comet_ml": "comet-ml"}


def check_trackers(names: list[str]) -> None:
    """Raise a ConfigError for a --trackers name accelerate does not know, or whose package is not installed here:
    accelerate itself drops such a tracker with a log line that is not shown, and the run would then log to
    metrics.jsonl alone."""
    known = [t.value for t in LoggerType]  # "all": every tracker installed here
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    for name in names:
        if name not in known:
            raise ConfigError(f"--trackers {name}: accelerate has no such tracker; it has {', '.join(known)}")
        if name != "all" and name not in available:
            raise ConfigError(
                f"--trackers {name}: {name} is not installed here: `pip install {TRACKER_PACKAGES.get(name, name)}`, "
                "or leave it out (metrics.jsonl and loss.png are written either way)"
            )


# What metrics.jsonl's launch row keeps of a launch's run info (training.loop.log_run_info): where it computed, how,
# with what micro-batch, the data folder as an absolute path (the card finds the manifest from any working folder),
# and the val windows its val loss is the mean over, with their tokens (what the card says the loss measured)
LAUNCH_KEYS = (
    "world_size", "device", "mixed_precision", "dynamo_backend", "micro_batch_size", "data_path", "val_windows",
    "val_tokens", "planned_steps",
)  # fmt: skip
# And what the launch trained with of the run config that a resume may change and the card describes (its optimizer,
# lr schedule and batch rows): a resume that lowered the lr after a loss spike trained its steps at the new lr only
RECIPE_KEYS = (
    "optimizer", "lr", "beta1", "beta2", "weight_decay", "muon_lr", "muon_momentum", "lr_schedule", "warmup_steps",
    "decay_fraction", "decay_steps", "min_lr_ratio", "total_batch_tokens",
)  # fmt: skip
# What the model card says of the data, from its manifest.json: the sources with their licenses, the splits' sizes
CARD_DATA_KEYS = ("source", "sources", "splits")


def data_for_the_card(data_path: str | Path) -> dict | None:
    """The manifest's CARD_DATA_KEYS as this launch found them (None: no manifest there). Kept in its launch row: the
    card is written at the run's end, or later by `python -m training.hub`, when the data folder may be gone (scratch
    storage wiped) or prepared anew, and must describe what the run trained on."""
    path = Path(data_path) / MANIFEST_NAME
    if not path.is_file():
        return None
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {k: raw[k] for k in CARD_DATA_KEYS if k in raw}


class JSONLTracker(GeneralTracker):
    """An accelerate tracker that appends one JSON object per `accelerator.log` call to metrics.jsonl."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.path = Path(run_dir) / METRICS_FILE

    @property
    def tracker(self) -> Path:
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        """The run config is written to config.yaml by the trainer; this launch's hardware and precision (which the
        launch YAML, not the config, chose, and which a resume may change) go in a row at the step it starts from,
        for the model card."""
        launch = {k: values[k] for k in LAUNCH_KEYS} | {"data": data_for_the_card(values["data_path"])}
        if "lr" in values:  # a training launch's run info (which leaves out None fields: decay_steps unset)
            launch["recipe"] = {k: values.get(k) for k in RECIPE_KEYS}
        if values.get("new_data"):  # a resume that went on from the start of other data (--on-new-data continue)
            launch["new_data"] = values["new_data"]
        if values.get("rewarmed_from") is not None:  # a resume that took a decayed lr back up, as fractions of the peak
            launch["rewarmed"] = [values["rewarmed_from"], values["rewarmed_to"]]
        self.log({"launch": launch}, step=values["start_step"])

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = f"{self.path.name} keeps every complete row, the checkpoints are untouched"
        with disk_full_reported(self.path, kept):
            append_bytes(self.path, (json.dumps({"step": step, **values}) + "\n").encode())


class RunTensorBoardTracker(TensorBoardTracker):
    """accelerate's TensorBoard tracker, with the run's event files in the run folder itself, so that `tensorboard
    --logdir runs/` lists each run by its folder's name, as one run however often it is resumed (accelerate's writes
    into a `<project>/` subfolder, and each launch's hyperparameters into a run of their own)."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(run_name="", logging_dir=run_dir)

    def start(self) -> None:
        """Nothing yet: the writer opens in store_init_configuration, which knows the step this launch starts from."""

    @on_main_process
    def store_init_configuration(self, values: dict) -> None:
        """Open the writer and log the run's config as its hyperparameters, in the run itself: the HPARAMS tab then
        sets each run's config beside its losses. A launch that continues after step N hides whatever an earlier one
        logged after N (a kill between checkpoints), as metrics.jsonl drops those rows: one curve, no step twice."""
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ModuleNotFoundError:  # accelerate's fallback
            from tensorboardX import SummaryWriter
            from tensorboardX.summary import hparams

        self.logging_dir = str(self.logging_dir_param)
        self.writer = SummaryWriter(self.logging_dir, purge_step=values["start_step"] + 1, **self.init_kwargs)
        # TensorBoard takes numbers, strings and booleans; anything else as its text
        scalars = {k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()}
        for summary in hparams(scalars, metric_dict=dict.fromkeys(("train_loss", "val_loss"), 0.0)):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()


class RunWandBTracker(WandBTracker):
    """accelerate's W&B tracker (project "bookgpt"), with the run named after its folder, its files in the folder's
    wandb/ (beside metrics.jsonl, not in the working folder), and one W&B run per run folder: a resumed launch
    continues it, a fresh start in the folder (which sets wandb/ aside with the rest of the run) begins another."""

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__(run_name="bookgpt")
        self.run_dir = Path(run_dir)

    @on_main_process
    def start(self) -> None:
        import wandb

        folder = self.run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "bookgpt-run-id"
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(4))  # W&B's own ids: 8 lowercase letters and digits
        self.run = wandb.init(
            project=self.run_name, name=self.run_dir.resolve().name, dir=self.run_dir,
            id=id_file.read_text().strip(), resume="allow", **self.init_kwargs,
        )  # fmt: skip

    @on_main_process
    def finish(self, exit_code: int = 0) -> None:
        """Close the W&B run: W&B shows it as failed where exit_code is not 0, as finished otherwise."""
        self.run.finish(exit_code=exit_code)


def run_trackers(names: list[str], run_dir: Path) -> list[GeneralTracker | str]:
    """The trackers a run logs to: metrics.jsonl, then the checked --trackers names ("all": every one installed
    here), TensorBoard's and W&B's writing into the run folder."""
    if "all" in names:
        names = [str(getattr(t, "value", t)) for t in get_available_trackers()]
    ours = {"tensorboard": RunTensorBoardTracker, "wandb": RunWandBTracker}
    return [JSONLTracker(run_dir), *(ours[n](run_dir) if n in ours else n for n in dict.fromkeys(names))]


def close_trackers(accelerator: Accelerator, failed: bool = False) -> None:
    """Finish the run's trackers now, before its last line: W&B prints its summary as it finishes, which would
    otherwise follow an error's one line or a stop's. A failed run (an error stopped it) closes its W&B run as
    failed, not finished. accelerator.end_training() finishing them again does nothing."""
    for tracker in accelerator.trackers:
        if isinstance(tracker, RunWandBTracker):
            tracker.finish(exit_code=1 if failed else 0)
        else:
            tracker.finish()


def plot_losses(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Train and val loss against optimizer step, as a PNG beside the metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("train_loss", "-"), ("val_loss", "o-")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), style, label=key.replace("_", " "))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, out_png)
    return Path(out_png)
