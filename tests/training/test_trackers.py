"""--trackers: TensorBoard and W&B write their run into the run folder, one run however often it is resumed."""

import math
import os
import re
import subprocess

import pytest
from accelerate import PartialState

from modeling.runs import read_metrics
from testkit import REPO, launch, train_cmd
from training.metrics import run_trackers


@pytest.mark.slow
def test_tensorboard_shows_the_run_folder_as_one_run_with_the_metrics_jsonl_values(prepared_books, tmp_path):
    """`tensorboard --logdir runs/` lists each run by its folder's name (accelerate's tracker wrote into a
    `bookgpt/` subfolder, and each launch's hyperparameters into a run of their own), and a run resumed from a
    checkpoint older than its last logged step (a kill between saves) is one curve, as metrics.jsonl is: every scalar
    at the steps and values of its rows, none twice. The config is the run's hyperparameters."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run_dir = tmp_path / "run1"
    args = ("--trackers", "tensorboard", "--max-steps", "4", "--log-interval", "1", "--eval-interval", "2",
            "--eval-windows", "8", "--checkpoint-interval", "2", "--micro-batch-size", "4", "--total-batch-tokens",
            "512")  # fmt: skip
    launch(None, run_dir, prepared_books, *args)
    launch(None, run_dir, prepared_books, *args, "--resume", str(run_dir / "checkpoints" / "step-00000002"))

    writers = {p.parent for p in run_dir.rglob("events.out.tfevents.*") if not p.parent.name.startswith("previous-")}
    assert writers == {run_dir}
    board = event_accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    board.Reload()
    rows = read_metrics(run_dir / "metrics.jsonl")
    logged = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert set(board.Tags()["scalars"]) == logged
    for tag in logged:
        points = [(e.step, e.value) for e in board.Scalars(tag)]
        expected = [(r["step"], r[tag]) for r in rows if tag in r]
        assert [s for s, _ in points] == [s for s, _ in expected], tag
        assert all(math.isclose(v, w, rel_tol=1e-6) for (_, v), (_, w) in zip(points, expected)), tag
    assert [e.step for e in board.Scalars("val_loss")] == [0, 2, 4]
    assert "_hparams_/session_start_info" in board.summary_metadata
    hparams = board.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    assert b"tiny-cpu" in hparams and b"trackers" in hparams


def test_tensorboard_takes_a_config_value_that_is_not_a_number_or_text(tmp_path, fresh_accelerate_state):
    """TensorBoard's hyperparameters are numbers, text and booleans: anything else is logged as its text, not a
    ValueError at start-up."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    (tracker,) = run_trackers(["tensorboard"], tmp_path)[1:]
    tracker.start()
    tracker.store_init_configuration({"start_step": 0, "eval_tasks": ["hellaswag", "lambada"], "lr": 3e-3})
    tracker.log({"train_loss": 5.0}, step=1)
    tracker.finish()
    board = event_accumulator.EventAccumulator(str(tmp_path))
    board.Reload()
    assert b"['hellaswag', 'lambada']" in board.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    assert [(e.step, e.value) for e in board.Scalars("train_loss")] == [(1, 5.0)]


def test_wandb_keeps_the_run_in_its_folder_named_after_it_and_a_resume_continues_it(
    tmp_path, monkeypatch, fresh_accelerate_state
):
    """W&B wrote into ./wandb/ of the working folder, under a random run name, and every launch began another W&B
    run: its files now go in the run folder (set aside with the rest of the run), the run is named after the
    folder, and a resumed launch continues the same W&B run."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # wandb's service for this process, set by wandb.init
    PartialState()  # a run's accelerate state, which the tracker logs through
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "my-run"
    names, ids = [], []
    for _ in range(2):
        (tracker,) = run_trackers(["wandb"], run_dir)[1:]
        tracker.start()
        tracker.log({"train_loss": 5.0}, step=len(ids) + 1)
        names.append(tracker.run.name)
        ids.append(tracker.run.id)
        tracker.finish()
    wandb.teardown()
    assert names == ["my-run", "my-run"]
    assert ids[0] == ids[1]
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{ids[0]}"))) == 2
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow
def test_wandb_summary_comes_before_the_error_line_that_ends_a_run_closed_as_failed(prepared_books, tmp_path):
    """W&B prints its run's summary as it finishes, which it did at the interpreter's exit, after the run's one
    `error:` line: the trackers now finish first, and the error line stays the last on screen. The W&B run closes
    as failed (exit code 1), not finished, as W&B then shows it (its debug.log records the code it closes with)."""
    pytest.importorskip("wandb")
    env = {**os.environ, "WANDB_MODE": "offline"}
    cmd = train_cmd(None, tmp_path / "run1", prepared_books, "--trackers", "wandb", "--lr", "1e30", "--muon-lr",
                    "1e30", "--max-steps", "10", "--eval-interval", "0", "--micro-batch-size", "4",
                    "--total-batch-tokens", "256")  # fmt: skip
    # a fresh interpreter, as a user's (the tests' warm launches end without running wandb's exit hook), its two
    # streams in one, as a terminal shows them
    result = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 1, result.stdout[-3000:]
    assert "wandb sync" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("error: non-finite loss/gradients in 5 consecutive steps")
    (log,) = (tmp_path / "run1" / "wandb").glob("offline-run-*/logs/debug.log")
    assert re.findall(r"got exitcode: (\d+)", log.read_text()) == ["1"], log.read_text()[-3000:]
