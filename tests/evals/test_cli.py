"""The evals, evals.generate and evals.bench CLIs in process: run folders and exports, generation, errors, plot."""

import re
import shutil

import pytest
import torch

from data_prep.tokenizer import get_encoding, gpt2_vocab_and_merges
from evals import EvalError
from evals.__main__ import main as evals_main
from evals.bench import main as bench_main
from evals.generate import generate_text
from evals.generate import main as generate_main
from evals.loading import load_model
from evals.plot import plot_evals
from evals.runner import run_task
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from testkit import TINY_MODEL, new_run, write_checkpoint
from training.checkpoint import checkpoint_dir
from training.metrics import JSONLTracker


def test_checkpoint_and_export_load_the_same_model(tiny_run, tmp_path):
    model, source = load_model(tiny_run, checkpoint=checkpoint_dir(tiny_run, 1))
    assert source.endswith("step-00000001 (model.safetensors)") and model.config.block_size == 32
    by_name, _ = load_model(tiny_run, checkpoint="step-00000001")  # as `--checkpoint step-00000001` (and export's)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), by_name.state_dict().values(), strict=True)
    )
    export = export_hf(model, tmp_path / "export", gpt2_vocab_and_merges())
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
    # checked before the model loads (which would fail here first)
    with pytest.raises(SystemExit, match="--max-new-tokens must be positive, got 0"):
        generate_main(["--run", str(tiny_run / "nowhere"), "--max-new-tokens", "0"])


@pytest.mark.parametrize("prompt_tokens", [0, 30, 70])  # a new document; within block_size (64); past it
def test_bench_times_generation_as_the_generate_cli_samples(prompt_tokens, capsys):
    bench_main(["--preset", "tiny-cpu", "--generate", "6", "--prompt-tokens", str(prompt_tokens)])
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"tiny-cpu on cpu \(\d+ threads, fp32\): 6 tokens after {prompt_tokens} in [\d.]+ s = "
                        r"[\d.]+ tokens/s", line), line  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "lambda"], "unknown eval task 'lambda': did you mean 'lambada'?"),
        (["--checkpoint", "nowhere"], "checkpoint nowhere does not exist; "),
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
    write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(other, 1))
    with pytest.raises(EvalError, match=r"step-00000001 does not fit the model that .*config.yaml describes"):
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
