"""Preemption: SIGTERM/SIGINT become a flag the loop checks between optimizer steps, so it saves and exits 0."""

from __future__ import annotations

import ctypes
import math
import os
import signal
import sys
from types import FrameType

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# accelerate >= 1.16's one-process launcher, itself given Ctrl-C or SIGTERM, passes a SIGTERM on to the run and kills
# it this many seconds later, whatever the orchestrator's grace period
ACCELERATE_KILL_S = 5
TORCHRUN_KILL_S = 30  # torchrun's wait before it SIGKILLs its workers, fixed before torch 2.12


def stop_with_the_launcher() -> None:
    """Turn the launcher's death into a SIGTERM to this process (Linux; elsewhere a no-op).

    docker stop, Kubernetes, systemd and timeout signal the main PID only: the launcher. accelerate's single-process
    launcher dies of SIGTERM without passing it on, and its child would train on, orphaned, until SIGKILL; torchrun
    forwards it, but its own death (SIGKILL) would orphan the workers the same way. Only under a launcher: a run
    started straight from a shell (nohup, tmux) must outlive that shell."""
    if sys.platform != "linux" or not {"ACCELERATE_USE_CPU", "TORCHELASTIC_RUN_ID"} & os.environ.keys():
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


SHELLS = {"sh", "dash", "bash", "ash", "zsh", "ksh"}


def pid1_drops_sigterm_line() -> str | None:
    """A warning where PID 1 of this PID namespace is a shell that does not catch SIGTERM: a container's command in
    shell form (`CMD accelerate launch ...`, `command: [sh, -c, ...]`). docker stop and Kubernetes signal PID 1
    alone, and the kernel drops a signal for a PID 1 that has no handler for it, so the run would train on until
    the SIGKILL that ends the grace period, losing the steps since its last checkpoint. None elsewhere (Linux only;
    PID 1 is this process, a launcher or an init that passes the signal on, or cannot be read)."""
    if sys.platform != "linux" or os.getpid() == 1:
        return None
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open("/proc/1/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return None
    name = os.path.basename(argv[0].decode(errors="replace")).lstrip("-")  # "-bash": a login shell
    if name not in SHELLS or caught >> (signal.SIGTERM - 1) & 1:
        return None
    return (
        f"warning: PID 1 here is {name}, which does not pass a SIGTERM on: `docker stop` or a Kubernetes pod deletion "
        "would not reach this run, which would be killed without saving once the grace period ends. Start the run as "
        'the container\'s command in exec form (`CMD ["accelerate", "launch", ...]`), or put `exec` before it in '
        "the shell command (`sh -c 'cd /app && exec accelerate launch ...'`)"
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM during the start-up: the run stops at once, as at a Ctrl-C there (no step to finish, nothing to save),
    with one line, where the signal's default action ended the process without a word."""


def stop_at_once_on_sigterm() -> None:
    """Until the train loop takes signals over (StopRequest), SIGTERM raises Terminated where the process is."""

    def handle(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, handle)


def ignore_further_stops() -> None:
    """The process is ending (its last line printed or about to be): a signal now, such as the SIGTERM accelerate
    1.16's launcher sends after passing on a Ctrl-C, would raise inside the exit (a traceback after that line, or
    instead of it) where it should change nothing."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)


class StopRequest:
    """Set by SIGTERM or the first Ctrl-C; a second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.then = "finishing this step, then saving a checkpoint"  # what a stop requested now does
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self and signum == signal.SIGTERM:  # already stopping (accelerate 1.16 passes a Ctrl-C on as SIGTERM)
            return
        self.signal_name = signal.Signals(signum).name
        if os.environ.get("RANK", "0") == "0":  # every rank gets it; one says so (above a terminal's progress bar)
            print(f"{self.signal_name} received: {self.then}", flush=True)


def grace_period_line(save_s: float, step_s: float) -> str:
    """What an orchestrator must wait between SIGTERM and SIGKILL, from this launch's first checkpoint save: the
    step in flight, then a save, twice over for slower disks and a busier machine."""
    grace = math.ceil(2 * (save_s + step_s)) + 5
    line = (
        f"checkpoint saved in {save_s:.1f} s (a step takes {step_s:.1f} s): a stop (SIGTERM) finishes the step and "
        f"saves, so set your grace period above {grace} s before SIGKILL (docker stop -t, Kubernetes "
        "terminationGracePeriodSeconds, SLURM's GraceTime and KillWait)"
    )
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun SIGKILLs its workers a while after passing the signal on
        line += _torchrun_clause(grace)
    elif 2 * (save_s + step_s) > ACCELERATE_KILL_S and _under_accelerates_one_process_launcher():
        line += (
            f"; but accelerate's one-process launcher, signalled itself, kills the run {ACCELERATE_KILL_S} s after "
            f"passing the signal on: signal this process (pid {os.getpid()}) instead"
        )
    return line


def _torchrun_clause(grace: int) -> str:
    """What torchrun needs beyond the grace period: nothing where it waits that long for its workers."""
    if torchrun_reads_shutdown_timeout():
        shutdown = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_KILL_S))  # torch's default too
        return f" and TORCH_ELASTIC_SHUTDOWN_TIMEOUT above {grace} (now {shutdown})" if grace > shutdown else ""
    if grace <= TORCHRUN_KILL_S:
        return ""
    from torch import __version__

    return (
        f"; but torchrun in torch {__version__} kills the run {TORCHRUN_KILL_S} s after passing the signal on, a wait "
        f"torch >= 2.12 reads from TORCH_ELASTIC_SHUTDOWN_TIMEOUT: upgrade torch and set it above {grace}, or signal "
        "the run's processes instead of the launcher"
    )


def torchrun_reads_shutdown_timeout() -> bool:
    """Whether this torch's torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds for its workers after passing on a
    SIGTERM (torch >= 2.12, its LaunchConfig.shutdown_timeout); before, a fixed TORCHRUN_KILL_S."""
    from torch.distributed.launcher.api import LaunchConfig

    return "shutdown_timeout" in LaunchConfig.__dataclass_fields__


def one_process_launcher() -> bool:
    """Whether this process was started by `accelerate launch`'s one-process launcher: it sets ACCELERATE_USE_CPU,
    and the ranks torchrun starts (accelerate's multi-process launcher) have TORCHELASTIC_RUN_ID."""
    return "ACCELERATE_USE_CPU" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ


def _under_accelerates_one_process_launcher() -> bool:
    """Started by accelerate's one-process launcher, from accelerate 1.16 on."""
    if not one_process_launcher():
        return False
    from accelerate.utils import compare_versions

    return compare_versions("accelerate", ">=", "1.16.0")
