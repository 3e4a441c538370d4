"""Throughput, MFU, memory, the metrics.jsonl tracker and the loss-curve plot."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
from accelerate.tracking import GeneralTracker

# Dense peak TFLOP/s per device (vendor datasheets, no sparsity), by name fragment and compute dtype.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 494.5},
    "H100 PCIe": {"bf16": 756.0, "fp32": 378.0},
    "H100": {"bf16": 989.0, "fp32": 494.5},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "L4": {"bf16": 121.0, "fp32": 60.0},
    "A10G": {"bf16": 70.0, "fp32": 35.0},
}


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype, n: int | None = None, seconds: float = 1.0
) -> float:
    """Achieved TFLOP/s of a square matmul: the practical peak where no datasheet figure applies (CPUs), and what a
    GPU really sustains. The best of ten short windows, as other work on a shared machine (or a VM's neighbours) only
    ever slows it down. n defaults to 2048 on CPU and 8192 on GPU (smaller ones leave an H100's SMs idle)."""
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 2048)
    burst = 8 if cuda else 1  # matmuls between GPU syncs: the sync's few µs stay out of the figure
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    best = 0.0
    for _ in range(10):
        iters, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 10:
            for _ in range(burst):
                a @ b
            if cuda:
                torch.cuda.synchronize(device)  # count only finished work
            iters += burst
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - start) / 1e12)
    return best


def peak_tflops(device: torch.device, mixed_precision: str, override: float | None = None) -> tuple[float, str]:
    """Per-device peak TFLOP/s for MFU and where the figure came from."""
    if override is not None:
        return override, "config"
    kind = "bf16" if mixed_precision in ("bf16", "fp16") else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peaks in PEAK_TFLOPS.items():
            if fragment in name:
                return peaks[kind], f"datasheet {fragment} {kind}"
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    return measure_matmul_tflops(device, dtype), f"measured {kind} matmul"


def dtype_name(mixed_precision: str) -> str:
    """The compute dtype of accelerate's mixed_precision value: 'no' is plain fp32."""
    return "fp32" if mixed_precision == "no" else mixed_precision


def precision_name(mixed_precision: str) -> str:
    """accelerate's mixed_precision as the run log says it."""
    return dtype_name(mixed_precision) + ("" if mixed_precision == "no" else " mixed precision")


# A CPU's faster matmul dtype, as the CPU launch YAMLs choose it (mixed_precision 'no' = fp32).
CPU_YAML = {"no": "accelerate_configs/cpu.yaml", "bf16": "accelerate_configs/cpu_bf16.yaml"}
CPU = torch.device("cpu")
FASTER_BY = 1.3  # below this, the measurement noise of a shared machine could decide


def cpu_precision_hint(mixed_precision: str, measured_tflops: float) -> str | None:
    """On CPU, a one-line hint when the other CPU precision's matmuls are clearly faster than those of the launch
    YAML's (measured_tflops, from peak_tflops): bf16 is 2-4x fp32 on AMX or Zen 4/5 cores, but slower than fp32 on
    AVX-512-bf16-only Xeons and most laptops. None when the YAML's choice is right (or not a CPU one)."""
    if mixed_precision not in CPU_YAML:
        return None
    (other,) = set(CPU_YAML) - {mixed_precision}
    return precision_advice(mixed_precision, {mixed_precision: measured_tflops, other: peak_tflops(CPU, other)[0]})


def precision_advice(mixed_precision: str, tflops: dict[str, float]) -> str | None:
    """cpu_precision_hint's verdict from matmul TFLOP/s by mixed_precision value ('no', 'bf16')."""
    (other,) = set(CPU_YAML) - {mixed_precision}
    if tflops[other] < FASTER_BY * tflops[mixed_precision]:
        return None
    name, other_name = dtype_name(mixed_precision), dtype_name(other)
    return (
        f"hint: this CPU multiplies {other_name} matrices at {tflops[other]:.2f} TFLOP/s but {name} "
        f"at {tflops[mixed_precision]:.2f}: launching with {CPU_YAML[other]} ({other_name}) should train "
        f"up to {tflops[other] / tflops[mixed_precision]:.1f}x faster"
    )


def memory_stats(device: torch.device) -> dict[str, float]:
    """GiB: CUDA peak allocated/reserved, or the process's peak resident memory on CPU."""
    gib = 2**30
    if device.type == "cuda":
        return {
            "mem_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        }
    return {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}


class JSONLTracker(GeneralTracker):
    """An accelerate tracker that appends one JSON object per `accelerator.log` call to metrics.jsonl."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_dir: str | Path) -> None:
        super().__init__()
        self.path = Path(run_dir) / "metrics.jsonl"

    @property
    def tracker(self) -> Path:
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        """The run config is written to config.yaml by the trainer; nothing to add here."""

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    """metrics.jsonl rows; when a resumed run logged a step again, the later row wins."""
    rows: dict[tuple[int | None, frozenset], dict] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        rows[(row.get("step"), frozenset(row))] = row
    return sorted(rows.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


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
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return Path(out_png)
