"""testkit.run's warm launches of train_accel.py (tests/warm_launch.py) stand in for fresh interpreters in ~40 tests,
and for the ranks of ~25 `accelerate launch`es (tests/warm_exec.py, torchrun's PYTHON_EXEC): the same command gives
the same run, bit for bit, the same output and the same exit status either way."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import REPO, TRAIN_ACCEL, WARM, run, train_cmd
from training.metrics import read_metrics

pytestmark = pytest.mark.slow


def fresh(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_a_warm_launch_is_a_fresh_one(prepared_books, tmp_path):
    args = ["--max-steps", "3", "--micro-batch-size", "4", "--total-batch-tokens", "512", "--log-interval", "1",
            "--eval-interval", "3", "--eval-windows", "4", "--checkpoint-interval", "3"]  # fmt: skip
    cold = fresh(train_cmd(None, tmp_path / "fresh", prepared_books, *args))
    with WARM.forking(1):  # it went through the server
        warm = run(train_cmd(None, tmp_path / "warm", prepared_books, *args))
    assert cold.returncode == 0, cold.stderr[-3000:]
    runs = [read_metrics(tmp_path / name / "metrics.jsonl") for name in ("fresh", "warm")]
    losses = [[(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rows if "step" in r] for rows in runs]
    assert losses[0] == losses[1] and len(losses[0]) >= 4, losses
    last = [
        p.stdout.splitlines()[-1].replace(str(tmp_path / name), "RUN") for p, name in ((cold, "fresh"), (warm, "warm"))
    ]
    assert last[0] == last[1] == "run folder: RUN (checkpoints: 1, loss.png)", last
    config = [
        (tmp_path / name / "config.yaml").read_text().replace(str(tmp_path / name), "RUN") for name in ("fresh", "warm")
    ]
    assert config[0] == config[1]

    bad = ["--n-head", "3"]  # tiny-cpu's 64 channels do not split into 3 heads
    cold = fresh(train_cmd(None, tmp_path / "bad-fresh", prepared_books, *bad))
    with WARM.forking(1):
        warm = run(train_cmd(None, tmp_path / "bad-warm", prepared_books, *bad), expect_rc=1)
    assert (cold.returncode, cold.stdout, cold.stderr) == (1, warm.stdout, warm.stderr), (cold.stderr, warm.stderr)


def test_an_accelerate_launch_and_the_runs_it_starts_run_warm_as_fresh_ones(prepared_books, tmp_path):
    args = ["--max-steps", "2", "--micro-batch-size", "4", "--total-batch-tokens", "1024", "--log-interval", "1",
            "--eval-interval", "2", "--eval-windows", "4", "--checkpoint-interval", "2"]  # fmt: skip
    cold = fresh(train_cmd("cpu_ddp2.yaml", tmp_path / "fresh", prepared_books, *args))
    with WARM.forking(3):  # the launcher and both ranks went through the server
        warm = run(train_cmd("cpu_ddp2.yaml", tmp_path / "warm", prepared_books, *args))
    assert cold.returncode == 0, cold.stderr[-3000:]
    runs = [read_metrics(tmp_path / name / "metrics.jsonl") for name in ("fresh", "warm")]
    losses = [[(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rows if "step" in r] for rows in runs]
    assert losses[0] == losses[1] and len(losses[0]) >= 3, losses
    out = [p.stdout.replace(str(tmp_path / name), "RUN") for p, name in ((cold, "fresh"), (warm, "warm"))]
    assert out[0].splitlines()[-1] == out[1].splitlines()[-1] == "run folder: RUN (checkpoints: 1, loss.png)", out

    # ranks that stop with an error: our line, then torchrun's summary quoting it once for each rank that had failed
    # when torchrun looked (one or both: it stops the other), and the exit status
    bad = ["--n-head", "3"]  # tiny-cpu's 64 channels do not split into 3 heads
    cold = fresh(train_cmd("cpu_ddp2.yaml", tmp_path / "bad-fresh", prepared_books, *bad))
    with WARM.forking(3):
        warm = run(train_cmd("cpu_ddp2.yaml", tmp_path / "bad-warm", prepared_books, *bad), expect_rc=1)
    assert cold.returncode == 1, cold.stderr[-3000:]
    ours = [[line for line in p.stderr.splitlines() if "error: " in line] for p in (cold, warm)]
    said = ours[0][0]
    assert said.startswith("error: n_embd 64 (the tiny-cpu preset's) is not divisible by n_head 3"), ours
    for lines in ours:
        assert lines[0] == said and 1 <= len(lines[1:]) <= 2, ours
        assert set(lines[1:]) == {f"  traceback : {said}"}, ours

    # accelerate's one-process launcher: its run too
    cold = fresh(train_cmd("cpu_eager.yaml", tmp_path / "one-fresh", prepared_books, *bad))
    with WARM.forking(2):  # the launcher and its run
        warm = run(train_cmd("cpu_eager.yaml", tmp_path / "one-warm", prepared_books, *bad), expect_rc=1)
    assert cold.returncode == 1, cold.stderr[-3000:]
    # the launcher's traceback's frames (indented lines) start in warm_launch.py; its CalledProcessError names the
    # command it ran, the warm client here
    said = [
        [line for line in (p.stdout + p.stderr).replace(str(tmp_path / name), "RUN").splitlines() if line[:1] != " "]
        for p, name in ((cold, "one-fresh"), (warm, "one-warm"))
    ]
    assert said[0] == [line.replace(str(WARM.python), sys.executable) for line in said[1]], said


def test_what_a_launcher_adds_to_the_environment_is_served_warm(tmp_path):
    """DeepSpeed's launch puts the working folder, the repo, on its ranks' PYTHONPATH, and the ranks' sh wrapper sets
    PWD: neither changes what the server's imports found, so the ranks run warm (ZeRO's launches were fresh, ~3 s of
    imports a rank). Another folder on PYTHONPATH could shadow a module: a fresh interpreter then."""
    from warm_launch import BEFORE_THE_IMPORTS, why_fresh

    def request(**env: str) -> dict:
        return {"args": ["-u", str(TRAIN_ACCEL)], "cwd": str(tmp_path), "env": {**BEFORE_THE_IMPORTS, **env}}

    path = BEFORE_THE_IMPORTS.get("PYTHONPATH")
    with_repo = os.pathsep.join(filter(None, [path, str(REPO)]))
    assert why_fresh(TRAIN_ACCEL, request(PYTHONPATH=with_repo, PWD=str(tmp_path))) == ""
    assert why_fresh(TRAIN_ACCEL, request(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), path])))) == ""
    other = os.pathsep.join(filter(None, [str(tmp_path), path]))
    assert why_fresh(TRAIN_ACCEL, request(PYTHONPATH=other)) == f"PYTHONPATH: {path!r} -> {other!r}"
    # the first-light script's nccl and train steps: NCCL's log level, read when a process group starts, and torch's
    # logs, which a copy sets up again
    assert why_fresh(TRAIN_ACCEL, request(NCCL_DEBUG="INFO", TORCH_LOGS="recompiles,graph_breaks")) == ""


def test_a_packages_main_is_served_as_python_m_from_the_folder_holding_it(tmp_path):
    """A server of a package's __main__.py (tests/e2e/test_evals_cli.py's, of evals) serves `python [-u] -m evals`
    run from the repo, where a fresh interpreter finds the package (its working folder first on sys.path); from
    another folder, or for another module, a fresh interpreter."""
    from warm_launch import BEFORE_THE_IMPORTS, why_fresh

    main = REPO / "evals" / "__main__.py"

    def request(*args: str, cwd: Path = REPO) -> dict:
        return {"args": list(args), "cwd": str(cwd), "env": dict(BEFORE_THE_IMPORTS)}

    assert why_fresh(main, request("-m", "evals", "--run", "x")) == ""
    assert why_fresh(main, request("-u", "-m", "evals")) == ""  # a rank, as torchrun starts it
    assert why_fresh(main, request("-m", "accelerate.commands.launch")) == ""
    assert why_fresh(main, request("-m", "evals", cwd=tmp_path)) == f"another working folder, {tmp_path}"
    assert why_fresh(main, request("-m", "evals.generate")) == "another module, ['evals.generate']"


def test_the_modules_a_server_is_given_are_served_as_python_m_from_the_repo_on_its_cpus(tmp_path):
    """A server given modules (the first-light script's bench and evals commands) serves `python -m MODULE` for
    each, run from the repo, with SCRIPT's imports done; another module, another working folder (where another
    module of that name may be found), or a client pinned to other CPUs (taskset, which a copy would not inherit)
    gets a fresh interpreter."""
    from warm_launch import BEFORE_THE_IMPORTS, why_fresh

    modules = ("bench.ladder", "evals")

    def request(*args: str, cwd: Path = REPO, **extra: object) -> dict:
        return {"args": list(args), "cwd": str(cwd), "env": dict(BEFORE_THE_IMPORTS), **extra}

    assert why_fresh(TRAIN_ACCEL, request("-m", "bench.ladder", "--rungs", "11"), modules) == ""
    assert why_fresh(TRAIN_ACCEL, request("-m", "evals", "--tasks", "hellaswag"), modules) == ""
    assert why_fresh(TRAIN_ACCEL, request("-m", "bench.ladder")) == "another module, ['bench.ladder']"
    assert why_fresh(TRAIN_ACCEL, request("-m", "bench.profile"), modules) == "another module, ['bench.profile']"
    assert why_fresh(TRAIN_ACCEL, request("-m", "bench.ladder", cwd=tmp_path), modules) == (
        f"another working folder, {tmp_path}"
    )
    ours = sorted(os.sched_getaffinity(0))
    assert why_fresh(TRAIN_ACCEL, request("-m", "bench.ladder", cpus=ours), modules) == ""
    other = [ours[-1] + 1]
    assert why_fresh(TRAIN_ACCEL, request(str(TRAIN_ACCEL), cpus=other)) == f"CPUs {ours} -> {other}"


def test_the_server_log_keeps_each_line_whole_when_two_keepers_write_at_once(tmp_path):
    """The keepers of a 2-process launch's ranks log their `forked PID: ...` lines at the same moment, into one file
    (testkit.WarmLaunches.forking counts them): under PYTHONUNBUFFERED, print() wrote a line and its newline apart,
    two lines ran together and one copy was counted for two. Two processes let go at once, 50,000 lines each: every
    line whole."""
    log = tmp_path / "warm_launch.log"
    writer = "import sys\nfrom warm_launch import log_line\nsys.stdin.read(1)\n"  # both imported, then let go
    writer += "for i in range(50000):\n    log_line(f'forked {sys.argv[1]}: {i}')"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "tests")}
    with log.open("a") as out:
        writers = [
            subprocess.Popen([sys.executable, "-c", writer, n], stdin=subprocess.PIPE, stdout=out, env=env)
            for n in ("1", "2")
        ]
        for w in writers:
            w.stdin.write(b"go")
            w.stdin.close()
        assert [w.wait(timeout=60) for w in writers] == [0, 0]
    lines = log.read_text().splitlines()
    assert sorted(lines) == sorted(f"forked {n}: {i}" for n in ("1", "2") for i in range(50000))
