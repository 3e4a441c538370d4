"""The last word of a launch: one `error:` line that says what was wrong and what to do, printed once.

A run reports its error through `modeling.runtime.report_error`: the first of a machine's ranks to report prints it
(every rank of a launch gets the same bad input, so one copy is enough; the first, because torchrun stops the others
as soon as one fails, rank 0 too), and every rank writes it into torchelastic's error file, which torchrun
(accelerate's multi-process launcher) reads back: its failure summary then quotes our line instead of a link to its
docs.

`accelerate launch` still ends a failed multi-process run with torchrun's ChildFailedError traceback (and a
SIGTERM'd one with SignalException's): it raises them in the launcher process, where the run cannot reach. This
module is `accelerate launch` with the same arguments, in process, minus those tracebacks:

    python -m training.launch --config_file accelerate_configs/4xa100.yaml train_accel.py --out-dir runs/x

It exits with the run's status, prints the root cause's `error:` line when rank 0 did not print it already (a
failure on another rank first, a crash), and after a SIGTERM lets the run's own last line (the checkpoint it saved)
stand. What accelerate's launcher itself refuses (a config file not found, FP8 without its library) is one
`error:` line too. `-q` also silences torchrun's per-process log lines.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import yaml

# How long torchrun's rendezvous waits for every machine by default, and its --rdzv_conf key, by --rdzv_backend
RENDEZVOUS_WAIT_S = 600
RENDEZVOUS_WAIT_KEYS = {"static": "timeout", "c10d": "join_timeout"}


def _root_cause_line(err: Exception) -> str | None:
    """The line to print for torchrun's ChildFailedError: one naming a rank a signal killed (it printed nothing, and
    the others' lost connection followed from it), else None when a rank printed its error already, else the first
    `error:` line a rank reported (from its error file), or one that names the first failed rank and how it ended."""
    from modeling.runtime import PRINTED  # here: this launcher imports torch only once its C++ logging is quieted

    # A rank a signal killed printed nothing, and the others' lost connection followed from it. Killed first only:
    # torchrun also lists the ranks it stopped after the first failure (SIGTERM, in the same second where they had no
    # handler yet; SIGKILL 30 s on where one hangs, as in a collective with a dead rank), never the cause.
    first = min(f.timestamp for f in err.failures.values())
    killed = [
        (rank, f.signal_name())
        for rank, f in sorted(err.failures.items())
        if f.exitcode < 0 and f.timestamp == first and f.signal_name() != "SIGTERM"
    ]
    if killed:
        rank, name = killed[0]
        oom = " (the kernel's out-of-memory killer sends SIGKILL: see `dmesg`)" if name == "SIGKILL" else ""
        return (
            f"error: rank {rank} was killed by {name} and printed nothing{oom}; the same command continues from the "
            "newest checkpoint"
        )
    failures = err.failures.values()
    if any(isinstance(f.message, dict) and f.message.get("extraInfo", {}).get(PRINTED) == "True" for f in failures):
        return None
    ours = [(f.timestamp, rank, f) for rank, f in err.failures.items() if str(_message(f)).startswith("error: ")]
    if ours:  # before the others' (a peer's lost connection in the same second): the cause, said as the run said it
        return str(_message(min(ours, key=lambda o: o[:2])[2]))
    rank, failure = err.get_first_failure()
    if isinstance(failure.message, dict):  # an uncaught exception's (torchelastic's record decorator)
        return f"error: rank {rank} failed: {_message(failure)}"
    return (
        f"error: rank {rank} ended with exit status {failure.exitcode} ({failure.message}); its output above says why"
    )


def _message(failure: Any) -> object:
    """A failed rank's error-file message (ours, or torchelastic's record decorator's); None without one."""
    return failure.message.get("message") if isinstance(failure.message, dict) else None


@dataclass(frozen=True)
class Machines:
    """Where a launch on several machines meets: the YAML's values, each overridden by its flag if given."""

    rank: int
    count: int
    address: str
    wait_key: str  # the rendezvous's name for how long it waits for every machine (--rdzv_conf KEY=SECONDS)
    wait_s: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Machines | None:
        """None for a launch on one machine, or where accelerate will report the YAML itself, or for a rendezvous
        other than torchrun's static and c10d ones (--rdzv_backend; accelerate 1.15 reads it from the flag alone)."""
        from accelerate.commands.config.config_args import load_config_from_file

        wait_key = RENDEZVOUS_WAIT_KEYS.get(args.rdzv_backend)
        if wait_key is None:
            return None
        try:
            config = load_config_from_file(args.config_file)
        except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
            return None  # launch_command reports it (main)
        count = args.num_machines or getattr(config, "num_machines", 1)
        if count <= 1:
            return None
        ip = args.main_process_ip or getattr(config, "main_process_ip", None)
        port = args.main_process_port or getattr(config, "main_process_port", None) or 29500
        rdzv = dict(kv.split("=", 1) for kv in (args.rdzv_conf or "").split(",") if "=" in kv)
        return cls(
            rank=args.machine_rank if args.machine_rank is not None else getattr(config, "machine_rank", 0),
            count=count,
            address=f"{ip}:{port}",
            wait_key=wait_key,
            wait_s=int(rdzv.get(wait_key, RENDEZVOUS_WAIT_S)),
        )

    def meeting(self) -> str:
        return (
            f"machine {self.rank} of {self.count}: meeting the others at {self.address} (machine 0's address; up to "
            f"{self.wait_s} s)"
        )

    def missing(self) -> str:
        return (
            f"error: machine {self.rank} of {self.count} did not meet the others at {self.address} within "
            f"{self.wait_s} s: start the same command on each of the {self.count} machines, with its own machine_rank "
            f"(0 to {self.count - 1}) and machine 0's address as main_process_ip, reachable at that port from every "
            f"machine (`--rdzv_conf {self.wait_key}=SECONDS` waits longer)"
        )


def _quiet_cpp_logs_in_this_process() -> None:
    """libtorch logs each failed connection to machine 0 with a C++ stack trace, every few seconds while a machine
    waits for it; the meeting line says where it waits, and a meeting that fails ends with one line. c10 reads its
    level once, as torch loads, so the run's processes, started later without it, keep their C++ warnings. A level
    the user set stays."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    import torch  # noqa: F401

    del os.environ["TORCH_CPP_LOG_LEVEL"]


def main() -> None:
    _quiet_cpp_logs_in_this_process()
    import torch.distributed.run  # noqa: F401  (creates torchelastic's loggers, which -q quiets)
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    from modeling.device import quiet_deepspeed

    quiet_deepspeed()  # the DeepSpeed launcher imports it here, and the run's processes inherit the setting
    args = launch_command_parser().parse_args()
    if args.quiet:  # each torchelastic module's logger has its own level (LOGLEVEL's), so each is set
        for name in list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    # accelerate >= 1.16 itself catches a failed run's ChildFailedError under -q and prints torchrun's summary; the
    # handlers below make the last word, so accelerate is not told (-q's only other effect there: the one-process
    # launcher raises CalledProcessError rather than exiting 1, caught below too).
    args.quiet = False
    machines = Machines.of(args)
    if machines:  # torchrun says nothing while it waits, and a machine that never comes leaves the others waiting
        print(machines.meeting(), flush=True)
    try:
        launch_command(args)
    except (DistStoreError, DistNetworkError, RendezvousError) as err:  # machines that never met: no process ran
        if machines is None:
            raise
        print(f"{machines.missing()} ({type(err).__name__}: {err})", file=sys.stderr, flush=True)
        sys.exit(1)
    except ChildFailedError as err:
        line = _root_cause_line(err)
        if line:
            print(line, file=sys.stderr, flush=True)
        _, first = err.get_first_failure()
        sys.exit(first.exitcode if first.exitcode > 0 else 1)
    except SignalException as err:  # the run's processes got it too, saved a checkpoint and said so
        sys.exit(128 + err.sigval)
    except subprocess.CalledProcessError as err:  # the one-process launcher without -q: the run printed its error
        if err.returncode < 0:  # killed, so it printed nothing: the kernel's out-of-memory killer sends SIGKILL
            name = signal.Signals(-err.returncode).name
            print(f"error: the run ended with signal {name}; its output above says how far it got", file=sys.stderr)
            sys.exit(128 - err.returncode)
        sys.exit(err.returncode)
    except (FileNotFoundError, ImportError, RuntimeError, ValueError) as err:
        # accelerate's own checks of the YAML and flags before it starts the run (a config file not found, FP8
        # without its library, flags that contradict each other): its message, as one line
        print(f"error: accelerate launch: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        sys.exit(1)
    except (yaml.YAMLError, TypeError, AttributeError) as err:
        # a launch YAML accelerate's loader cannot take (not YAML, a list, a word where a number goes)
        print(
            f"error: accelerate launch: the launch YAML {args.config_file or '(accelerate config default)'} cannot be "
            f"read ({type(err).__name__}: {' '.join(str(err).split())}); write one with `accelerate config`, or start "
            "from accelerate_configs/",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
