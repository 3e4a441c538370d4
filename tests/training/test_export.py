"""python -m training.export on a run folder's checkpoints (the sharded engines' are in tests/e2e/test_sharded.py)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2LMHeadModel

from evals.loading import load_model
from modeling import fused_ce
from modeling.config import REAL_VOCAB_SIZE
from modeling.gpt import GPT
from modeling.hf_export import load_hf, to_hf_state_dict
from testkit import TINY_MODEL, new_run, run
from training import export
from training.checkpoint import checkpoint_dir, save_checkpoint
from training.export import export_checkpoint
from training.export import main as export_main
from training.optim import build_optimizer
from training.step import Trainer


@pytest.mark.slow  # runs `python -m training.export`
def test_export_of_an_older_checkpoint_has_its_weights(tiny_run):
    """The command prints its one line and nothing else: no DeepSpeed warning that it found no GPU (save_pretrained
    imports DeepSpeed where installed) and no progress bar for the one file."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # as in a user's shell
    result = run([sys.executable, "-m", "training.export", str(tiny_run), "--checkpoint", "step-00000001"], env=env)
    out = tiny_run / "export-step-00000001"
    assert result.stdout == f"checkpoint {checkpoint_dir(tiny_run, 1)} (model.safetensors) -> {out}\n"
    assert result.stderr == ""
    want = to_hf_state_dict(load_model(tiny_run, checkpoint_dir(tiny_run, 1))[0])  # the real vocab rows
    for name, tensor in to_hf_state_dict(load_hf(out)).items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    assert not (tiny_run / "export").exists()  # the run's own export is never written by it


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{run}", "--checkpoint", "step-00000009"], r"checkpoint .*step-00000009 does not exist; .* has step-0000000"),
        (["{run}", "--out", "{run}/checkpoints"], r".*checkpoints already exists; remove it or choose another --out"),
        # a folder evals and a resume would then take for the run's newest checkpoint
        (["{run}", "--out", "{run}/checkpoints/step-00000009"], r".*step-00000009 is in the run's checkpoints/, where"),
        (["{run}", "--out", "{run}/config.yaml/x"], r"cannot write .*/x: .*config.yaml is a file; choose another"),
        (["{run}/config.yaml"], r"run folder .*config.yaml is a file$"),
        # a checkpoint as the run folder: it said the checkpoint "has no checkpoint (checkpoints/step-NNNNNNNN/)"
        (
            ["{run}/checkpoints/step-00000002"],
            r"\S+/checkpoints/step-00000002 is a checkpoint of the run \S+, not a run folder: give python -m "
            r"training.export \S+ --checkpoint step-00000002$",
        ),
    ],
)
def test_bad_arguments_are_one_clear_error(tiny_run, argv, message):
    with pytest.raises(SystemExit, match=f"^error: {message}"):
        export_main([a.format(run=tiny_run) for a in argv])


@pytest.mark.parametrize(("inside", "given"), [("step-00000002", "."), ("step-00000001", "../step-00000002")])
def test_a_checkpoint_given_from_inside_the_run_names_its_run(tiny_run, monkeypatch, inside, given):
    """From inside a checkpoint it said ". has no checkpoint (checkpoints/step-NNNNNNNN/) to export"."""
    monkeypatch.chdir(tiny_run / "checkpoints" / inside)
    with pytest.raises(SystemExit) as exc:
        export_main([given])
    assert exc.value.code == (
        f"error: {given} is a checkpoint of the run {tiny_run}, not a run folder: give python -m training.export "
        f"{tiny_run} --checkpoint step-00000002"
    )


def test_the_command_a_checkpoint_is_told_runs_as_given_where_the_path_has_a_space(tiny_run, tmp_path):
    """The command was split at the space of the run's path: 'unrecognized arguments'."""
    run = shutil.copytree(tiny_run, tmp_path / "my runs" / "run", ignore=shutil.ignore_patterns("export-*"))
    with pytest.raises(SystemExit) as exc:
        export_main([str(checkpoint_dir(run, 1))])
    argv = shlex.split(exc.value.code.split(": give ")[1])
    assert argv == ["python", "-m", "training.export", str(run), "--checkpoint", "step-00000001"]
    export_main(argv[3:])
    assert (run / "export-step-00000001" / "config.json").is_file()


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_checkpoint_loads(tiny_run, tmpfs, monkeypatch):
    disk = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.setattr(export, "load_checkpoint", None)  # never reached
    with pytest.raises(SystemExit) as exc:
        export_main([str(tiny_run), "--out", str(disk / "export")])
    assert (
        exc.value.code
        == f"error: cannot write {disk / 'export'}: {disk} is not writable by this user; choose another --out"
    )


@pytest.mark.usefixtures("fp8_matmul", "fresh_accelerate_state")  # tests/conftest.py: torch._scaled_mm runs here
def test_a_bf16_run_with_the_fp8_head_exports_the_fp32_weights_it_trained(tmp_path, monkeypatch):
    """The GPU recipe's precision (bf16 autocast, --fp8-head true on an H100): 2 steps with the head's logits from
    torch._scaled_mm (the full-logits form, taken as on CUDA under compile; on the CPU the fused form ignores fp8),
    a checkpoint, then python -m training.export's export of it. The head stays the tied fp32 embedding matrix, and
    transformers' fp32 logits are the trained model's to float rounding: nothing on the way rounds a weight to bf16
    (2e-3 of the logits here)."""
    monkeypatch.setattr(fused_ce, "takes_full_logits", lambda *args: True)
    run_dir = new_run(tmp_path)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = GPT(TINY_MODEL)
    model.fp8_head = True
    optimizer = build_optimizer(model.optimizer_groups(0.1), lr=3e-3, betas=(0.9, 0.95), device_type="cpu")
    model, optimizer = accelerator.prepare(model, optimizer)
    trainer = Trainer(accelerator, model, optimizer, grad_clip=1.0, tokens_per_step=2 * TINY_MODEL.block_size)
    x = torch.randint(0, REAL_VOCAB_SIZE, (2, TINY_MODEL.block_size), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        trainer.train_step(iter([(x, x.roll(-1, dims=1))]))
    assert trainer.settle() and trainer.progress.step == 2
    save_checkpoint(accelerator, run_dir, 2, keep=1, meta={}, need=0)
    hf = GPT2LMHeadModel.from_pretrained(export_checkpoint(run_dir)).eval()
    trained = accelerator.unwrap_model(model).eval()
    assert trained.lm_head.weight is trained.transformer.wte.weight and trained.lm_head.weight.dtype == torch.float32
    with torch.no_grad():
        ours = trained.lm_head(trained.hidden_states(x))[..., :REAL_VOCAB_SIZE]
        assert (hf(x).logits - ours).abs().max() <= 5e-6 * ours.abs().max()
