"""scripts/slurm_multinode.sh under a stand-in SLURM (CI has no scheduler; what the stand-ins do is what SLURM 22.05
did with this script, see BENCHMARKS.md): the time-limit warning (USR1) stops the run with SIGTERM to the job's step
(not to srun, which would kill it), waits for it to save, then requeues the job; a preempted job, whose step SLURM
stops, is requeued by the script too; the job asks SLURM for requeueing and the warning."""

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

# The stand-ins log what the script asked of them. srun: one step whose tasks, signalled by scancel or by SLURM's
# preemption (USR2 here), "save" for a second (the script must wait for that) before the step ends with the launcher's
# status after a SIGTERM; a SIGTERM to srun itself makes it SIGKILL its tasks, as the real one does, so nothing is
# saved. scontrol shows the job's PreemptTime (None unless the job is being preempted).
SRUN = """#!/bin/bash
echo $$ > "$LOG.srun_pid"
trap 'echo "the step got TERM"; sleep 1; echo "the step saved and ended"; exit 143' USR2
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
if [ "$1 $2" = "show hostnames" ]; then echo node1; echo node2
elif [ "$1 $2" = "show job" ]; then echo "   PreemptEligibleTime=2026-12-06T05:23:19 PreemptTime=$PREEMPT_TIME"
else echo "scontrol $*" >> "$LOG"; fi
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
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(cwd), "PREEMPT_TIME": "None", **SLURM, **env}
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
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1 --label --cpus-per-task 64 bash -c" in log.read_text()
    header = SCRIPT.read_text()
    assert re.search(r"^#SBATCH --requeue$", header, re.M) and re.search(r"^#SBATCH --signal=B:USR1@\d+$", header, re.M)


@needs_bash
@pytest.mark.parametrize("preempted", [True, False])
def test_a_preempted_job_whose_run_saved_is_requeued(tmp_path, preempted):
    """Preempted with a GraceTime, SLURM sends SIGTERM to the step only; the runs save and end before the grace does,
    and SLURM then records the job FAILED (exit 143), not requeued: the script requeues it. A step stopped otherwise
    (`scancel --signal=TERM` by its user) ends the job with the step's status."""
    job, log = _job(tmp_path, _repo(tmp_path), PREEMPT_TIME="2026-12-06T05:23:44" if preempted else "None")
    with _cleanup(job):
        _wait_for_srun(job, log)
        os.kill(int((tmp_path / "log.srun_pid").read_text()), signal.SIGUSR2)  # SLURM's SIGTERM to the step
        out, _ = job.communicate(timeout=30)
    lines = log.read_text().splitlines()
    if preempted:
        assert job.returncode == 0 and lines[-2:] == ["the step saved and ended", "scontrol requeue 4242"]
        assert "job 4242 was preempted: the run saved a checkpoint; requeueing" in out
    else:
        assert job.returncode == 143 and lines[-1] == "the step saved and ended"


@needs_bash
@pytest.mark.parametrize("nodes", [1, 2])
def test_on_several_nodes_each_line_of_the_job_output_names_its_node(tmp_path, nodes):
    """Each machine's run prints its log (under SLURM 22.05 a 2-node job's output had every line twice, unlabelled):
    srun --label prefixes each line with its task, one per node; a one-node job's lines stay as they are."""
    job, log = _job(tmp_path, _repo(tmp_path), SLURM_NNODES=str(nodes))
    with _cleanup(job):
        _wait_for_srun(job, log)
    srun = next(line for line in log.read_text().splitlines() if line.startswith("srun "))
    assert ("--label" in srun.split()) == (nodes > 1), srun


@needs_bash
def test_the_job_runs_in_its_working_directory_not_always_the_submit_one(tmp_path):
    """`sbatch --chdir ROOT` (a job submitted from elsewhere) starts the script in ROOT: the repository it runs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job, log = _job(tmp_path, _repo(tmp_path / "repo"), SLURM_SUBMIT_DIR=str(elsewhere))
    with _cleanup(job):
        _wait_for_srun(job, log)


@needs_bash
def test_run_by_hand_outside_slurm_it_says_to_use_sbatch(tmp_path):
    names = (*SLURM, "SLURM_SUBMIT_DIR")
    job, log = _job(tmp_path, _repo(tmp_path), unset=names)
    with _cleanup(job):
        _, err = job.communicate(timeout=30)
    assert job.returncode == 1 and not log.exists()
    assert err.strip().splitlines()[-1].startswith("error: this is a SLURM batch script: submit it with `sbatch"), err


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


def _slurm_runs_here() -> bool:
    if shutil.which("sbatch") is None:
        return False
    return subprocess.run(["scontrol", "ping"], capture_output=True, text=True).stdout.count("UP") > 0


@pytest.mark.skipif(not _slurm_runs_here(), reason="needs a running SLURM (sbatch, and scontrol ping says UP)")
def test_under_real_slurm_a_job_without_gpus_says_what_to_set(tmp_path):
    """What the stand-ins assume, checked against the real scheduler: a job given no GPUs has no SLURM_GPUS_ON_NODE,
    so the script ends it at once with its one line, and SLURM records that job as FAILED with exit code 1."""
    _repo(tmp_path)
    out = tmp_path / "job.out"
    submit = ["sbatch", "--parsable", "--chdir", str(tmp_path), "--output", str(out), "--nodes=1", "--gpus-per-node=0",
              "--cpus-per-task=1", "--time=10", str(SCRIPT), "--out-dir", str(tmp_path / "run")]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "GPUS_PER_NODE"}  # sbatch passes the job this environment
    job_id = (
        subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
        .stdout.strip()
        .split(";")[0]
    )
    deadline, state = time.monotonic() + 30, ""
    while time.monotonic() < deadline:
        state = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        if re.search(r"JobState=(COMPLETED|FAILED|CANCELLED|TIMEOUT)", state):
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job_id])
        if "JobState=PENDING" in state:
            pytest.skip(f"job {job_id} waited in the queue for 30 s (a busy cluster)")
    out_text = out.read_text() if out.exists() else "(no output)"
    assert "JobState=FAILED" in state and "ExitCode=1:0" in state, state + out_text
    assert out_text.splitlines()[-1].startswith(f"error: job {job_id} has no GPUs"), out_text
