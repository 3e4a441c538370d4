"""A resume with a changed --lr, --muon-lr, --weight-decay or Muon's momentum (and its warmup) trains with them, as
its start-up line says; one with the same config continues with exactly the saved lrs."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil

import pytest
import torch

from testkit import TINY_MODEL
from training.checkpoint import CheckpointError, checkpoint_damage, checkpoint_dir, save_checkpoint
from training.config import ConfigError, TrainConfig
from training.loop import TrainMetrics, setup, trainer_for, write_outputs
from training.step import TrainingAborted


def config(data_dir, out_dir, **changes) -> TrainConfig:
    cfg = TrainConfig(
        preset="tiny-cpu", block_size=TINY_MODEL.block_size, data_dir=str(data_dir), out_dir=str(out_dir),
        micro_batch_size=2, total_batch_tokens=64, max_steps=6, warmup_steps=4, log_interval=1, eval_interval=0,
        sample_interval=0, num_workers=0, peak_tflops=1.0, export_hf=False, muon_momentum_warmup_steps=4,
    )  # fmt: skip
    return dataclasses.replace(cfg, **changes)


def groups(run) -> list[dict]:
    """Each group's hyperparameters; the run folder's lock released, as the launch's exit would."""
    run.lock.release()
    return [{k: v for k, v in g.items() if k != "params"} for g in run.schedule.optimizer.param_groups]


def train_steps(run, steps: int) -> TrainMetrics:
    """`steps` optimizer steps of `run`, each timed as the loop times it (the run's progress keeps the train time)."""
    trainer, batches, metrics = trainer_for(run, stop=False), iter(run.train_loader), TrainMetrics(run)
    for _ in range(steps):
        metrics.step_started()
        trainer.train_step(batches)
        trainer.settle()
        metrics.step_finished(run.progress.step)
    return metrics


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_resume_trains_with_this_launchs_hyperparameters(prepared_books, tmp_path):
    out = tmp_path / "run"
    first = setup(config(prepared_books, out))
    train_steps(first, 2)  # in the warmup: the lrs depend on the step
    save_checkpoint(first.accelerator, first.run_dir, 2, 2, {"step": 2}, first.checkpoint_bytes)
    saved = groups(first)

    same = setup(config(prepared_books, out))
    assert groups(same) == saved  # the same config: exactly the saved lrs, momenta and the rest

    changes = {"lr": 1e-3, "muon_lr": 0.05, "weight_decay": 0.3, "muon_momentum": 0.9, "muon_momentum_warmup_steps": 8}
    changed = setup(config(prepared_books, out, **changes))
    multiplier = saved[0]["lr"] / saved[0]["initial_lr"]  # the step's, which the resume keeps
    for group, before in zip(groups(changed), saved, strict=True):
        muon = "initial_momentum" in group
        assert group["initial_lr"] == (0.05 if muon else 1e-3)
        assert group["lr"] == pytest.approx(group["initial_lr"] * multiplier, rel=1e-12)
        assert group["weight_decay"] == (0.3 if before["weight_decay"] else 0.0)
        if muon:
            assert group["initial_momentum"] == 0.9 and group["momentum"] == pytest.approx(0.85 + 0.05 * 2 / 8)
    assert changed.progress.step == 2


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_time_budget_given_on_a_resume_counts_the_train_time_before_it(prepared_books, tmp_path):
    """A run without a time budget, resumed with one: the checkpoint held no train time (0.0), so the budget's
    minutes went to the new steps alone, and its "time budget: ... N steps in M min" line counted the earlier
    steps as free. The train-step time is kept whatever the budget: the first step's (which compiles) left out."""
    out = tmp_path / "run"
    first = setup(config(prepared_books, out))
    metrics = train_steps(first, 3)
    assert first.progress.train_seconds == pytest.approx(metrics.window_s) and metrics.window_s > 0  # steps 2 and 3
    save_checkpoint(first.accelerator, first.run_dir, 3, 3, {"step": 3}, first.checkpoint_bytes)
    spent = first.progress.train_seconds
    first.lock.release()
    resumed = setup(config(prepared_books, out, time_budget_minutes=1.0))
    assert resumed.progress.step == 3 and resumed.progress.train_seconds == spent
    resumed.lock.release()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_run_continued_in_a_new_folder_that_diverges_names_the_checkpoint_it_continued(prepared_books, tmp_path):
    """--resume OTHER/checkpoints/step-N --out-dir NEW, stopped by non-finite losses before NEW saved anything: the
    last good checkpoint is the one it continued from, not "none yet" (which left the user to start over); the
    --resume it gives runs as given where the path holds a space."""
    first = setup(config(prepared_books, tmp_path / "stable run"))
    train_steps(first, 1)
    save_checkpoint(first.accelerator, first.run_dir, 1, 1, {"step": 1}, first.checkpoint_bytes)
    first.lock.release()
    good = checkpoint_dir(tmp_path / "stable run", 1)
    anneal = setup(config(prepared_books, tmp_path / "anneal", resume=str(good), max_bad_steps=1))
    with torch.no_grad():  # the run diverges: its first step's loss is not finite
        next(anneal.model.parameters()).fill_(float("nan"))
    trainer, batches = trainer_for(anneal, stop=False), iter(anneal.train_loader)
    with pytest.raises(TrainingAborted) as aborted:
        trainer.train_step(batches)
        trainer.settle()
    anneal.lock.release()
    said, resume = str(aborted.value).split(", then continue with --resume ")
    assert said.endswith(f"Last good checkpoint: {good}. Lower --lr or raise --warmup-steps")
    assert shlex.split(resume) == [str(good)]  # as given in a shell, the path with its space


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_finished_run_continued_in_a_new_folder_writes_its_outputs_there(prepared_books, tmp_path, capsys):
    """--resume OTHER/checkpoints/step-N --out-dir NEW (or a checkpoint set aside into previous-<time>/) at the run's
    last step: nothing to train, and the outputs ended in an IndexError traceback, NEW holding no checkpoint."""
    first = setup(config(prepared_books, tmp_path / "done", max_steps=1))
    train_steps(first, 1)
    first.accelerator.log({"train_loss": 1.0}, step=1)
    save_checkpoint(first.accelerator, first.run_dir, 1, 1, {"step": 1}, first.checkpoint_bytes)
    first.lock.release()
    again = setup(config(prepared_books, tmp_path / "new", max_steps=1, resume=str(checkpoint_dir(first.run_dir, 1))))
    write_outputs(again)
    again.lock.release()
    assert (again.run_dir / "loss.png").is_file()
    assert capsys.readouterr().out.splitlines()[-1] == f"run folder: {again.run_dir} (checkpoints: 0, loss.png)"


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_out_dir_that_is_a_checkpoint_is_refused_and_the_checkpoint_left_whole(prepared_books, tmp_path):
    """--out-dir RUN/checkpoints/step-N (meant as --resume): its config.yaml made it a run folder to start afresh in,
    so its files were moved into a previous-<time>/ inside it, and the run's checkpoint no longer resumed."""
    first = setup(config(prepared_books, tmp_path / "run"))
    train_steps(first, 1)
    saved = save_checkpoint(first.accelerator, first.run_dir, 1, 1, {"step": 1}, first.checkpoint_bytes)
    first.lock.release()
    files = sorted(p.name for p in saved.iterdir())
    with pytest.raises(NotADirectoryError) as refused:
        setup(config(prepared_books, saved))
    assert str(refused.value) == (
        f"out_dir {saved} is a checkpoint of the run in {first.run_dir}, not a run folder: to continue from it, give "
        f"it as --resume, with --out-dir {first.run_dir} or a new folder"
    )
    assert sorted(p.name for p in saved.iterdir()) == files and checkpoint_damage(saved) is None


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_out_dir_that_is_a_runs_export_is_refused_and_the_export_left_whole(prepared_books, tmp_path):
    """--out-dir RUN/export started a run inside the run's export folder (its config.yaml, metrics and checkpoints
    mixed into what the Hub push uploads), as --out-dir RUN/checkpoints/step-N did before it was refused."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text("preset: tiny-cpu\n")
    (run / "export" / "config.json").write_text("{}")
    for given in (run / "export", run / "export" / "x" / ".."):
        with pytest.raises(NotADirectoryError) as refused:
            setup(config(prepared_books, given))
        where = os.path.abspath(run) if ".." in given.parts else run
        assert str(refused.value) == (
            f"out_dir {given} is the export folder of the run in {where}, not a run folder: to continue that run, "
            f"give --out-dir {where}; to train from the export's weights, give it as --init-from, with a new --out-dir"
        )
    assert sorted(p.name for p in (run / "export").iterdir()) == ["config.json"]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_checkpoint_from_before_manifests_missing_a_file_is_one_line_naming_it(prepared_books, tmp_path):
    """A checkpoint saved before manifests existed is load-tested file by file, so a lost file went unnoticed until
    accelerate's load_state, whose raw '[Errno 2] No such file or directory' was the launch's last line."""
    first = setup(config(prepared_books, tmp_path / "run"))
    train_steps(first, 1)
    saved = save_checkpoint(first.accelerator, first.run_dir, 1, 1, {"step": 1}, first.checkpoint_bytes)
    first.lock.release()
    (saved / "manifest.json").unlink()
    (saved / "optimizer.bin").unlink()
    with pytest.raises(CheckpointError) as refused:
        setup(config(prepared_books, first.run_dir))
    assert str(refused.value) == (
        f"checkpoint {saved} is damaged (optimizer.bin is missing); restore it, resume from another checkpoint of "
        f"{saved.parent} with --resume PATH (none), or start afresh with --resume never"
    )


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_out_dir_that_is_the_data_dir_is_refused_before_anything_is_written(prepared_books, tmp_path):
    """Trained in its dataset's folder, a fresh start there (--resume never) moved the shards and the manifest into
    previous-<time>/ with the run's files: the next launch found no prepared dataset."""
    data = tmp_path / "books"
    shutil.copytree(prepared_books, data)
    with pytest.raises(ConfigError) as refused:
        setup(config(data, f"{data}/", resume="never"))
    assert str(refused.value) == (
        f"out_dir and data_dir are one folder ({data}/): a fresh start there would set the dataset aside with the run; "
        "give the run a folder of its own, e.g. --out-dir runs/mine"
    )
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in prepared_books.iterdir())


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_run_whose_checkpoints_folder_is_a_link_resumes_as_its_own(prepared_books, tmp_path):
    """checkpoints/ linked to a bigger disk: the resume took its newest checkpoint for another folder's and moved the
    whole run (metrics.jsonl, config.yaml, the link itself) into previous-<time>/, the loss history cut at the step."""
    out = tmp_path / "run"
    first = setup(config(prepared_books, out))
    train_steps(first, 2)
    first.accelerator.log({"train_loss": 1.0}, step=2)
    save_checkpoint(first.accelerator, first.run_dir, 2, 2, {"step": 2}, first.checkpoint_bytes)
    first.lock.release()
    (out / "checkpoints").rename(tmp_path / "big-disk")
    (out / "checkpoints").symlink_to(tmp_path / "big-disk")
    rows = (out / "metrics.jsonl").read_text()
    resumed = setup(config(prepared_books, out))
    resumed.lock.release()
    assert resumed.progress.step == 2
    assert not list(out.glob("previous-*"))  # nothing of the run set aside
    assert (out / "checkpoints").is_symlink() and (out / "metrics.jsonl").read_text().startswith(rows)
