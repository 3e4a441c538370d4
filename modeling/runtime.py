"""What every process that runs the model shares, training and evals alike: its set-up on a CPU, its joining of the
process group, precision names and the end of a (possibly multi-process) run: its exit, and its error line, printed
once."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch

from modeling.malloc import keep_freed_memory
from modeling.vector_math import warm_up_vector_math

if TYPE_CHECKING:
    from accelerate import Accelerator

PRINTED = "printed"  # an extraInfo key of torchelastic's error file: this rank printed its error on the console


def set_up_compute(device: torch.device) -> None:
    """Before a process computes on `device` (its threads set): on the CPU, MKL's vector math warmed up on every
    thread, so that its first step or batch is the one any other process computes, and glibc's malloc keeping
    freed memory, so that the big buffers each step or eval batch allocates afresh are not faulted in every time.
    (A process that compiles also sets up its compiles: training.compile_cache.set_up_compile_cache.)"""
    warm_up_vector_math(device)
    keep_freed_memory(device)


def joined(accelerator: Accelerator) -> Accelerator:
    """`accelerator` once every process has joined its process group (a barrier; nothing with one process), so that
    none stops on bad input while another is still connecting to it: over gloo that one logged a C++ connection error
    ("Connection closed by peer") below the error line."""
    accelerator.wait_for_everyone()
    return accelerator


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


# What gloo's collectives raise when another process of the run is gone (killed, crashed, its machine down)
GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def lost_peer(err: BaseException) -> str | None:
    """How a collective failed because another process of the run went away (gloo's words, or a DistNetworkError's
    first line), or None for any other error."""
    if isinstance(err, torch.distributed.DistNetworkError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return next((words for words in GLOO_PEER_GONE if words in str(err)), None)


def report_error(line: str) -> None:
    """Print `line` once per machine and leave it in this process's torchelastic error file (set by torchrun for
    each rank) for the launcher's summary. Under torchrun the first rank to report prints; without it, rank 0."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    printed = _first_to_report(error_file)
    if printed:
        print(line, file=sys.stderr, flush=True)
    if error_file:  # the format of torch.distributed.elastic's ErrorHandler.record_exception
        info = {"py_callstack": line, "timestamp": str(int(time.time())), PRINTED: str(printed)}
        with open(error_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)


def _first_to_report(error_file: str | None) -> bool:
    """Whether this rank is the first of its machine's to report an error in this attempt: a marker made once in
    the attempt's folder, which torchrun's log layout (`<run_id>/attempt_<n>/<local_rank>/error.json`) gives this
    machine's ranks alone, made afresh at each restart. Rank 0 without torchrun's error file, or where the layout is
    another's."""
    attempt = Path(error_file).parent.parent if error_file else None
    if attempt is None or not attempt.name.startswith("attempt_"):
        return os.environ.get("RANK", "0") == "0"
    try:
        os.close(os.open(attempt / "error-printed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
