"""scripts/gpu_first_light.sh: its --dry-run (the GPU steps at toy sizes on the CPU) runs end to end and writes every
figure and log, so the GPU's minutes go to measuring; bad input is one clear line."""

import json
import math
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from evals.data import provision
from testkit import REPO, TRAIN_ACCEL, WarmLaunches, run

pytestmark = pytest.mark.slow
SCRIPT = str(REPO / "scripts" / "gpu_first_light.sh")
# in the script's order (its ALL_STEPS)
STEPS = ["environment", "tests", "train", "recipe", "fp8", "ladder", "loss", "nccl", "hellaswag", "cpu"]
STEPS += ["cpu_speed", "gpus", "fsdp"]
# the `python -m MODULE` commands of the tests, recipe, ladder, loss, hellaswag and cpu_speed steps (the cpu step's
# pytest has a folder of its own on PYTHONPATH: a fresh interpreter)
MODULES = ("pytest", "bench.time_to_loss", "bench.ladder", "bench.loss_speed", "evals", "bench.profile")


@pytest.fixture
def warm_python(tmp_path: Path) -> Iterator[tuple[dict[str, str], WarmLaunches]]:
    """(the script's environment, its server): its PYTHON asks a warm launch server first (testkit.WarmLaunches), so
    its `accelerate launch` commands, their train_accel.py runs, its bench and evals modules and the tests step's
    pytest are forks of a server that has done their imports, 2-5 s of CPU less each, and picked inductor's CPU vector
    ISA once for those that compile. Every other command it gives PYTHON (the cpu step's pytest, the environment
    check, the probe script) starts a fresh interpreter."""
    python = tmp_path / "python"  # named before the server starts: its environment is the script's, PYTHON too
    # bash's own variables as the script's commands have them: SHLVL 1 (none before), OLDPWD the folder it starts in
    env = {k: v for k, v in os.environ.items() if k != "SHLVL"}
    env |= {"PYTHON": str(python), "PWD": str(REPO), "OLDPWD": str(REPO)}
    exported = {**env, "SHLVL": "1", "PYTHONUNBUFFERED": "1"}  # the script's export
    with WarmLaunches(TRAIN_ACCEL, exported, MODULES, compile_ready=True) as warm:
        env = warm.for_ranks(env)
        python.symlink_to(warm.python)
        yield env, warm


def test_dry_run_writes_every_figure_and_log(prepared_books, tmp_path, warm_python):
    provision()  # the HellaSwag step reads the eval data from the cache
    out = tmp_path / "first light"  # a space in the path too
    env, warm = warm_python
    # warm copies: the launches of the train, fp8, nccl (2) and fsdp steps, and their runs but the nccl probe script;
    # the tests step's pytest, the six bench and evals commands
    with warm.forking(9 + 7):
        result = run([SCRIPT, str(out), "--dry-run", "--data-dir", str(prepared_books)], timeout=900, env=env)
    summary = (out / "summary.md").read_text()
    for i, name in enumerate(STEPS, 1):
        assert f"| {i} {name} | ok |" in summary, summary
        assert (out / f"{i:02d}-{name}.log").is_file()
    assert "summary:" in result.stdout.splitlines()[-1]
    # the train step's micro-batch auto (the CPU default, 8, divides tiny_cpu.yaml's 16 sequences) and start-up line
    assert "micro-batch: auto -> 8 (the CPU default on cpu, not probed; accumulation 2)" in summary, summary
    assert "start-up: " in summary and "first step + compile" in summary, summary
    assert "torch.compile's build tools (cpu): found" in (out / "01-environment.log").read_text()
    assert "2 passed, 1 skipped" in (out / "02-tests.log").read_text()  # the verdict test's CUDA case skips here
    # the recipe step: both recipes' curves, the table against AdamW + cosine's final val loss in summary.md
    recipe = json.loads((out / "recipe" / "curves.json").read_text())
    assert sorted(c["recipe"] for c in recipe["curves"]) == ["adamw-cosine", "default"]
    assert (
        recipe["targets"]["val_loss"]
        == next(c for c in recipe["curves"] if c["recipe"] == "adamw-cosine")["val_loss"][-1]
    )
    assert "| adamw-cosine | 1 |" in summary, summary
    # the fp8 step: the head stays off on the CPU, said in one line; no export, and the last line does not claim one
    fp8_log = (out / "05-fp8.log").read_text()
    assert "note: fp8_head is off on cpu" in summary, summary
    assert fp8_log.rstrip().endswith("(checkpoints: 1, loss.png)") and not (out / "fp8" / "export").exists()
    assert (out / "nccl_backend.txt").read_text().startswith("distributed_type DistributedType.MULTI_CPU, backend gloo")
    # the fsdp step: FSDP2 in one process, its sharded checkpoint and the export gathered from it
    assert "## 13-fsdp.log" in summary and "## fsdp/metrics.jsonl" in summary, summary
    assert (out / "fsdp" / "checkpoints" / "step-00000002" / "pytorch_model_fsdp_0").is_dir()
    # the train step compiles per block, as the GPU YAMLs do (dynamo's eager backend here), said in its section
    train = summary[summary.index("## 03-train.log") :]
    assert "\ndynamo EAGER per block\n" in train, summary
    # and the recompiles dynamo logs under the step's TORCH_LOGS (its per-block wrapper's, at new input kinds)
    assert "[__recompiles] Recompiling function" in train[: train.index("\n## ", 1)], summary
    for f in ("train/metrics.jsonl", "train/loss.png", "train/export/config.json", "nccl/metrics.jsonl",
              "fsdp/export/config.json"):  # fmt: skip
        assert (out / f).is_file(), f
    ladder = json.loads((out / "ladder" / "ladder.json").read_text())
    assert [r["label"] for r in ladder["rows"] if r["status"] == "ok"] == ["0", "11"]
    loss = json.loads((out / "loss" / "loss_speed.json").read_text())["rows"]
    plain = loss["F.cross_entropy, full logits"]["loss"]
    assert len(loss) == 4 and all(math.isclose(r["loss"], plain, rel_tol=1e-3) for r in loss.values())
    assert json.loads((out / "hellaswag.json").read_text())["examples"] == {"hellaswag": 4}
    # the cpu step: the CPU named, each test's result on its own line, the totals in summary.md
    assert (
        "\nISA: " in summary
        and "test_all_targets_ignored_is_nan_with_zero_grads_like_cross_entropy PASSED"
        in (out / "10-cpu.log").read_text()
    )
    assert re.search(r"^=+ 1 passed", summary, re.MULTILINE), summary
    # the CPU step's speed: rung 11 in bf16, its table in summary.md
    cpu_speed = json.loads((out / "cpu_speed" / "ladder.json").read_text())
    assert [(r["label"], r["status"]) for r in cpu_speed["rows"]] == [("11", "ok")]
    assert "## cpu_speed/ladder.md" in summary and "cpu_bf16.yaml" in summary, summary
    # on which CPUs: whether its two threads share a physical core (and its matmul units) is in summary.md
    assert re.search(r"## cpu_speed: the CPU .*\n\n.*\n.*\nISA: .*\ncpu0: core siblings \S+\ncpu1: ", summary), summary
    # and where its time goes: bench.profile's table of the step's matmuls, each with its time within the step
    assert "## cpu_speed/profile.md" in summary and "| matmul | dtype | calls/step | ms in step |" in summary, summary
    # its MFU against the ladder's peak (one thread's matmul rate x 2), the figure the CPU speed target is set in
    profile_mfu = (out / "cpu_speed" / "profile.md").read_text().splitlines()[-1]
    assert profile_mfu.startswith("MFU: ") and f"({cpu_speed['peak_tflops_source']['bf16']})" in profile_mfu
    # and whether that peak, one thread's rate x 2, is within reach of two threads multiplying at once
    assert "\nthreads at once: 2 threads, each multiplying 512x512 bf16 matrices of its own, " in summary, summary
    assert profile_mfu.endswith(" GFLOP/s at once"), profile_mfu
    with tarfile.open(out / "first_light.tgz") as tar:
        names = tar.getnames()
    assert "./summary.md" in names and "./ladder/ladder.json" in names and "./train/metrics.jsonl" in names
    assert not any(n.endswith(".safetensors") or "/checkpoints" in n for n in names)  # no weights in the pack


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give the output folder first"),
        (["OUT", "--data-dir", "no/such/folder"], "no/such/folder (manifest.json): prepare it where there is network"),
        (["OUT", "--bogus"], "unknown argument --bogus"),
        (["FULL"], "is not empty: give a new folder (nothing in it is replaced)"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, args, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "summary.md").write_text("an earlier run")
    args = [str(tmp_path / a.lower()) if a in ("OUT", "FULL") else a for a in args]
    result = subprocess.run([SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: ") and message in last
    assert not (tmp_path / "out").exists()  # nothing written
    assert (tmp_path / "full" / "summary.md").read_text() == "an earlier run"  # nor replaced


def test_an_unknown_step_is_one_line_before_anything_runs(tmp_path):
    env = {**os.environ, "FIRST_LIGHT_STEPS": "train trian"}
    result = subprocess.run(
        [SCRIPT, str(tmp_path / "out"), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.splitlines()[-1].startswith("error: unknown step trian in FIRST_LIGHT_STEPS (the steps: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_without_a_gpu_the_gpu_checks_are_one_line_naming_the_dry_run(tmp_path):
    # as the README's results table gives it: no --dry-run, so GPT-2 124M on a GPU; here it would train on the CPU
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    env = {**os.environ, "PYTHON": sys.executable, "FIRST_LIGHT_STEPS": "train fp8", "TRAIN_STEPS": "40"}
    cmd = [SCRIPT, str(tmp_path / "out"), "--data-dir", str(data)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    last = result.stderr.splitlines()[-1]
    assert last.startswith("error: no CUDA GPU here: torch ") and last.endswith("--dry-run runs them on the CPU"), last


def test_steps_past_the_time_limit_are_stopped_or_skipped_and_the_pack_still_written(prepared_books, tmp_path):
    """A device call has a hard limit: the script stops the step running at --time-limit, skips the rest, and
    still packs what there is. Relative paths are the caller's."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    cmd = [SCRIPT, "out", "--dry-run", "--data-dir", str(prepared_books), "--time-limit", "16"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    summary = (out / "summary.md").read_text()
    for i, name in enumerate(STEPS[2:], 3):  # the environment check alone takes most of 16 s
        assert f"| {i} {name} | skipped: --time-limit reached |" in summary, summary
    with tarfile.open(out / "first_light.tgz") as tar:
        assert "./summary.md" in tar.getnames()
