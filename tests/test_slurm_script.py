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


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_time_limit_warning_stops_the_run_then_requeues_the_job(tmp_path):
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("")
    slurm = {"SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]",
             "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "64"}  # fmt: skip
    env = {**os.environ, **slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log)}
    cmd = ["bash", str(SCRIPT), "--out-dir", "/shared/runs/x"]
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "srun " in log.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends the batch script
        out, _ = job.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # the stand-in srun too, should the script have left it running
    assert job.returncode == 0
    assert "nears its time limit" in out
    assert log.read_text().splitlines()[-4:] == [
        "scancel --signal=TERM 4242", "the step got TERM", "the step saved and ended", "scontrol requeue 4242"
    ]  # fmt: skip
    assert "python -m training.launch -q --config_file" in log.read_text()  # the launch without tracebacks
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task 64 bash -c" in log.read_text()
    header = SCRIPT.read_text()
    assert re.search(r"^#SBATCH --requeue$", header, re.M) and re.search(r"^#SBATCH --signal=B:USR1@\d+$", header, re.M)
