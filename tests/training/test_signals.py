"""The grace-period line a run's first checkpoint save prints: what the orchestrator must wait, and which launcher
kills the run sooner than that. The stop a signal requests, said once."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import pytest
import torch
from accelerate.utils import compare_versions

from testkit import NEEDS_UNSHARE_PID, REPO
from training import signals
from training.signals import ACCELERATE_KILL_S, StopRequest, grace_period_line, torchrun_reads_shutdown_timeout

ACCELERATE_116 = compare_versions("accelerate", ">=", "1.16.0")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("ACCELERATE_USE_CPU", "TORCHELASTIC_RUN_ID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_grace_period_covers_the_step_and_the_save_twice(no_launcher):
    line = grace_period_line(save_s=3.2, step_s=1.1)
    assert line.startswith("checkpoint saved in 3.2 s (a step takes 1.1 s): ")
    assert line.endswith("set your grace period above 14 s before SIGKILL (docker stop -t, Kubernetes "
                         "terminationGracePeriodSeconds, SLURM's GraceTime and KillWait)")  # fmt: skip


@pytest.mark.skipif(not torchrun_reads_shutdown_timeout(), reason="torch < 2.12's torchrun waits a fixed 30 s")
def test_under_torchrun_its_shutdown_timeout_is_named_when_shorter(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "none")
    assert grace_period_line(save_s=3.2, step_s=1.1).endswith("SLURM's GraceTime and KillWait)")
    no_launcher.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "10")
    assert grace_period_line(save_s=3.2, step_s=1.1).endswith(" and TORCH_ELASTIC_SHUTDOWN_TIMEOUT above 14 (now 10)")


def test_torchrun_reads_its_shutdown_timeout_from_torch_2_12_on():
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert torchrun_reads_shutdown_timeout() == (release >= (2, 12)), torch.__version__


def test_under_a_torchrun_that_kills_after_a_fixed_30_s_a_longer_grace_says_so(no_launcher):
    no_launcher.setenv("TORCHELASTIC_RUN_ID", "none")
    no_launcher.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")  # torch 2.11's torchrun does not read it
    no_launcher.setattr(signals, "torchrun_reads_shutdown_timeout", lambda: False)
    assert grace_period_line(save_s=3.2, step_s=1.1).endswith("SLURM's GraceTime and KillWait)")  # 14 s: within the 30
    slow = grace_period_line(save_s=20.0, step_s=1.5)
    assert slow.endswith(f"; but torchrun in torch {torch.__version__} kills the run 30 s after passing the signal "
                         "on, a wait torch >= 2.12 reads from TORCH_ELASTIC_SHUTDOWN_TIMEOUT: upgrade torch and set it "
                         "above 48, or signal the run's processes instead of the launcher"), slow  # fmt: skip


@pytest.mark.skipif(not ACCELERATE_116, reason="accelerate before 1.16 lets its one-process run save")
def test_under_accelerates_one_process_launcher_its_kill_is_named_when_the_save_needs_longer(no_launcher):
    no_launcher.setenv("ACCELERATE_USE_CPU", "True")
    quick = grace_period_line(save_s=0.5, step_s=0.5)  # twice over: 2 s, within the launcher's 5
    assert quick.endswith("SLURM's GraceTime and KillWait)"), quick
    slow = grace_period_line(save_s=3.2, step_s=1.1)
    assert slow.endswith(f"kills the run {ACCELERATE_KILL_S} s after passing the signal on: signal this process "
                         f"(pid {os.getpid()}) instead")  # fmt: skip


@pytest.fixture
def restored_handlers():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_a_sigterm_behind_a_ctrl_c_is_the_same_stop_said_once(restored_handlers, capsys, monkeypatch):
    """accelerate 1.16's launcher passes a Ctrl-C on as SIGTERM, so the run met both: two "received" lines for one
    key. A second Ctrl-C still interrupts at once."""
    monkeypatch.delenv("RANK", raising=False)
    stop = StopRequest()
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signal_name == "SIGINT"
    assert capsys.readouterr().out == "SIGINT received: finishing this step, then saving a checkpoint\n"
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def as_pid1(shell_command: str) -> str:
    """What `sh -c shell_command` prints as PID 1 of a new PID namespace: a container's command in shell form."""
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", shell_command],
                         capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


@NEEDS_UNSHARE_PID
def test_a_shell_that_would_drop_docker_stops_sigterm_as_pid_1_is_named():
    """docker stop and Kubernetes signal PID 1 alone, and the kernel drops a SIGTERM for a PID 1 without a handler: a
    shell-form CMD (`sh -c`, which does not exec its last command) leaves the run to train on until SIGKILL."""
    probe = f"{shlex.quote(sys.executable)} -c 'from training.signals import pid1_drops_sigterm_line as f; print(f())'"
    line = as_pid1(f"{probe}; true").strip()
    assert line.startswith("warning: PID 1 here is sh, which does not pass a SIGTERM on: "), line
    assert "exec form" in line and "exec accelerate launch" in line
    assert as_pid1(f"exec {probe}").strip() == "None"  # the run is PID 1 itself
    assert as_pid1(f"trap 'kill $!' TERM; {probe} & wait").strip() == "None"  # a shell that passes the signal on
