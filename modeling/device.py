"""Where a model runs when nothing says otherwise: CUDA, else the Apple GPU (MPS) for a single process, else the CPU.

One rule for training (training.distributed.build_accelerator) and evals, as accelerate itself picks a device,
except that 2+ processes without CUDA run on the CPU over gloo: MPS has no collective backend.
"""

from __future__ import annotations

import os

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
