"""`python -m evals` and `python -m evals.generate` on run folders: 1 vs 2 processes, loading, errors, plot."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model

from data_prep.tokenizer import get_encoding
from evals import EvalError
from evals.__main__ import main as evals_main
from evals.data import provision
from evals.generate import generate_text
from evals.generate import main as generate_main
from evals.loading import load_model
from evals.plot import plot_evals
from evals.runner import run_task
from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from training.checkpoint import checkpoint_dir
from training.config import TrainConfig, config_to_yaml
from training.metrics import JSONLTracker

REPO = Path(__file__).resolve().parents[1]
MODEL = dataclasses.replace(get_preset("tiny-cpu"), block_size=32)  # the run below overrides block_size


def write_checkpoint(model: torch.nn.Module, folder: Path) -> None:
    """model.safetensors as accelerator.save_state writes it: the tied head/embedding stored once."""
    folder.mkdir(parents=True)
    save_model(model, str(folder / "model.safetensors"))


def new_run(root: Path, preset: str = "tiny-cpu") -> Path:
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config_to_yaml(TrainConfig(preset=preset, block_size=32, out_dir=str(run))))
    return run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run folder as training leaves it: config.yaml and two checkpoints, the newest from a compiled model
    (keys prefixed `_orig_mod.`)."""
    provision()
    run = new_run(tmp_path_factory.mktemp("evals"))
    for step in (1, 2):
        torch.manual_seed(step)
        model = GPT(MODEL)
        write_checkpoint(torch.compile(model) if step == 2 else model, checkpoint_dir(run, step))
    return run


def run_cli(args: list[str], launcher: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*launcher, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_one_and_two_processes_give_identical_results(tiny_run, tmp_path):
    args = ["--run", str(tiny_run), "--tasks", "hellaswag,lambada", "--limit", "12", "--batch-size", "5"]
    one = run_cli([*args, "--json", str(tmp_path / "one.json")], [sys.executable, "-m", "evals"])
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp2.yaml"]
    two = run_cli([*args, "--json", str(tmp_path / "two.json")], [*launch, "-m", "evals"])
    assert "1 process(es)" in one.stdout and "2 process(es)" in two.stdout
    assert "| hellaswag | acc_norm |" in one.stdout and "| lambada | ppl |" in one.stdout
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["source"] == two["source"] == f"checkpoint {checkpoint_dir(tiny_run, 2)}"  # the newest
    assert one["examples"] == two["examples"] == {"hellaswag": 12, "lambada": 12}
    assert one["predictions"] == two["predictions"]
    assert one["metrics"] == two["metrics"]
    # ... and what the library computes in-process from the same checkpoint.
    model, _ = load_model(tiny_run)
    local = run_task(model, "hellaswag", get_encoding(), limit=12)
    assert local.predictions["pred_norm"].tolist() == one["predictions"]["hellaswag"]["pred_norm"]
    assert local.metrics["hellaswag_acc_norm"] == one["metrics"]["hellaswag_acc_norm"]


def test_checkpoint_and_export_load_the_same_model(tiny_run, tmp_path):
    model, source = load_model(tiny_run, checkpoint=checkpoint_dir(tiny_run, 1))
    assert source.endswith("step-00000001") and model.config.block_size == 32
    export = export_hf(model, tmp_path / "export", get_encoding())
    from_export, _ = load_model(export=export)
    for temperature in (0.0, 1.0):
        texts = {generate_text(m, "Once upon a time", 8, temperature, 50, seed=3) for m in (model, from_export)}
        assert len(texts) == 1 and texts.pop().startswith("Once upon a time")
    assert generate_text(model, "", 8, seed=3) == generate_text(model, "", 8, seed=3)
    assert generate_text(model, "", 8, seed=3) != generate_text(model, "", 8, seed=4)

    run = new_run(tmp_path / "only-export")  # a run whose checkpoints were deleted: its export is used
    shutil.copytree(export, run / "export")
    assert load_model(run)[1] == f"export {run / 'export'}"


def test_generate_cli_prints_the_continuation(tiny_run, capsys):
    generate_main(["--run", str(tiny_run), "--prompt", "Hello", "--max-new-tokens", "5", "--top-k", "0"])
    assert capsys.readouterr().out.startswith("Hello")
    with pytest.raises(SystemExit, match="--temperature must be >= 0"):
        generate_main(["--run", str(tiny_run), "--prompt", "Hello", "--temperature", "-1"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "lambda"], "unknown eval task 'lambda': did you mean 'lambada'?"),
        (["--checkpoint", "nowhere"], "nowhere/model.safetensors does not exist; --checkpoint takes"),
    ],
)
def test_cli_bad_arguments_are_one_clear_error(tiny_run, argv, message):
    with pytest.raises(SystemExit) as exc:
        evals_main(["--run", str(tiny_run), "--tasks", "hellaswag", *argv])
    assert str(exc.value.code).startswith("error: ") and message in str(exc.value.code)


def test_bad_limits_are_one_clear_error(tiny_run, capsys):
    with pytest.raises(SystemExit):
        evals_main(["--run", str(tiny_run), "--limit", "0"])
    assert "argument --limit: expected a positive whole number, got '0'" in capsys.readouterr().err
    model, _ = load_model(tiny_run)
    with pytest.raises(EvalError, match="eval limit must be a positive number of examples"):
        run_task(model, "lambada", get_encoding(), limit=0)


def test_run_folder_problems_are_one_clear_error(tmp_path):
    run = new_run(tmp_path)
    with pytest.raises(SystemExit, match=r"error: run folder .* has no checkpoint .*train it first"):
        evals_main(["--run", str(run)])
    with pytest.raises(EvalError, match=r"run folder .*missing does not exist"):
        load_model(tmp_path / "missing")
    other = new_run(tmp_path / "other", preset="small-cpu")  # weights of a tiny-cpu model, config of small-cpu
    write_checkpoint(GPT(MODEL), checkpoint_dir(other, 1))
    with pytest.raises(EvalError, match=r"model.safetensors does not fit the model that .*config.yaml describes"):
        load_model(other)


def test_plot_evals_writes_png(tmp_path):
    tracker = JSONLTracker(tmp_path)
    for step in (10, 20):
        tracker.log({"train_loss": 5.0, "tokens_seen": step * 1024}, step=step)
        # Evals at steps without a train row (eval_interval not a multiple of log_interval).
        tracker.log({"val_loss": 6.0 - step / 10}, step=step + 5)
        tracker.log({"hellaswag_acc_norm": 0.25 + step / 1000, "lambada_acc": 0.01}, step=step + 5)
    out = plot_evals(tmp_path / "metrics.jsonl", tmp_path / "evals.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
