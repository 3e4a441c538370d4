"""What every process that runs the model shares, training and evals alike: its set-up on a CPU, precision names
and the end of a (possibly multi-process) run."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NoReturn

import torch

from modeling.malloc import keep_freed_memory
from modeling.vector_math import warm_up_vector_math

if TYPE_CHECKING:
    from accelerate import Accelerator


def set_up_compute(device: torch.device) -> None:
    """Before a process computes on `device` (its threads set): on the CPU, MKL's vector math warmed up on every
    thread, so that its first step or batch is the one any other process computes, and glibc's malloc keeping
    freed memory, so that the big buffers each step or eval batch allocates afresh are not faulted in every time.
    No-op elsewhere."""
    warm_up_vector_math(device)
    keep_freed_memory(device)


def dtype_name(mixed_precision: str) -> str:
    """The compute dtype of accelerate's mixed_precision value: 'no' is plain fp32."""
    return "fp32" if mixed_precision == "no" else mixed_precision


def _on_gloo() -> bool:
    """Whether this process is in a gloo process group (CPU runs with 2+ processes)."""
    return torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"


def finish(accelerator: Accelerator, status: int = 0) -> None:
    """End the run: accelerator.end_training() (trackers closed, process group destroyed), then exit with `status`
    where it is not 0 or on gloo (exit_process). Call it last."""
    on_gloo = _on_gloo()  # asked before end_training destroys the group
    accelerator.end_training()
    if on_gloo or status:
        exit_process(status, on_gloo=on_gloo)


def exit_process(status: int, on_gloo: bool | None = None) -> NoReturn:
    """Exit with `status`. On gloo (CPU runs with 2+ processes, once the process group has communicated) at once,
    output flushed: gloo's threads can abort the interpreter's teardown ("terminate called without an active
    exception", status 1, then a "Fatal Python error" block after the run's last line; seen in about 1 FSDP run in 5
    after a complete run, and after a refused resume on 2 processes), which would fail a finished job or bury an
    error line. Everything is written by then; skipping the teardown loses nothing. on_gloo None: ask the process
    group."""
    if on_gloo is None:
        on_gloo = _on_gloo()
    sys.stdout.flush()
    sys.stderr.flush()
    if on_gloo:
        os._exit(status)
    sys.exit(status)
