"""testkit.run's warm launches of train_accel.py (tests/warm_launch.py) stand in for fresh interpreters in ~40 tests:
the same command gives the same run, bit for bit, the same output and the same exit status either way."""

import subprocess

import pytest

from testkit import REPO, WARM, run, train_cmd
from training.metrics import read_metrics

pytestmark = pytest.mark.slow


def fresh(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_a_warm_launch_is_a_fresh_one(prepared_books, tmp_path):
    args = ["--max-steps", "3", "--micro-batch-size", "4", "--total-batch-tokens", "512", "--log-interval", "1",
            "--eval-interval", "3", "--eval-windows", "4", "--checkpoint-interval", "3"]  # fmt: skip
    cold = fresh(train_cmd(None, tmp_path / "fresh", prepared_books, *args))
    forked = WARM.forked
    warm = run(train_cmd(None, tmp_path / "warm", prepared_books, *args))
    assert WARM.forked == forked + 1  # it went through the server
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

    bad = ["--block-size", "128"]
    cold = fresh(train_cmd(None, tmp_path / "bad-fresh", prepared_books, *bad))
    warm = run(train_cmd(None, tmp_path / "bad-warm", prepared_books, *bad), expect_rc=1)
    assert WARM.forked == forked + 2
    assert (cold.returncode, cold.stdout, cold.stderr) == (1, warm.stdout, warm.stderr), (cold.stderr, warm.stderr)
