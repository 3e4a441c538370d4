"""Where a model runs when nothing says otherwise: CUDA, else the Apple GPU (MPS) for a single process, else the CPU;
and how the run logs, model cards and benchmarks name that device.

One rule for training (training.distributed.build_accelerator) and evals, as accelerate itself picks a device,
except that 2+ processes without CUDA run on the CPU over gloo: MPS has no collective backend.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def needs_cpu(*, cuda: bool, mps: bool, num_processes: int) -> bool:
    """Whether the Accelerator must be told cpu=True: no CUDA, and no Apple GPU that a single process can use."""
    return not cuda and not (mps and num_processes == 1)


def mps_available() -> bool:
    return torch.backends.mps.is_available()


def accelerator_needs_cpu() -> bool:
    """needs_cpu for this machine and launch (`accelerate launch` sets WORLD_SIZE for 2+ processes)."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    return needs_cpu(cuda=torch.cuda.is_available(), mps=mps_available(), num_processes=processes)


def default_device() -> torch.device:
    """The device of a single process: cuda, mps or cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu" if accelerator_needs_cpu() else "mps")


def quiet_deepspeed() -> None:
    """DeepSpeed, imported wherever it is installed (by accelerate, by transformers' save_pretrained, by the ZeRO
    checkpoint reader), picks its accelerator as it loads and, finding no GPU, warns that it could not detect one.
    Told the CPU beforehand (DS_ACCELERATOR, its own variable) it does not; a choice in the environment stays."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


X86 = platform.machine().lower() in ("x86_64", "amd64")  # Linux's name, and Windows'

# The first of these a CPU has says how fast its bf16 matmuls can be (AMX >> AVX-512 bf16 > plain AVX-512 / AVX2).
MATMUL_ISAS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ('vendor_id', 'cpu family', 'model', 'model name', 'flags', ...);
    empty where there is none to read (not Linux). cpuinfo: that file's text (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU as the figures need it named: e.g. 'AMD EPYC (family 25 model 17, avx512_bf16)'. VMs often report a
    bare model name, which the family, model and best matmul ISA tell apart (Zen 3 / 4 / 5, Xeon with or without
    AMX); an ISA capped by ONEDNN_MAX_CPU_ISA is named too. cpuinfo: /proc/cpuinfo's text (read when None)."""
    fields = cpu_fields(cpuinfo)
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in MATMUL_ISAS if f in flags), None)
    details = [f"family {fields['cpu family']} model {fields['model']}"] if "cpu family" in fields else []
    details += [isa] if isa else []
    if cap := os.environ.get("ONEDNN_MAX_CPU_ISA"):
        details.append(f"capped at {cap}")
    return fields["model name"] + (f" ({', '.join(details)})" if details else "")


def amd_cpu() -> bool:
    """Whether /proc/cpuinfo names AMD as the CPU's vendor (False where there is none to read: not Linux)."""
    return cpu_fields().get("vendor_id") == "AuthenticAMD"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU: {cpu_model()}"
