"""End-to-end training on CPU (tiny preset, real books): through the real `accelerate launch` where its YAML decides
something (compile, precision, processes), as `python train_accel.py` for one eager fp32 process."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import testkit
from modeling.config import REAL_VOCAB_SIZE
from modeling.device import X86
from testkit import copy_isa_probes, launch, train_cmd
from training.config import TrainConfig
from training.metrics import read_metrics
from training.optim import lr_multiplier

pytestmark = pytest.mark.slow


def losses(run_dir: Path) -> list[float]:
    return [r["train_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train_loss" in r]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    return load_file(newest / "model.safetensors")


# The README path's schedule at tiny size: 30 steps of 1,024 tokens (micro-batch 8 x 2 accumulation); val loss
# falls from 10.8 to about 7 (half a second a step, compiled, on a 2-core Zen 3).
README_RUN = ["--max-steps", "30", "--micro-batch-size", "8", "--total-batch-tokens", "1024", "--lr", "3e-3",
              "--warmup-steps", "5", "--log-interval", "10"]  # fmt: skip


@pytest.fixture(scope="module")
def readme_run(prepared_books, tmp_path_factory) -> tuple[Path, str]:
    """cpu.yaml (fp32 + inductor) as the README launches it, with evals, samples and the HF export."""
    run = tmp_path_factory.mktemp("readme") / "run"
    cmd = train_cmd(
        "cpu.yaml", run, prepared_books, *README_RUN, "--eval-interval", "15", "--eval-windows", "32",
        "--sample-interval", "30", "--export-hf", "true", "--eval-tasks", "hellaswag", "--eval-limit", "8",
        "--sample-prompt", "<|endoftext|>ROMEO:",  # the separator in a prompt, as transformers reads it
    )  # fmt: skip
    # The run's compile cache: a user's folder holding only this process's ISA subfolder (set by conftest), linked
    # to the warm one, so its graphs hit (~35 s of C++ builds otherwise) and whatever else it writes stays beside,
    # and the ISA probe programs conftest's set-up built beside that subfolder (~10 s of builds otherwise).
    users = run.parent / "inductor"
    isa_folder = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    isa_folder.mkdir(parents=True, exist_ok=True)  # on a new machine nothing may have compiled yet
    copy_isa_probes(isa_folder.parent, users)
    (users / isa_folder.name).symlink_to(isa_folder, target_is_directory=True)
    result = testkit.run(cmd, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(users)})
    return run, result.stdout


def test_cpu_yaml_trains_tiny_model_compiled(readme_run):
    """The README path: cpu.yaml (fp32 + inductor). Val loss falls well below its start; export loads."""
    run, stdout = readme_run
    assert "fp32, dynamo INDUCTOR |" in stdout  # the whole model compiled, not "per block"
    # the start-up on one line, and as the first step's row (training.metrics.StartupClock)
    assert re.search(
        r"^start-up: [\d.]+ s to the first step \(python \+ imports [\d.]+, .*step-0 eval [\d.]+, "
        r"first step \+ compile [\d.]+, other [\d.]+\)$",
        stdout,
        re.MULTILINE,
    ), stdout
    (startup,) = [r for r in read_metrics(run / "metrics.jsonl") if "time_to_first_step_s" in r]
    assert startup["step"] == 1 and startup["startup_step0_eval_s"] > 0 and startup["startup_first_step_s"] > 0
    # compiled in the subfolder of this process's vector ISA (training.compile_cache): not in the user's folder, nor
    # in another ISA's subfolder
    users, isa_folder = run.parent / "inductor", Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).name
    assert not (users / "fxgraph").exists() and [p.parent.name for p in users.glob("*/fxgraph")] == [isa_folder]
    val = {r["step"]: r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r}
    assert sorted(val) == [0, 15, 30]
    scores = [r["hellaswag_acc_norm"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    assert len(scores) == 3 and all(0 <= s <= 1 for s in scores)  # benchmark scored at every eval
    assert val[0] > 10.0  # ~ln(50257) at init
    # the last step's lr is the one its update used, in the wsd decay's last step (the next one's would be the floor)
    last_lr = [r["lr"] for r in read_metrics(run / "metrics.jsonl") if r["step"] == 30 and "lr" in r]
    assert last_lr == [pytest.approx(3e-3 * lr_multiplier(29, TrainConfig(warmup_steps=5), 30))]
    assert val[30] < val[0] - 2.0, val
    assert (run / "loss.png").stat().st_size > 0
    assert "--- step 30 ---\n<|endoftext|>ROMEO:" in (run / "samples.txt").read_text()
    card = (run / "export" / "README.md").read_text()  # the model card: the steps, and where and how they ran
    assert "| optimizer steps | 30 |" in card and re.search(r"\| hardware \| 1 × CPU: .*, fp32, torch.compile \|", card)
    assert "| val loss measured on | 32 windows × 64 tokens (2,048 tokens) spread evenly over the val split |" in card

    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(run / "export")
    assert hf.config.n_layer == 2 and hf.config.vocab_size == 50257


# bf16 matmuls run at ~1 GFLOP/s on CPUs without native bf16 (AVX2-only): 128-token steps, no evals, keep it short.
# One block: the bf16 graph is compiled for this test alone, and CI's empty compile cache built two blocks' for ~8 s
# of CPU more. AdamW: Muon's Newton-Schulz runs in bf16 under bf16 and in fp32 under fp32, which would move the
# curves apart more than autocast's rounding does.
BF16_RUN = ["--n-layer", "1", "--max-steps", "6", "--micro-batch-size", "2", "--total-batch-tokens", "128",
            "--lr", "3e-3", "--warmup-steps", "2", "--log-interval", "1", "--eval-interval", "0",
            "--optimizer", "adamw"]  # fmt: skip


def test_cpu_bf16_yaml_autocasts_with_fp32_master_weights(prepared_books, tmp_path):
    """cpu_bf16.yaml: bf16 autocast, not a bf16 cast of the weights; the same curve as fp32 within bf16 noise."""
    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    stdout = launch("cpu_bf16.yaml", bf16, prepared_books, *BF16_RUN).stdout
    assert "bf16 mixed precision, dynamo INDUCTOR" in stdout
    weights = final_weights(bf16)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    launch(None, fp32, prepared_books, *BF16_RUN)
    fp32_losses = torch.tensor(losses(fp32))
    assert len(fp32_losses) == 6
    # bf16 rounding (8 mantissa bits) moves the curve by well under 2%; a wrong cast or skipped steps would not
    torch.testing.assert_close(torch.tensor(losses(bf16)), fp32_losses, rtol=0.02, atol=0.0)
    assert fp32_losses[-1] < fp32_losses[0] - 0.5


@pytest.mark.skipif(not X86, reason="AVX2 emulation: x86 only")
def test_bf16_on_a_cpu_without_native_bf16_is_warned_whatever_mfu_peak_is_given(prepared_books, tmp_path):
    """An AVX2-only CPU (emulated on any x86 one), where bf16 matmuls are 30-300x slower than fp32: the start-up
    warning names the fp32 YAML though the run gives its MFU peak (train_cmd's --peak-tflops), which spares fp32
    runs the probe. Eager: under emulation a bf16 compile takes a minute."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    # one step of one 64-token window: the warning is the start-up's, and the step's emulated bf16 matmuls (~1.3
    # GFLOP per 64 tokens at tiny-cpu) run at ~1 GFLOP/s on an AVX2-only CPU
    cmd = train_cmd(
        "cpu_bf16.yaml", tmp_path / "run", prepared_books, "--max-steps", "1", "--warmup-steps", "0",
        "--total-batch-tokens", "64", "--micro-batch-size", "1", "--eval-interval", "0", "--eval-windows", "8",
        launch_args=["--dynamo_backend", "no"],
    )  # fmt: skip
    assert "--peak-tflops" in cmd
    # the launcher and the run in copies of a server whose imports saw this ISA: testkit.WARM's would start two fresh
    # interpreters for it
    with testkit.WarmLaunches(env=env) as warm:
        stdout = testkit.run(cmd, env=env, timeout=300, warm=warm).stdout
    assert "warning: this CPU has no native bf16 matmuls: bf16 runs " in stdout
    assert "set mixed_precision: 'no' (fp32) in the launch YAML instead (accelerate_configs/cpu.yaml for one" in stdout


@pytest.fixture(scope="module")
def batch_layout_runs(prepared_books, tmp_path_factory):
    """Three runs over the same 10 × 1024-token global batches, laid out differently, with the default optimizer
    (Muon for the blocks' matrices, AdamW for the rest, so both update rules see each layout's gradients); val loss
    at steps 0 and 10 on 21 windows (neither micro-batch size nor 2 ranks divide it: filler rows on every
    layout); the DDP one exports. `--optimizer adamw` alone is checked on these layouts by test_ddp_compile.py
    (DDP with accumulation == one process) and test_sharded.py (its DDP run against the sharded engines)."""
    root = tmp_path_factory.mktemp("layouts")
    common = ["--max-steps", "10", "--total-batch-tokens", "1024", "--log-interval", "1", "--eval-interval", "10",
              "--eval-windows", "21", "--checkpoint-interval", "0", "--lr", "3e-3", "--warmup-steps", "2"]  # fmt: skip
    runs = {
        "1proc_mb4_x4": launch(None, root / "a", prepared_books, "--micro-batch-size", "4", *common),
        "1proc_mb16_x1": launch(None, root / "b", prepared_books, "--micro-batch-size", "16", *common),
        "2proc_mb4_x2": launch(
            "cpu_ddp2.yaml", root / "c", prepared_books, "--micro-batch-size", "4", *common, "--export-hf", "true"
        ),
    }
    assert "4 accumulation × 1 = 1,024" in runs["1proc_mb4_x4"].stdout
    assert (
        "2 process(es)" in runs["2proc_mb4_x2"].stdout and "2 accumulation × 2 = 1,024" in runs["2proc_mb4_x2"].stdout
    )
    groups = (
        "Muon lr 0.02 momentum 0.95, Newton-Schulz in float32: 8 tensors muon (wd 0.1); AdamW lr 0.003: 2 tensors decay"
    )
    assert groups in runs["2proc_mb4_x2"].stdout  # the start-up line names both update rules
    return {"1proc_mb4_x4": root / "a", "1proc_mb16_x1": root / "b", "2proc_mb4_x2": root / "c"}


def assert_same_weights(got: Path, want: Path) -> None:
    """fp32: equal up to summation order, with Muon too (fp32 runs orthogonalize Muon's updates in fp32;
    in bf16, as torch.optim.Muon does, its steep Newton-Schulz polynomial amplified those differences to 3.3% of a
    tensor's norm after 10 steps; in fp32 they stay under 6e-5)."""
    want_weights = final_weights(want)
    for name, w in final_weights(got).items():
        torch.testing.assert_close(w, want_weights[name], rtol=1e-3, atol=1e-4, msg=name)


def test_gradient_accumulation_matches_one_big_micro_batch(batch_layout_runs):
    """micro-batch 4 × accumulation 4 == micro-batch 16 × 1 on the same tokens (fp32; summation order only)."""
    runs = batch_layout_runs
    a, b = runs["1proc_mb4_x4"], runs["1proc_mb16_x1"]
    assert len(losses(a)) == 10
    torch.testing.assert_close(torch.tensor(losses(a)), torch.tensor(losses(b)), rtol=1e-4, atol=1e-4)
    assert_same_weights(a, b)


def test_ddp_two_processes_match_one_process_with_double_accumulation(batch_layout_runs):
    """Real 2-process gloo DDP (mb 4 × accum 2 × 2 ranks) == 1 process (mb 4 × accum 4): same curve and weights."""
    runs = batch_layout_runs
    one, two = runs["1proc_mb4_x4"], runs["2proc_mb4_x2"]
    torch.testing.assert_close(torch.tensor(losses(two)), torch.tensor(losses(one)), rtol=1e-4, atol=1e-4)
    assert_same_weights(two, one)
    # and the curve is not trivially flat: training happened
    assert losses(one)[-1] < losses(one)[0] - 0.5


def test_export_holds_the_trained_weights(batch_layout_runs):
    """The export (transformers GPT-2) of a DDP run loads back into our GPT as exactly its last checkpoint (the
    embedding/head's 50,257 real rows: GPT-2 has no padded ones)."""
    from modeling.hf_export import load_hf

    run = batch_layout_runs["2proc_mb4_x2"]
    exported = load_hf(run / "export").state_dict()
    for name, w in final_weights(run).items():
        assert torch.equal(exported[name][:REAL_VOCAB_SIZE], w[:REAL_VOCAB_SIZE]), name


def val_losses(run_dir: Path) -> list[float]:
    return [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]


def test_val_loss_is_the_same_on_any_layout(batch_layout_runs):
    """One set of val windows whatever the number of processes and the micro-batch size: at step 0 (the same
    weights) the val losses agree to fp32 summation order, and after 10 steps as the weights do."""
    runs = [val_losses(run) for run in batch_layout_runs.values()]
    assert all(len(v) == 2 for v in runs)
    for other in runs[1:]:
        torch.testing.assert_close(other[0], runs[0][0], rtol=1e-6, atol=0.0)
        torch.testing.assert_close(other[1], runs[0][1], rtol=1e-4, atol=1e-4)
    assert runs[0][1] < runs[0][0] - 0.5


def test_init_from_an_export_starts_from_its_weights(readme_run, prepared_books, tmp_path):
    """--init-from a run's export/ (nanoGPT's init_from): the first step's loss is the export's own loss on that
    batch, and the run continues from there; a run from scratch starts near ln(50257)."""
    export = readme_run[0] / "export"
    run = tmp_path / "continued"
    args = ["--max-steps", "2", "--micro-batch-size", "8", "--total-batch-tokens", "512", "--log-interval", "1",
            "--eval-interval", "0", "--export-hf", "true", "--init-from", str(export)]  # fmt: skip
    result = launch(None, run, prepared_books, *args)
    # transformers' progress bars, reading the export and writing the new one: every rank of a launch drew its own
    assert "Loading weights" not in result.stderr and "Writing model shards" not in result.stderr

    from data_prep.loader import TokenLoader
    from modeling.hf_export import load_hf
    from training.config import TrainConfig

    model = load_hf(export)
    x, y = next(iter(TokenLoader(prepared_books, "train", 64, 8, seed=TrainConfig().seed)))
    with torch.no_grad():
        _, want = model(x, y)
    got = losses(run)
    assert want.item() < 8.0  # the export learned something: a random init would be ~10.8
    assert got[0] == pytest.approx(want.item(), rel=1e-5)
    card = (run / "export" / "README.md").read_text()  # the export's card names its run, not the folder's path
    assert f"| model | {readme_run[0].name} (continued)" in card and str(export) not in card, card


def test_a_model_of_ones_own_shape_trains_resumes_and_exports_at_that_shape(prepared_books, tmp_path):
    """nanoGPT's n_layer / n_head / n_embd over the preset, and a context twice the preset's from scratch: the run
    says the model it trains, its relaunch continues at that shape (the config.yaml it reads back), and its export
    is that shape with n_positions = block_size."""
    run = tmp_path / "run"
    args = ["--n-layer", "3", "--n-head", "4", "--n-embd", "48", "--block-size", "128", "--micro-batch-size", "4",
            "--total-batch-tokens", "512", "--log-interval", "1", "--eval-interval", "0",
            "--warmup-steps", "1"]  # fmt: skip
    first = launch(None, run, prepared_books, *args, "--max-steps", "2")
    assert "tiny-cpu with n_layer 3, n_head 4, n_embd 48: " in first.stdout
    assert "4 × 128 tokens × 1 accumulation" in first.stdout
    # the relaunch exports (transformers' import and the export, ~5 s, once): what it trained, read back
    again = launch(None, run, prepared_books, *args, "--max-steps", "3", "--export-hf", "true")
    assert "resumed from" in again.stdout and len(losses(run)) == 3
    exported = json.loads((run / "export" / "config.json").read_text())
    shape = {k: exported[k] for k in ("n_layer", "n_head", "n_embd", "n_positions")}
    assert shape == {"n_layer": 3, "n_head": 4, "n_embd": 48, "n_positions": 128}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_cadences_fire_at_their_steps_whatever_the_optimizer(prepared_books, tmp_path, optimizer):
    """Logs, evals and checkpoints every 2 steps and at the last, with fused AdamW (verdict read a step late) and with
    Muon (read at once): the loop must name the step it just ran either way."""
    run_dir = tmp_path / "run"
    launch(None, run_dir, prepared_books, "--optimizer", optimizer, "--max-steps", "5",
           "--micro-batch-size", "4", "--total-batch-tokens", "256", "--log-interval", "2", "--eval-interval", "2",
           "--eval-windows", "4", "--checkpoint-interval", "2", "--keep-checkpoints", "5")  # fmt: skip
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "train_loss" in r] == [2, 4, 5]
    assert [r["step"] for r in rows if "val_loss" in r] == [0, 2, 4, 5]
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step-*"))] == [
        "step-00000002", "step-00000004", "step-00000005"
    ]  # fmt: skip


def test_make_train_in_a_terminal_draws_one_full_bar_below_the_runs_lines(prepared_books, tmp_path):
    """In a terminal, `make train`'s progress bar is as wide as tqdm draws on one (a column short of it), and the lines
    the run prints while it is up (start-up, evals, the first save) go above it, each on lines of its own. Under
    accelerate 1.16 the one-process launcher passes the run's stderr through a pipe: a bar drawn there was 10
    characters wide, with each such line glued to its end."""
    # 256-token steps: the recipe's configs/cpu_small.yaml would make each 8,192 (16 micro-batches), ~8 s of
    # steps that have nothing to do with the bar either
    args = train_cmd(None, tmp_path / "run", prepared_books, "--max-steps", "4", "--time-budget-minutes", "0",
                     "--micro-batch-size", "4", "--total-batch-tokens", "256", "--eval-interval", "2",
                     "--eval-windows", "4", "--checkpoint-interval", "0")[2:]  # fmt: skip
    # the recipe as it is, launching eager unpicked (the picked YAML compiles: ~30 s unrelated to the bar)
    recipe = testkit.make_train_recipe(yaml="cpu_eager.yaml")
    status, screen = testkit.run_in_terminal(["bash", "-c", f"{recipe} {shlex.join(args)}"], columns=100)
    lines = testkit.rendered(screen, columns=100)
    assert status == 0, "\n".join(lines)
    bars = [line for line in lines if re.match(r" *\d+%\|", line)]
    assert len(bars) == 1 and " 4/4 [" in bars[0] and len(bars[0]) == 99, "\n".join(lines)
    at = lines.index(bars[0])
    for start in ("step 2: val_loss ", "step 4: val_loss ", "checkpoint saved in "):
        assert any(line.startswith(start) for line in lines[:at]), "\n".join(lines)
    assert lines[at + 1].startswith("run folder: "), "\n".join(lines)


def test_make_train_with_a_config_in_args_trains_that_config_alone():
    """make train ARGS="--config configs/tiny_cpu.yaml": the recipe gave configs/cpu_small.yaml itself, and the run
    stopped at once with "--config is given 2 times". A --config in ARGS (or --config=PATH) replaces the default."""
    recipe = testkit.make_train_recipe(args="--config configs/tiny_cpu.yaml --print-config", yaml="cpu_eager.yaml")
    result = subprocess.run(["bash", "-c", recipe], cwd=testkit.REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert yaml.safe_load(result.stdout)["preset"] == "tiny-cpu", result.stdout
    flags = {args: testkit.make_train_recipe(args=args).split("train_accel.py")[1].split() for args in ("", "--lr 1")}
    assert flags[""] == ["--config", "configs/cpu_small.yaml"] and flags["--lr 1"] == [*flags[""], "--lr", "1"]
    given = testkit.make_train_recipe(args="--config=configs/tiny_cpu.yaml")
    assert given.split("train_accel.py")[1].split() == ["--config=configs/tiny_cpu.yaml"], given


def test_a_log_of_stdout_and_stderr_together_holds_each_line_whole(prepared_books, tmp_path):
    """SLURM's job output (no --error), `docker logs` and nohup take the run's stdout and stderr into one file. tqdm
    redrew its bar there by carriage returns and the run's lines (start-up, evals) landed on the bar's text: the
    progress is a line of its own at each log step instead, with the bar's figures."""
    cmd = train_cmd(None, tmp_path / "run", prepared_books, "--max-steps", "4", "--micro-batch-size", "4",
                    "--total-batch-tokens", "256", "--log-interval", "2", "--eval-interval", "2", "--eval-windows", "4",
                    "--checkpoint-interval", "0")  # fmt: skip
    log = tmp_path / "job.out"
    with log.open("wb") as out, testkit.WARM.forking(1):  # a warm copy, whose stdout and stderr were this file
        testkit.run(cmd, timeout=300, output=out)
    text = log.read_bytes().decode()  # as written: read_text() would turn carriage returns into newlines
    assert "\r" not in text, text
    lines = text.splitlines()
    for start in ("start-up: ", "step 2/4 (50%) [", "step 2: val_loss ", "step 4/4 (100%) [", "step 4: val_loss "):
        assert sum(line.startswith(start) for line in lines) == 1, text
    assert all(", loss=" in line and ", tok_s=" in line for line in lines if re.match(r"step \d+/4 ", line)), text
    assert lines[-1].startswith("run folder: "), text
