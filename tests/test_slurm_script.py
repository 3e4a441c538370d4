"""scripts/slurm_multinode.sh under a stand-in SLURM (no scheduler runs here): the time-limit warning (USR1) stops the
run with SIGTERM to the job's step (not to srun, which would kill it), waits for it to save, then requeues the job;
the job asks SLURM for requeueing and the warning."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from testkit import REPO

SCRIPT = REPO / "scripts" / "slurm_multinode.sh"

# The stand-ins log what the script asked of them. srun: one step whose tasks, signalled by scancel (USR2 here),
# "save" for a second (the script must wait for that) before the step ends; a SIGTERM to srun itself makes it
# SIGKILL its tasks, as the real one does, so nothing is saved.
SRUN = """#!/bin/bash
echo $$ > "$LOG.srun_pid"
trap 'echo "the step got TERM"; sleep 1; echo "the step saved and ended"; exit 0' USR2
trap 'echo "srun got TERM: forcing job termination (SIGKILL to the tasks)"; exit 137' TERM
echo "srun $*" >> "$LOG"
exec >> "$LOG"
while true; do sleep 0.1; done
"""
SCANCEL = """#!/bin/bash
echo "scancel $*" >> "$LOG"
kill -USR2 "$(cat "$LOG.srun_pid")"
"""
SCONTROL = """#!/bin/bash
if [ "$1" = "show" ]; then echo node1; echo node2; else echo "scontrol $*" >> "$LOG"; fi
"""


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8",
         "SLURM_CPUS_PER_TASK": "64"}  # fmt: skip
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _job(tmp_path, cwd, unset=(), **env):
    """The script started as SLURM starts a batch job, in `cwd` (the job's working directory), with the stand-ins."""
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(cwd), **SLURM, **env}
    env = {k: v for k, v in env.items() if k not in unset} | {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "LOG": str(log),
    }
    cmd = ["bash", str(SCRIPT), "--out-dir", "/shared/runs/x"]
    job = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # fmt: skip
    return job, log


def _repo(path):
    """A submit directory as the script needs it: the repository's root, with .venv."""
    (path / ".venv" / "bin").mkdir(parents=True)
    (path / ".venv" / "bin" / "activate").write_text("")
    return path


@contextlib.contextmanager
def _cleanup(job):
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # the stand-in srun too, should the script have left it running


def _wait_for_srun(job, log):
    deadline = time.monotonic() + 30
    while not (log.exists() and "srun " in log.read_text()):
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read() if job.poll() is not None else ""
        time.sleep(0.05)


@needs_bash
def test_the_time_limit_warning_stops_the_run_then_requeues_the_job(tmp_path):
    job, log = _job(tmp_path, _repo(tmp_path))
    with _cleanup(job):
        _wait_for_srun(job, log)
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends the batch script
        out, _ = job.communicate(timeout=30)
    assert job.returncode == 0
    assert "nears its time limit" in out
    assert log.read_text().splitlines()[-4:] == [
        "scancel --signal=TERM 4242", "the step got TERM", "the step saved and ended", "scontrol requeue 4242"
    ]  # fmt: skip
    assert "python -m training.launch -q --config_file" in log.read_text()  # the launch without tracebacks
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task 64 bash -c" in log.read_text()
    header = SCRIPT.read_text()
    assert re.search(r"^#SBATCH --requeue$", header, re.M) and re.search(r"^#SBATCH --signal=B:USR1@\d+$", header, re.M)


@needs_bash
def test_the_job_runs_in_its_working_directory_not_always_the_submit_one(tmp_path):
    """`sbatch --chdir ROOT` (a job submitted from elsewhere) starts the script in ROOT: the repository it runs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job, log = _job(tmp_path, _repo(tmp_path / "repo"), SLURM_SUBMIT_DIR=str(elsewhere))
    with _cleanup(job):
        _wait_for_srun(job, log)


@needs_bash
@pytest.mark.parametrize("case", ["no GPUs", "no .venv"])
def test_what_the_job_lacks_ends_it_with_one_line_before_any_step(tmp_path, case):
    """A job on CPUs (sbatch --gpus-per-node=0: SLURM sets no SLURM_GPUS_ON_NODE) must say its processes per node, not
    start 8 per node; a job submitted outside the repository has no .venv. Either ends at once, saying what to do."""
    if case == "no GPUs":
        job, log = _job(tmp_path, _repo(tmp_path / "repo"), unset=("SLURM_GPUS_ON_NODE", "GPUS_PER_NODE"))
    else:
        (tmp_path / "empty").mkdir()
        job, log = _job(tmp_path, tmp_path / "empty")
    with _cleanup(job):
        _, err = job.communicate(timeout=30)
    assert job.returncode == 1 and not log.exists()  # srun never started
    last = err.strip().splitlines()[-1]
    if case == "no GPUs":
        assert last.startswith("error: job 4242 has no GPUs") and "GPUS_PER_NODE=2" in last, err
    else:
        assert last.startswith(f"error: no .venv/bin/activate in {tmp_path / 'empty'}:") and "--chdir" in last, err
