"""The end of a run cannot kill the run: what the export needs is checked before training, and an export that
still fails after it keeps the checkpoints and names the command that exports them."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import stat
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoTokenizer

from data_prep import DataPrepError
from data_prep.tokenizer import get_encoding
from modeling.config import REAL_VOCAB_SIZE, get_preset
from modeling.disk import swap_in
from modeling.hf_export import load_hf
from modeling.runs import export_step
from training.checkpoint import checkpoint_dir, list_checkpoints, save_checkpoint
from training.config import ConfigError, TrainConfig
from training.export import ExportError
from training.export import main as export_main
from training.export_check import ExportCheck
from training.hub import HubError
from training.loop import Run, TrainMetrics, check_outputs, setup, trainer_for, write_outputs


def tiny_config(data_dir, out_dir) -> TrainConfig:
    return TrainConfig(
        preset="tiny-cpu", data_dir=str(data_dir), out_dir=str(out_dir), micro_batch_size=2, total_batch_tokens=256,
        max_steps=2, log_interval=1, eval_interval=0, sample_interval=0, num_workers=0, peak_tflops=1.0,
    )  # fmt: skip


def python_path_with(monkeypatch, folder: Path, module: str, code: str) -> None:
    """PYTHONPATH leads with `folder`, where `module` is `code`: what the processes this test starts import."""
    (folder / f"{module}.py").write_text(code)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))


def train_logged(run: Run) -> None:
    """Train the run to its end, each step logged: metrics.jsonl's train rows, which the card and loss.png read."""
    trainer, batches, metrics = trainer_for(run, stop=False), iter(run.train_loader), TrainMetrics(run)
    while run.progress.step < run.total_steps:
        metrics.step_started()
        out = trainer.train_step(batches)
        trainer.settle()
        metrics.step_finished(run.progress.step)
        metrics.log(run.progress.step, out)


EXPORT_FAILS = r"^the export at the end of this run would fail \({}\); fix that, or train without it: --export-hf false"


def test_an_export_that_could_not_run_stops_the_run_before_it_trains(
    prepared_books, tmp_path, monkeypatch, fresh_accelerate_state
):
    """On the CPU the run checks in its own process, before the launch writes anything."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # as an image without transformers
    monkeypatch.delitem(sys.modules, "modeling.hf_export", raising=False)
    reason = "ModuleNotFoundError: import of transformers halted; None in sys.modules"
    with pytest.raises(ConfigError, match=EXPORT_FAILS.format(reason) + "$"):
        setup(tiny_config(prepared_books, tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # nothing written: the folder the launch made is gone again


def test_a_start_up_that_stops_before_writing_leaves_no_empty_run_folder(tmp_path, fresh_accelerate_state):
    """A launch with a typo in --data-dir made its --out-dir, locked it and stopped: `ls runs/` then listed a run
    folder holding only the lock's files, of a run that never started. It goes; a folder that holds an earlier run
    keeps all of it."""
    runs, nowhere = tmp_path / "runs", tmp_path / "nowhere"
    with pytest.raises(DataPrepError, match="no prepared dataset in .*nowhere: no such folder"):
        setup(tiny_config(nowhere, runs / "typo"))
    assert runs.is_dir() and list(runs.iterdir()) == []
    (runs / "earlier").mkdir()
    (runs / "earlier" / "metrics.jsonl").write_text('{"step": 2, "train_loss": 9.0}\n')
    with pytest.raises(DataPrepError, match="no prepared dataset"):
        setup(tiny_config(nowhere, runs / "earlier"))
    assert sorted(p.name for p in (runs / "earlier").iterdir()) == [".run.lock", ".run.lock.json", "metrics.jsonl"]
    assert (runs / "earlier" / "metrics.jsonl").read_text() == '{"step": 2, "train_loss": 9.0}\n'


def test_a_private_run_whose_push_cannot_happen_is_told_to_push_it_private(prepared_books, tmp_path, monkeypatch):
    """A Hub out of reach at start-up stops the run with the command that pushes it later: the command left out
    --hub-private-repo's --private, so a push copied from it made the model public."""
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    cfg = dataclasses.replace(tiny_config(prepared_books, tmp_path / "run"), push_to_hub="you/x", hub_private_repo=True)
    later = f"(python -m training.hub {tmp_path / 'run'} --repo-id you/x --private)"
    with pytest.raises(HubError, match=f"^cannot reach the Hub .*{re.escape(later)}$"):
        check_outputs(cfg, cfg.model_config(), None, 0, None)


@pytest.mark.slow  # three export-check child processes
def test_the_export_check_in_a_process_of_its_own(prepared_books, tmp_path, monkeypatch):
    """As a run beside a GPU checks: in a child started early, whose verdict check_outputs waits for. It passes
    where the export works, and stops the run where the child's transformers is broken or the child dies."""
    cfg = tiny_config(prepared_books, tmp_path / "run")
    assert check_outputs(cfg, cfg.model_config(), ExportCheck(cfg.model_config()), 0, None) is None
    python_path_with(monkeypatch, tmp_path, "transformers", "raise ImportError('transformers is broken here')")
    with pytest.raises(ConfigError, match=EXPORT_FAILS.format("ImportError: transformers is broken here")):
        check_outputs(cfg, cfg.model_config(), ExportCheck(cfg.model_config()), 0, None)
    # killed (the OOM killer, say) before it could say why: its exit status is the reason
    python_path_with(monkeypatch, tmp_path, "sitecustomize", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(ConfigError, match=EXPORT_FAILS.format("its check ended with exit status -9")):
        ExportCheck(get_preset("tiny-cpu")).verdict()


@pytest.mark.parametrize(
    "env, expected",
    [({}, True), ({"RANK": "0"}, True), ({"RANK": "3"}, False), ({"ACCELERATE_USE_CPU": "true"}, False),
     ({"ACCELERATE_USE_CPU": "False"}, True)],
)  # fmt: skip
def test_the_early_export_check_reads_the_launch(monkeypatch, env, expected):
    """Before its Accelerator exists, a process on a GPU machine (torch sees CUDA) expects to be the main process
    on a GPU unless the launcher gave it another rank or a YAML's use_cpu."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ExportCheck.expected_here() is expected


def test_an_early_export_check_the_accelerator_contradicts_is_stopped_and_the_run_checks_itself(
    prepared_books, tmp_path, monkeypatch, fresh_accelerate_state
):
    """Where the launch was read wrong (a child started, then the Accelerator on the CPU), the child is stopped and
    the run checks in its own process: here, whose transformers is missing, where the child's is not."""
    started: list[ExportCheck] = []
    start = ExportCheck.__init__

    def recorded(check: ExportCheck, model_config) -> None:
        start(check, model_config)
        started.append(check)

    monkeypatch.setattr(ExportCheck, "__init__", recorded)
    monkeypatch.setattr(ExportCheck, "expected_here", staticmethod(lambda: True))  # as if the launch said a GPU
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "modeling.hf_export", raising=False)
    reason = "ModuleNotFoundError: import of transformers halted; None in sys.modules"
    with pytest.raises(ConfigError, match=EXPORT_FAILS.format(reason) + "$"):
        setup(tiny_config(prepared_books, tmp_path / "run"))
    assert len(started) == 1 and started[0]._proc.returncode == -signal.SIGKILL  # stopped, not left running


def test_a_failed_export_keeps_the_checkpoints_and_names_the_command_that_exports_them(
    prepared_books, tmp_path, monkeypatch, fresh_accelerate_state
):
    monkeypatch.setitem(sys.modules, "blobfile", None)  # as an image without blobfile: checked, then exported
    run = setup(tiny_config(prepared_books, tmp_path / "run"))
    train_logged(run)
    save_checkpoint(run.accelerator, run.run_dir, 2, 2, {"step": 2}, run.checkpoint_bytes)
    weights = {k: v.clone() for k, v in run.model.state_dict().items()}

    # a fault the start could not see: a file where the export goes, and a folder where it would be moved aside
    (run.run_dir / "export").write_text("a file where the export folder goes")
    (run.run_dir / "export.old").mkdir()
    (run.run_dir / "export.old" / "kept").write_text("not ours to delete")
    run_dir = re.escape(str(run.run_dir))
    with pytest.raises(
        ExportError,
        match=f"^the export to {run_dir}/export failed after training \\((IsADirectory|NotADirectory|OS)Error: .*\\); "
        "the run's "
        f"checkpoints are kept: export the newest \\(the final weights\\) with `python -m training.export {run_dir}`$",
    ):
        write_outputs(run)
    assert [c.name for c in list_checkpoints(run.run_dir)] == ["step-00000002"]
    assert not (run.run_dir / "export.tmp").exists()

    export_main([str(run.run_dir)])  # the command the error names
    exported = load_hf(run.run_dir / "export-step-00000002").state_dict()
    for name, tensor in weights.items():  # the export has GPT-2's 50,257 rows of the padded vocab: its real ids
        assert torch.equal(exported[name][:REAL_VOCAB_SIZE], tensor[:REAL_VOCAB_SIZE]), name

    (run.run_dir / "export").unlink()  # the fault gone, the end of the run writes its export/ and model card
    write_outputs(run)
    tokenizer = AutoTokenizer.from_pretrained(run.run_dir / "export")
    text = "The end of a run:  ünïcödé\n\n<|endoftext|>"
    assert tokenizer(text)["input_ids"] == get_encoding().encode(text, allowed_special="all")
    assert "| optimizer steps | 2 |" in (run.run_dir / "export" / "README.md").read_text()
    assert export_step(run.run_dir / "export") == export_step(run.run_dir / "export-step-00000002") == 2  # the push's
    # safetensors 0.8 creates its files 0600: the weights were their writer's alone, the files beside them not
    for folder, beside in (
        (checkpoint_dir(run.run_dir, 2), "meta.json"),
        (run.run_dir / "export-step-00000002", "config.json"),
        (run.run_dir / "export", "config.json"),
    ):
        modes = [stat.S_IMODE((folder / name).stat().st_mode) for name in ("model.safetensors", beside)]
        assert modes[0] == modes[1] and modes[0] & stat.S_IRGRP, (folder, [oct(m) for m in modes])


def test_a_swap_killed_while_removing_the_old_copy_does_not_block_the_next(tmp_path):
    """A kill inside swap_in's last step leaves export/ whole and export.old/ half removed: the next export (a
    resumed run's end) replaces export/ and clears that leftover instead of failing on it at every run's end."""
    for name, text in (("export", "the export"), ("export.old", "half removed"), ("export.tmp", "the new export")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    swap_in(tmp_path / "export.tmp", tmp_path / "export")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert (tmp_path / "export" / "config.json").read_text() == "the new export"


def test_a_run_that_scores_no_task_writes_no_evals_plot(prepared_books, tmp_path, capsys, fresh_accelerate_state):
    """--eval-tasks with --eval-interval 0 (no val evals, so no scores; the start-up warns: test_loop.py): the run's
    end wrote an empty evals.png and listed it among its outputs."""
    cfg = dataclasses.replace(tiny_config(prepared_books, tmp_path / "run"), eval_tasks="hellaswag", export_hf=False)
    run = setup(cfg)
    train_logged(run)
    write_outputs(run)
    assert (run.run_dir / "loss.png").is_file() and not (run.run_dir / "evals.png").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"run folder: {run.run_dir} (checkpoints: 0, loss.png)"
