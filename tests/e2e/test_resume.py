"""Never lose a run: SIGKILL + `--resume auto` is exact, partial checkpoints are ignored, SIGTERM saves and exits 0,
non-finite gradients are skipped and then abort cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from safetensors.torch import load_file

from data_prep.manifest import load_manifest
from data_prep.prepare import prepare
from evals.data import provision
from testkit import (
    NEEDS_UNSHARE_PID,
    REPO,
    TRAIN_ACCEL,
    WARM,
    WarmLaunches,
    copy_isa_probes,
    fill_disk,
    hub_endpoint,
    launching,
    make_train_recipe,
    rendered,
    run,
    run_in_terminal,
    through_training_launch,
    train_cmd,
)
from training.checkpoint import checkpoint_damage, list_checkpoints
from training.config import TrainConfig
from training.hub import render_model_card
from training.metrics import read_metrics
from training.optim import decay_start
from training.runlock import LOCK_NAME

pytestmark = pytest.mark.slow

# 512-token optimizer steps from micro-batches of 4, a loss logged every step, no evals.
TINY = ["--eval-interval", "0", "--log-interval", "1", "--micro-batch-size", "4", "--total-batch-tokens", "512",
        "--lr", "3e-3", "--warmup-steps", "2"]  # fmt: skip


def tiny_cmd(accelerate_config: str | None, run_dir: Path, data_dir: Path, *args: str, **launch) -> list[str]:
    return train_cmd(accelerate_config, run_dir, data_dir, *TINY, *args, **launch)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step") or 0 for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def start_until(
    cmd: list[str], ready: Callable[[], bool], env: dict[str, str] | None = None, cwd: Path = REPO, warm: bool = False
) -> subprocess.Popen:
    """Start `cmd` in its own process group (as a terminal runs a job), its stdout and stderr in one pipe, and return
    once ready() holds (still running). warm: its training processes run in copies of the warm launch server
    (testkit.WARM) instead of fresh interpreters (~3 s of imports each): `python train_accel.py` through
    tests/warm_exec.py, which passes the signals it gets on to its copy and whose death kills the copy with SIGKILL,
    and an `accelerate launch`'s ranks alike (PYTHON_EXEC; the launcher itself stays a fresh process). Not where a
    test reads the run's pid (that is the copy's) or needs what a copy does not inherit (ignored signals)."""
    if warm:
        env = WARM.for_ranks(env or os.environ)
        if cmd[:2] == [sys.executable, str(TRAIN_ACCEL)]:
            cmd = [env["PYTHON_EXEC"], *cmd[1:]]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not ready():
        assert proc.poll() is None, f"ended before it was ready:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "too slow"
        time.sleep(0.01)
    return proc


def start_and_wait(
    cmd: list[str], run_dir: Path, until_step: int, env: dict[str, str] | None = None, warm: bool = False
) -> subprocess.Popen:
    """Start a run in its own process group and return once it has logged `until_step` (still running); warm: as
    start_until's."""
    return start_until(cmd, lambda: logged_steps(run_dir) >= until_step, env, warm=warm)


# A transformers package that fails to import on one rank (torchrun's RANK) and hands over to the real one elsewhere.
BROKEN_TRANSFORMERS = """
import importlib, os, sys
if os.environ.get("RANK", "0") == os.environ["BROKEN_RANK"]:
    raise ImportError(f"transformers is broken on rank {os.environ['BROKEN_RANK']}")
sys.path.remove(os.path.dirname(os.path.dirname(__file__)))
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)
"""


# Run at each process's start (Python imports sitecustomize from the path): no Hub token on the broken rank.
NO_TOKEN = """
import os
if os.environ.get("RANK", "0") == os.environ["BROKEN_RANK"]:
    os.environ.pop("HF_TOKEN", None)
"""


def broken_rank(root: Path, rank: str) -> dict[str, str]:
    """The environment of a launch whose processes import BROKEN_TRANSFORMERS, broken on `rank`, and have a Hub
    token (HF_TOKEN, a made-up one: the start-up check does not reach the network) except on `rank`."""
    package = root / "broken" / "transformers"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(BROKEN_TRANSFORMERS)
    (package.parent / "sitecustomize.py").write_text(NO_TOKEN)
    path = os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "BROKEN_RANK": rank, "HF_TOKEN": "hf_not_a_real_token"}


def kill_tree(root: int) -> None:
    """SIGKILL a process and all its descendants at once, like a preempted node (torchrun's workers run in
    sessions of their own, so killing the launcher's process group would miss them)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        children = {pid for pid, ppid in parents.items() if ppid in tree} - tree
        tree |= children
        grew = bool(children)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train_loss" in r}


MUON = ["--optimizer", "muon", "--lr-schedule", "wsd", "--muon-momentum-warmup-steps", "8"]
ADAMW = ["--optimizer", "adamw", "--lr-schedule", "cosine"]
TWELVE = ["--max-steps", "12", "--checkpoint-interval", "2", "--keep-checkpoints", "2"]


@pytest.fixture(scope="module")
def straight_runs(prepared_books, tmp_path_factory) -> Callable[[str | None, list[str]], Path]:
    """straight(accelerate_config, options): the uninterrupted 12-step run of TWELVE + options, launched once per
    module (the kill tests compare against the same runs)."""
    runs: dict[tuple, Path] = {}

    def straight(accelerate_config: str | None, options: list[str]) -> Path:
        key = (accelerate_config, *options)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("straight") / "run"
            run(tiny_cmd(accelerate_config, runs[key], prepared_books, *TWELVE, *options))
        return runs[key]

    return straight


@pytest.mark.parametrize(
    "accelerate_config, options",
    [(None, ADAMW), ("cpu_ddp2.yaml", []), (None, MUON)],
    ids=["1proc-adamw", "ddp2", "1proc-muon"],
)
def test_sigkill_then_resume_auto_is_bitwise_identical(
    prepared_books, tmp_path, straight_runs, accelerate_config, options
):
    """Straight 12 steps == killed with SIGKILL after step 5, then `--resume auto` to 12 (fp32: bitwise): AdamW +
    cosine, the default recipe under DDP, and Muon with a momentum warmup. Under muon the checkpoint holds both
    optimizers' state (Muon's momentum, AdamW's moments) and the one schedule, which also warms up Muon's momentum
    past the kill."""
    args = [*TWELVE, *options]
    straight, killed = straight_runs(accelerate_config, options), tmp_path / "killed"

    newest = kill_after(tiny_cmd(accelerate_config, killed, prepared_books, *args), killed, step=5)
    assert logged_steps(killed) < 12
    resumed = run(tiny_cmd(accelerate_config, killed, prepared_books, *args, "--resume", "auto"))
    assert f"resumed from {newest} at step {int(newest.name.split('-')[1])}" in resumed.stdout

    assert losses_by_step(killed) == losses_by_step(straight)  # exact float equality, every step
    a, b = (
        load_file(straight / "checkpoints/step-00000012/model.safetensors"),
        load_file(killed / "checkpoints/step-00000012/model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_warm(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL a launch started warm (start_until) and every rank (a lost node); returns once its run is gone."""
    kill_tree(proc.pid)  # the launcher and every rank; the warm copies die of their keepers' SIGKILL
    proc.wait()
    with FileLock(run_dir / LOCK_NAME).acquire(timeout=60):  # rank 0's copy is gone once its run-folder lock is free
        pass


def kill_after(cmd: list[str], run_dir: Path, step: int) -> Path:
    """Run `cmd` (warm) until it has logged `step`, SIGKILL it and every rank (a lost node); its newest checkpoint."""
    kill_warm(start_and_wait(cmd, run_dir, until_step=step, warm=True), run_dir)
    time.sleep(1)  # let the killed ranks' pipes close
    return list_checkpoints(run_dir)[-1]


def test_samples_hold_each_step_once_after_kills_and_resumes(prepared_books, tmp_path, straight_runs):
    """Killed right after the save of step 4 (before that step's sample), resumed, killed again after the sample of
    step 7 (saved at 6), resumed to the end: samples.txt is the uninterrupted run's, each step once and in order."""
    options = ["--sample-interval", "1", "--sample-tokens", "8"]
    straight, killed = straight_runs(None, options), tmp_path / "killed"
    cmd = tiny_cmd(None, killed, prepared_books, *TWELVE, *options)
    samples = killed / "samples.txt"

    kill_warm(start_until(cmd, (killed / "checkpoints/step-00000004").is_dir, warm=True), killed)
    kill_warm(start_until(cmd, lambda: "--- step 7 ---" in samples.read_text(), warm=True), killed)
    run(cmd)
    assert samples.read_text() == (straight / "samples.txt").read_text()


def test_a_run_resumes_on_another_number_of_processes_and_micro_batch(prepared_books, tmp_path, straight_runs):
    """Killed on 1 process (micro-batch 4, accumulation 2), resumed on 2 (DDP over gloo: 4, 1), killed, resumed on 1 at
    micro-batch 2 (accumulation 4), under Muon with a momentum warmup: one line names each change, the optimizer,
    schedule and token count go on, and every step's loss is the uninterrupted 1-process run's (the same windows in
    each step: a window seen twice or skipped would change it; only the order of the sums differs)."""
    args = [*TWELVE, *MUON]
    straight, elastic = straight_runs(None, MUON), tmp_path / "elastic"

    first = kill_after(tiny_cmd(None, elastic, prepared_books, *args), elastic, step=3)
    ddp = tiny_cmd("cpu_ddp2.yaml", elastic, prepared_books, *args, "--resume", "auto")
    second = kill_after(ddp, elastic, step=int(first.name.split("-")[1]) + 3)
    resumed = run(tiny_cmd(None, elastic, prepared_books, *args, "--micro-batch-size", "2", "--resume", "auto"))
    done = int(second.name.split("-")[1])
    assert (
        f"resume: world size 2 -> 1, micro-batch 4 -> 2, accumulation 1 -> 4; data position {done * 512:,} tokens kept"
        in resumed.stdout
    ), resumed.stdout
    assert "resuming with a changed config" not in resumed.stdout  # the shape is said once, by the line above
    meta = json.loads((elastic / "checkpoints/step-00000012/meta.json").read_text())
    assert meta["tokens_seen"] == 12 * 512
    reference, losses = losses_by_step(straight), losses_by_step(elastic)
    assert losses.keys() == reference.keys()
    assert all(losses[s] == reference[s] for s in reference if s <= int(first.name.split("-")[1]))  # before any reshape
    assert all(abs(losses[s] - reference[s]) < 1e-5 * reference[s] for s in reference), (losses, reference)


def minutes_of_steps(steps: int, cmd: list[str], run_dir: Path) -> float:
    """A --time-budget-minutes that holds about `steps` of cmd's steps on this machine as loaded now, from the
    median step of a 4-step run of it; at least 0.1 (6 s: ~100-300 steps on an idle machine). A fixed 6 s held 3
    steps of 2.2 s under a load average of 7, and the run ended before the test's kill at step 6."""
    run([*cmd, "--max-steps", "4"])
    step_s = statistics.median(r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl") if "step_time_s" in r)
    return max(0.1, steps * step_s / 60)


def test_a_time_budget_retimes_the_steps_until_the_decay_and_a_resumed_run_keeps_them(prepared_books, tmp_path):
    """--time-budget-minutes under make train's recipe (Muon, wsd): the steps timed in the warmup decide how many fit
    (at most max_steps), re-timed at log steps while the lr is still constant; the run ends on the schedule a run of
    --max-steps N has from the start (fp32: the same losses, bitwise), and a run killed after a decision resumes to
    it, not to max_steps."""
    common = [*MUON, "--warmup-steps", "3", "--checkpoint-interval", "2", "--keep-checkpoints", "2"]
    minutes = minutes_of_steps(30, tiny_cmd(None, tmp_path / "timed", prepared_books, *common), tmp_path / "timed")
    budget = [*common, "--max-steps", "5000", "--time-budget-minutes", f"{minutes:.3g}"]
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    kill_after(tiny_cmd(None, killed, prepared_books, *budget), killed, step=6)
    decided = {r["step"]: r["total_steps"] for r in read_metrics(killed / "metrics.jsonl") if "total_steps" in r}
    assert min(decided) == 3  # at the end of the warmup
    resumed = run(tiny_cmd(None, killed, prepared_books, *budget, "--resume", "auto"))
    assert re.search(r"\| (\d+) steps \|", resumed.stdout)[1] in {str(t) for t in decided.values()}  # not max_steps
    decided = {r["step"]: r["total_steps"] for r in read_metrics(killed / "metrics.jsonl") if "total_steps" in r}
    assert len(decided) > 1  # re-timed after the warmup
    assert all(step - 1 <= 0.8 * total for step, total in decided.items())  # every decision before the decay
    total = decided[max(decided)]
    assert max(losses_by_step(killed)) == total < 5000

    run(tiny_cmd(None, straight, prepared_books, *common, "--max-steps", str(total)))
    assert losses_by_step(killed) == losses_by_step(straight)
    # launched again, the budget's steps stay done; with the budget off, --max-steps decides, as in a new run
    again = run(tiny_cmd(None, killed, prepared_books, *budget, "--resume", "auto")).stdout
    assert f"at step {total} of {total}: nothing to train (to go on, --time-budget-minutes 0 and a higher" in again
    longer = [*common, "--max-steps", str(total + 2), "--time-budget-minutes", "0", "--resume", "auto"]
    out = run(tiny_cmd(None, killed, prepared_books, *longer)).stdout
    assert max(losses_by_step(killed)) == total + 2
    # the decayed weights go back up to the peak lr: said, with the checkpoint kept where the decay started
    # common's schedule: its warmup counts where a short total's decay starts inside the default one (20 steps)
    branch = killed / f"checkpoints/step-{decay_start(TrainConfig(lr_schedule='wsd', warmup_steps=3), total):08d}"
    assert re.search(rf"^warning: the checkpoint's schedule had decayed the lr to 0.10x its peak for step {total + 1}"
                     rf", .*: --resume {re.escape(str(branch))} ", out, re.M), out  # fmt: skip
    # and the model card says the lr's path, not only the last launch's schedule
    now = re.search(r"trains that step at (\d\.\d\d)x", out)[1]
    card = render_model_card(killed)
    assert re.search(rf"\| lr schedule \| wsd: .*; from step {total + 1} the lr went back up from 0\.10× to {now}× the "
                     r"peak \(a resume trained the decayed run longer\) \|", card), card  # fmt: skip


def test_a_wsd_run_extended_from_before_its_decay_trains_as_one_planned_that_long(
    prepared_books, tmp_path, straight_runs
):
    """An 8-step run of the default recipe (Muon, wsd) keeps the checkpoint of step 7, after which its decay starts,
    whatever --keep-checkpoints says; resumed from it with --max-steps 12, the run's losses are those of the run
    planned for 12 steps from the start, step for step (fp32: bitwise), with no warning: steps 1-7 had the lrs of
    any longer run. (A resume from the decayed step 8 warns, naming step 7: the time-budget test's last launch.)"""
    straight, extended = straight_runs(None, MUON), tmp_path / "extended"
    args = [*MUON, "--checkpoint-interval", "2", "--keep-checkpoints", "1"]
    run(tiny_cmd(None, extended, prepared_books, *args, "--max-steps", "8"))
    assert [p.name for p in list_checkpoints(extended)] == ["step-00000007", "step-00000008"]
    branch = extended / "checkpoints/step-00000007"
    out = run(tiny_cmd(None, extended, prepared_books, *args, "--max-steps", "12", "--resume", str(branch))).stdout
    assert "resumed from" in out and "warning" not in out, out
    assert losses_by_step(extended) == losses_by_step(straight)


def test_sigterm_finishes_the_step_saves_and_exits_zero(prepared_books, tmp_path):
    """Between log steps too: the step it stopped at is logged, so the model card of an export of that checkpoint
    counts the steps and tokens its weights took."""
    run_dir = tmp_path / "run"
    cmd = tiny_cmd(None, run_dir, prepared_books, "--max-steps", "500", "--checkpoint-interval", "0",
                   "--log-interval", "1000")  # fmt: skip
    proc = start_and_wait(cmd, run_dir, until_step=1, warm=True)  # the start-up row, logged after the first step
    proc.send_signal(signal.SIGTERM)  # passed on to the run
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    step = logged_steps(run_dir)
    assert 2 <= step < 500
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step-{step:08d}"]
    assert f"stopped at step {step} by a signal" in out and "run the same command" in out
    meta = json.loads((list_checkpoints(run_dir)[0] / "meta.json").read_text())
    assert meta["step"] == step and meta["tokens_seen"] == step * 512
    card = render_model_card(run_dir)
    assert f"| optimizer steps | {step:,} of 500 planned (stopped early" in card
    assert f"| tokens seen | {step * 512:,} (" in card


def test_nonfinite_gradients_are_skipped_then_abort_keeping_the_checkpoint(prepared_books, tmp_path):
    """lr 1e30 blows the weights up after step 1, so every later gradient is NaN: skip K times, then abort."""
    run_dir = tmp_path / "run"
    result = run(
        tiny_cmd(None, run_dir, prepared_books, "--max-steps", "20", "--lr", "1e30", "--warmup-steps", "0",
                  "--checkpoint-interval", "1", "--max-bad-steps", "3"),
        expect_rc=1,
    )  # fmt: skip
    assert result.stdout.count("update skipped") == 3
    good = run_dir / "checkpoints" / "step-00000001"
    assert "non-finite loss/gradients in 3 consecutive steps after step 1" in result.stderr
    assert f"--resume {good}" in result.stderr
    assert list_checkpoints(run_dir) == [good]
    assert all(torch.isfinite(t).all() for t in load_file(good / "model.safetensors").values())


def test_resume_checks_the_checkpoints_config_before_loading(prepared_books, tmp_path):
    """Another model shape (preset or block_size) or optimizer stops with one line naming both, before anything is
    loaded and with the checkpoints untouched; another batch is legitimate and is named in one line."""
    run_dir = tmp_path / "run"
    run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "2", "--checkpoint-interval", "2"))
    saved = {
        p: p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name not in ("metrics.jsonl", ".run.lock.json")
    }
    for other in (["--preset", "small-cpu"], ["--block-size", "32"]):
        result = run(tiny_cmd(None, run_dir, prepared_books, *other), expect_rc=1)  # the same command, resumes
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        [line] = result.stderr.strip().splitlines()
        assert re.fullmatch(
            rf"error: out_dir {run_dir} holds a run \(step-00000002\): the checkpoint is a tiny-cpu \(n_layer 2, "
            r".*block_size 64, .*\) model, this run's is .*; resume with the checkpoint's "
            r"--preset/--n-layer/--n-head/--n-embd/--block-size/--init-from, start afresh there with --resume never .*",
            line,
        ), line
        assert "this run's is " + ("small-cpu (n_layer 4" if "small-cpu" in other else "tiny-cpu") in line
        assert {p: p.read_bytes() for p in saved} == saved
    adamw = run(tiny_cmd(None, run_dir, prepared_books, "--optimizer", "adamw"), expect_rc=1)
    [line] = adamw.stderr.strip().splitlines()
    assert line.startswith(f"error: out_dir {run_dir} holds a run (step-00000002): the checkpoint holds muon state, "
                           "this run asks for --optimizer adamw")  # fmt: skip
    assert {p: p.read_bytes() for p in saved} == saved
    resumed = run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "3", "--checkpoint-interval", "2",
                           "--total-batch-tokens", "1024", "--resume", "auto"))  # fmt: skip
    assert (
        "resuming with a changed config (checkpoint -> now): total_batch_tokens 512 -> 1024, max_steps 2 -> 3\n"
        in resumed.stdout
    ), resumed.stdout
    assert "resumed from" in resumed.stdout
    # steps 1-2 at 512 tokens, step 3 at 1024: a token budget of 4096 is two more steps of 1024, not its 4 steps
    # at 1024 (which would have stopped at 3,072 tokens)
    budget = run(tiny_cmd(None, run_dir, prepared_books, "--max-tokens", "4096", "--checkpoint-interval", "2",
                          "--total-batch-tokens", "1024"))  # fmt: skip
    assert "| 5 steps |" in budget.stdout, budget.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["tokens_seen"]) for r in rows if "tokens_seen" in r][-2:] == [(4, 3072), (5, 4096)]
    assert [r["launch"]["planned_steps"] for r in rows if "launch" in r][-1] == 5  # the model card's "of N planned"


def test_a_resume_on_a_grown_library_stops_unless_asked_and_then_trains_on_from_the_new_datas_start(
    prepared_books, tmp_path
):
    """More books, prepared into the same --data-dir: the resume stops with one line saying how to go on, the
    checkpoints untouched; with --on-new-data continue the weights, optimizer, schedule and step go on and the new
    data is read from its start, said on screen and in metrics.jsonl's launch row. The same command again (a requeued
    job) resumes the new data at its position, not at its start once more."""
    data, run_dir = Path(shutil.copytree(prepared_books, tmp_path / "books")), tmp_path / "run"
    every_two = ["--checkpoint-interval", "2"]
    run(tiny_cmd(None, run_dir, data, "--max-steps", "2", *every_two))
    prepare("default:hamlet,macbeth,othello,tempest,twelfth_night", data, shard_tokens=40_000, val_fraction=0.1)
    saved = {p: p.read_bytes() for p in sorted((run_dir / "checkpoints").rglob("*")) if p.is_file()}

    stopped = run(tiny_cmd(None, run_dir, data, "--max-steps", "4", *every_two), expect_rc=1)
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot resume the train loader: the checkpoint has num_windows=") and (
        "; to train this run on (its weights, optimizer, schedule and step kept) from the start of the new data, add "
        "--on-new-data continue; else resume with the same data" in line
    ), stopped.stderr[-3000:]
    assert {p: p.read_bytes() for p in saved} == saved

    go_on = tiny_cmd(None, run_dir, data, "--max-steps", "4", *every_two, "--on-new-data", "continue")
    went_on = run(go_on).stdout
    note = re.search(r"^resume: (new data \(--on-new-data continue\): the checkpoint's data \w{12} was left at 1,024 "
                     rf"tokens; {re.escape(str(data))} \(data \w{{12}}\) is read from its start, the weights, "
                     r"optimizer, schedule and step go on)$", went_on, re.M)  # fmt: skip
    assert note, went_on
    step4 = run_dir / "checkpoints" / "step-00000004"
    position = torch.load(step4 / "custom_checkpoint_1.pkl", weights_only=False)
    progress = torch.load(step4 / "custom_checkpoint_0.pkl", weights_only=False)
    assert (position["epoch"], position["tokens"]) == (0, 2 * 512)  # the new data's first two steps
    assert position["data_digest"] == load_manifest(data).content_digest
    assert json.loads((step4 / "meta.json").read_text())["data"] == position["data_digest"]  # its val loss's data
    assert (progress["step"], progress["tokens_seen"]) == (4, 4 * 512)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["launch"].get("new_data") for r in rows if "launch" in r] == [None, note[1]]
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3, 4]

    requeued = run([*go_on[: go_on.index("--max-steps") + 1], "6", *go_on[go_on.index("--max-steps") + 2 :]]).stdout
    assert "new data" not in requeued and f"resumed from {step4} at step 4" in requeued
    position = torch.load(run_dir / "checkpoints" / "step-00000006" / "custom_checkpoint_1.pkl", weights_only=False)
    assert (position["epoch"], position["tokens"]) == (0, 4 * 512)


def test_an_anneal_on_curated_books_decays_from_the_peak_over_its_own_steps(prepared_books, tmp_path):
    """The anneal of docs/configuration.md: a stable run (no decay) of 4 steps, then --max-steps 7 --decay-steps 3
    on another data set with --on-new-data continue: steps 1-5 at the peak (after the warmup), then the line of a
    3-step decay, no jump; the changed config said in one line, and no warning that the lr goes back up (the stable
    run's schedule gave its next step the floor lr, as if it had decayed, and the card said the lr went back up).
    The same command again (a requeued job) trains nothing more."""
    curated, run_dir = tmp_path / "curated", tmp_path / "run"
    prepare("default:hamlet,macbeth", curated, shard_tokens=40_000, val_fraction=0.1)
    samples = ["--sample-interval", "3", "--sample-tokens", "4"]  # steps 3 and 4 (the last), then 6 and 7
    run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "4", "--decay-fraction", "0", *samples))
    anneal = tiny_cmd(
        None, run_dir, curated, "--max-steps", "7", "--decay-steps", "3", "--on-new-data", "continue", *samples
    )
    out = run(anneal).stdout
    assert re.search(r"^resuming with a changed config \(checkpoint -> now\): data_dir .* max_steps 4 -> 7, "
                     r"decay_steps 0 -> 3$", out, re.M), out  # fmt: skip
    assert "wsd over the last 3 steps to 0.1 x peak lr" in out and "the lr to 0.10x its peak" not in out, out
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert not any("rewarmed" in r.get("launch", {}) for r in rows)  # what the card's "went back up" reads
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    peak = 3e-3
    assert [lrs[s] / peak for s in range(1, 8)] == pytest.approx([0.5, 1, 1, 1, 1, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3])
    # the stable run's last sample stays (its step, no longer the last, is not due now: dropped at the resume, it was
    # never written again), and the anneal's follow it
    assert re.findall(r"^--- step (\d+) ---$", (run_dir / "samples.txt").read_text(), re.M) == ["3", "4", "6", "7"]
    again = run(anneal).stdout
    assert "the run is at step 7 of 7: nothing to train" in again and "dropped" not in again, again
    assert {r["step"]: r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if "lr" in r} == lrs


def test_a_second_launch_on_a_run_folder_in_use_stops_at_once(prepared_books, tmp_path):
    """Two launches on one out_dir: the second names the holder and touches nothing; after kill -9 of the first
    the lock is free and the run resumes."""
    run_dir = tmp_path / "run"
    with WARM.forking(1):  # a warm copy: its pid is the server's to say
        first = start_and_wait(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "500",
                                        "--checkpoint-interval", "2"), run_dir, until_step=3, warm=True)  # fmt: skip
    pid = WARM.last_forked()  # the run's own process
    try:
        second = run(
            tiny_cmd("cpu_eager.yaml", run_dir, prepared_books, "--resume", "auto", launch_args=["-q"]), expect_rc=1
        )
        assert "Traceback" not in second.stderr, second.stderr[-3000:]
        line = second.stderr.strip().splitlines()[-1]
        assert re.fullmatch(
            rf"error: out_dir {run_dir} is in use by another run \(host {re.escape(socket.gethostname())}, "
            rf"pid {pid}, since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \w+\); wait for it to end or stop it, .*",
            line,
        ), line
        assert first.poll() is None  # the first run trains on (its client lives as long as it does)
    finally:
        kill_warm(first, run_dir)
    newest = list_checkpoints(run_dir)[-1]
    resumed = run(tiny_cmd(None, run_dir, prepared_books, "--max-steps",
                           str(int(newest.name.split("-")[1]) + 1), "--resume", "auto"))  # fmt: skip
    assert f"resumed from {newest}" in resumed.stdout


def test_sigterm_to_the_launcher_saves_and_the_run_resumes(prepared_books, tmp_path):
    """docker stop / Kubernetes / timeout signal the launcher's PID only: the training process still saves a checkpoint
    and exits, and the run resumes from it."""
    run_dir = tmp_path / "run"
    cmd = tiny_cmd("cpu_eager.yaml", run_dir, prepared_books, "--max-steps", "500", "--checkpoint-interval", "0",
                   launch_args=["-q"])  # fmt: skip
    launcher = start_and_wait(cmd, run_dir, until_step=3)
    try:
        os.kill(launcher.pid, signal.SIGTERM)  # the launcher alone, not its process group
        out, _ = launcher.communicate(timeout=60)  # EOF once the training process, which shares the pipe, exits
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # an orphaned training process stays in the launcher's group
    step = logged_steps(run_dir)
    assert 3 <= step < 500
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step-{step:08d}"], out[-3000:]
    assert f"stopped at step {step} by a signal" in out
    resumed = run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", str(step + 1), "--resume", "auto"))
    assert f"resumed from {list_checkpoints(run_dir)[0]} at step {step}" in resumed.stdout


@NEEDS_UNSHARE_PID
def test_a_shell_form_container_command_is_warned_at_start_up(prepared_books, tmp_path):
    """A Dockerfile's `CMD accelerate launch ...` runs `/bin/sh -c` as PID 1, which drops docker stop's SIGTERM (the
    kernel delivers a signal to a PID 1 only through a handler): the run trained on until SIGKILL, without a word."""
    cmd = shlex.join(tiny_cmd(None, tmp_path / "run", prepared_books, "--max-steps", "1"))
    shell = f"cd {REPO} && {cmd}; exit $?"  # a command after it: sh (dash or bash) does not exec the run
    shell_form = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", shell],
                                capture_output=True, text=True, timeout=300)  # fmt: skip
    assert shell_form.returncode == 0, shell_form.stderr[-3000:]
    assert "warning: PID 1 here is sh, which does not pass a SIGTERM on: " in shell_form.stderr
    assert "warning: PID 1" not in run(tiny_cmd(None, tmp_path / "run", prepared_books, "--max-steps", "2")).stderr


def ctrl_c_when(ready: Callable[[], bool], script: str, cwd: Path) -> tuple[int, str]:
    """Run the bash `script` as a terminal's foreground job and press Ctrl-C, SIGINT to its whole process group, once
    ready(); (exit status, what it printed on either stream, in order: the screen)."""
    shell = start_until(["bash", "-c", script], ready, cwd=cwd)
    try:
        os.killpg(shell.pid, signal.SIGINT)
        screen, _ = shell.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # an orphaned training process stays in the group
            os.killpg(shell.pid, signal.SIGKILL)
    return shell.returncode, screen


def test_ctrl_c_on_make_train_saves_and_ends_with_our_line(prepared_books, tmp_path):
    """Ctrl-C in the terminal reaches its whole foreground job: the training process finishes its step, saves and
    says how to continue, last, below the progress bar, and the launcher waits for it and exits 0 (accelerate's own
    died at once with a KeyboardInterrupt traceback, giving the prompt back while the run was still saving)."""
    run_dir = tmp_path / "run"
    args = tiny_cmd(None, run_dir, prepared_books, "--max-steps", "500", "--checkpoint-interval", "0",
                    "--time-budget-minutes", "0")[2:]  # fmt: skip
    # the recipe as it is, launching eager unpicked (the picked YAML compiles: ~30 s unrelated to a signal)
    recipe = make_train_recipe(yaml="cpu_eager.yaml")
    status, screen = run_in_terminal(["bash", "-c", f"{recipe} {shlex.join(args)}"], columns=400,
                                     interrupt=lambda: logged_steps(run_dir) >= 3)  # fmt: skip
    step = logged_steps(run_dir)
    assert status == 0 and "Traceback" not in screen, screen[-3000:]
    checkpoint = list_checkpoints(run_dir)[-1]
    assert checkpoint.name == f"step-{step:08d}"
    lines = [line for line in rendered(screen, columns=400) if line]
    assert "SIGINT received: finishing this step, then saving a checkpoint" in lines, "\n".join(lines)
    assert re.match(r" *\d+%\|.*\| \d+/500 \[", lines[-2]), "\n".join(lines)  # the bar, then our line
    assert lines[-1].startswith(f"stopped at step {step} by a signal; checkpoint {checkpoint}"), "\n".join(lines)


def test_sigterm_to_make_train_reaches_the_run_which_saves(prepared_books, tmp_path):
    """`timeout`, systemd or `docker stop` signal `make train` alone, and make passes a SIGTERM on to its recipe's
    shell only: the shell died of it and the launcher and the run, orphaned, trained on (as a container's PID 1, make
    then spun until SIGKILL). The recipe execs the launcher, so make signals the launcher, which signals the run."""
    run_dir = tmp_path / "run"
    args = tiny_cmd(None, run_dir, prepared_books, "--max-steps", "500", "--checkpoint-interval", "0",
                    "--time-budget-minutes", "0")[2:]  # fmt: skip
    venv = Path(sys.executable).parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # not a sub-make
    # the Makefile as it is, launching eager unpicked (the picked YAML compiles: ~40 s unrelated to a signal)
    eager = tmp_path / "Makefile"
    eager.write_text(launching("cpu_eager.yaml", (REPO / "Makefile").read_text()))
    make = ["make", "-f", str(eager), "--no-print-directory", "-o", "install", "train", f"VENV={venv}",
            f"ARGS={shlex.join(args)}"]  # fmt: skip
    proc = start_until(make, lambda: logged_steps(run_dir) >= 3, env=env)
    try:
        proc.send_signal(signal.SIGTERM)  # make alone, not its process group
        out, _ = proc.communicate(timeout=120)  # EOF once the run, which shares the pipe, exits
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # an orphaned launcher and run stay in make's group
    step = logged_steps(run_dir)
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step-{step:08d}"], out[-3000:]
    assert f"stopped at step {step} by a signal" in out, out[-3000:]


def test_ctrl_c_at_start_up_ends_with_one_line_even_where_the_launcher_ignores_it(tmp_path):
    """`make train`'s launcher ignores Ctrl-C and its children inherit that: the run takes the key back, so Ctrl-C
    during its start-up (here the default corpus's first preparation, in a fresh folder) stops it with the
    preparation's own line: what was kept, and that the same command resumes it."""
    build = tmp_path / "data" / ".default.build"
    train = shlex.join([sys.executable, str(REPO / "train_accel.py"), "--preset", "tiny-cpu", "--max-steps", "2"])
    # once the first batch of books is written
    status, screen = ctrl_c_when((build / "progress.json").is_file, f"trap '' INT; exec {train}", tmp_path)
    assert status == 130 and "Traceback" not in screen, screen[-3000:]
    assert screen.strip().splitlines()[-1] == (
        f"interrupted: {tmp_path / 'data' / 'default'} is unchanged; the books prepared so far are kept in {build}, "
        "and the same command resumes from there"
    )


@pytest.mark.parametrize("during", ["the default corpus's preparation", "the step-0 eval", "a Ctrl-C's exit"])
def test_sigterm_at_start_up_ends_with_one_line(prepared_books, tmp_path, during: str):
    """docker stop, a SLURM preemption or the launcher's death (training.signals.stop_with_the_launcher) before the
    train loop takes the signal over: the run stopped without a word (SIGTERM's default action); now it stops at
    once as at a Ctrl-C there, with one line (the preparation's own, saying what it kept), exit status 143. A SIGTERM
    right behind a Ctrl-C (accelerate 1.16's launcher passes the key on as one) changes nothing: it raised inside the
    exit, a traceback after the line or in its place."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train_accel.py"), "--preset", "tiny-cpu", "--max-steps", "2",
           "--out-dir", str(run_dir)]  # fmt: skip
    if during == "the default corpus's preparation":  # in a fresh folder, once its first batch of books is written
        proc = start_until(cmd, (tmp_path / "data" / ".default.build" / "progress.json").is_file, cwd=tmp_path,
                           warm=True)  # fmt: skip
    else:  # HellaSwag's whole validation set: minutes for this model on two cores
        provision()
        cmd += ["--data-dir", str(prepared_books), "--eval-tasks", "hellaswag"]
        proc = start_until(cmd, (run_dir / "config.yaml").is_file, cwd=tmp_path, warm=True)
    before = ""
    if during == "a Ctrl-C's exit":  # the SIGTERM once the Ctrl-C's line is out: the process is exiting
        proc.send_signal(signal.SIGINT)
        while "interrupted: " not in before and (line := proc.stdout.readline()):
            before += line
    proc.send_signal(signal.SIGTERM)
    screen, _ = proc.communicate(timeout=60)
    screen = before + screen
    assert "Traceback" not in screen and "Exception ignored" not in screen, screen[-3000:]
    lines = screen.strip().splitlines()
    if during == "the default corpus's preparation":
        assert proc.returncode == 143, screen[-3000:]
        assert lines[-1].startswith(f"interrupted: {tmp_path / 'data' / 'default'} is unchanged; the books prepared")
        return
    kept = ": nothing more was saved; the same command continues from the run's last checkpoint, if any"
    said = {130: "interrupted", 143: "SIGTERM received during the start-up"}
    assert proc.returncode == (130 if during == "a Ctrl-C's exit" else 143), screen[-3000:]
    assert lines[-1] == said[proc.returncode] + kept and sum(kept in line for line in lines) == 1, screen[-3000:]
    assert not (run_dir / "checkpoints").exists()


@pytest.fixture
def small_disk(tmpfs):
    return tmpfs("70m")


def test_a_full_disk_fails_the_save_with_one_line_and_keeps_earlier_checkpoints(prepared_books, small_disk):
    """tiny-cpu checkpoints take ~40 MB: on 70 MB the start-up warns, step 2 saves, step 4 cannot. No partial folder
    stays; after room is made, a stale .tmp (a save killed mid-write) is cleared and the run resumes."""
    run_dir = small_disk / "run"
    args = ["--max-steps", "6", "--checkpoint-interval", "2", "--keep-checkpoints", "2"]
    result = run(tiny_cmd(None, run_dir, prepared_books, *args), expect_rc=1)
    warned = (  # the 6-step wsd run keeps its step 5 too, from before the decay (and no best-val one: no val evals)
        r"less than 4 more checkpoints need \(152 MB: --keep-checkpoints 2, the one from before the wsd decay, and one "
        r"more while a save writes\)"
    )
    assert re.search(rf"warning: out_dir {run_dir} has \d+ MB free, {warned}", result.stdout), result.stdout
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: disk full while writing {run_dir}/checkpoints/step-00000004: free space on {small_disk} "
        r"\(38 MB needed, \d+ MB free\), lower --keep-checkpoints .*, then run the same command again; "
        r"complete checkpoints untouched: step-00000002",
        line,
    ), result.stderr[-3000:]
    [kept] = list_checkpoints(run_dir)
    assert kept.name == "step-00000002" and not list(run_dir.rglob("*.tmp"))
    weights = load_file(kept / "model.safetensors")

    stale = run_dir / "checkpoints" / "step-00000004.tmp"
    stale.mkdir()
    (stale / "optimizer.bin").write_bytes(os.urandom(20 * 2**20))  # without clearing it, step 4 would not fit
    subprocess.run(["mount", "-o", "remount,size=100m", str(small_disk)], check=True)
    resumed = run(tiny_cmd(None, run_dir, prepared_books, *args, "--max-steps", "4", "--resume", "auto"))
    assert f"resumed from {kept} at step 2" in resumed.stdout
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000002", "step-00000004"]
    assert not stale.exists()
    assert all(torch.equal(weights[k], t) for k, t in load_file(kept / "model.safetensors").items())


def test_a_full_disk_under_fsdp2_fails_the_sharded_save_with_one_line(prepared_books, small_disk):
    """FSDP2's shards are written by torch.distributed.checkpoint, whose error is a BaseException: the full disk ended
    in both ranks' tracebacks and a line naming neither, the half-written step-00000004.tmp left taking the space."""
    run_dir = small_disk / "run"
    args = ["--optimizer", "adamw", "--max-steps", "6", "--checkpoint-interval", "2", "--keep-checkpoints", "2"]
    eager = ["-q", "--dynamo_backend", "no"]  # the save is what is tested, not the compile
    result = run(through_training_launch(tiny_cmd("cpu_fsdp2.yaml", run_dir, prepared_books, *args, launch_args=eager)),
                 expect_rc=1)  # fmt: skip
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert re.fullmatch(
        rf"error: disk full while writing {run_dir}/checkpoints/step-00000004: free space on {small_disk} .*; "
        r"complete checkpoints untouched: step-00000002",
        result.stderr.strip().splitlines()[-1],
    ), result.stderr[-3000:]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000002"]


def test_a_full_disk_under_the_compile_cache_stops_the_run_with_one_line(prepared_books, tmp_path, tmpfs):
    """torch.compile writes its cache (TORCHINDUCTOR_CACHE_DIR) at start-up (inductor's ISA probes, once per cache
    folder) and at the first step (generated code, C++ kernels): a full disk under it at either stops the run with one
    line naming the folder and the variable that moves it, instead of inductor's traceback; no checkpoint is left."""
    disk = tmpfs("2m")
    cache = disk / "cache"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    todo = (
        f"free space on {disk} (or point TORCHINDUCTOR_CACHE_DIR at a folder on a disk with room: torch.compile's "
        "cache, tens of MB on a CPU) and run the same command again; the run's folder is untouched"
    )
    filler = fill_disk(disk)
    run_dir = tmp_path / "run"
    cmd = tiny_cmd("cpu.yaml", run_dir, prepared_books, launch_args=["-q"])  # as make train launches
    # the launcher and the run in copies of a server whose imports saw this cache folder: testkit.WARM's would start
    # fresh interpreters for it, ~3 s of imports each
    with WarmLaunches(env=env) as warm:
        probes = run(cmd, expect_rc=1, env=env, warm=warm)
        assert probes.stderr.strip().splitlines()[-1] == f"error: disk full while writing {cache}: {todo}", (
            probes.stderr
        )

        # the probes built (here: copied from the suite's cache, whose ISA subfolders hold the kernels), the kernels
        # fail
        filler.unlink()
        shutil.rmtree(cache)
        copy_isa_probes(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent, cache)
        fill_disk(disk)
        kernels = run(cmd, expect_rc=1, env=env, warm=warm)
    folder = cache / Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).name  # this ISA's
    assert "Traceback" not in kernels.stderr, kernels.stderr[-3000:]
    assert kernels.stderr.strip().splitlines()[-1] == f"error: disk full while writing {folder}: {todo}"
    assert list_checkpoints(run_dir) == []


def train_steps(run_dir: Path) -> list[int]:
    """The steps of metrics.jsonl's train rows, as written (read_metrics would hide a step logged twice)."""
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in rows if "train_loss" in r]


def test_the_same_command_again_continues_past_a_damaged_checkpoint_and_never_mixes_two_runs(prepared_books, tmp_path):
    """Relaunched as it was (resume auto is the default), a run whose newest checkpoint was truncated and whose next
    save was killed mid-write (a step-N.tmp folder) names the damaged one in one warning, resumes the one before
    (saved without a manifest, as before manifests existed: load-tested instead), clears the partial save and logs
    each step once; launched once more it has nothing to train and says so; that damaged checkpoint given by path
    stops with one line; --resume never moves the whole run into previous-<time>/ and starts afresh."""
    run_dir = tmp_path / "run"
    # no save before a decay; all warmup, which the start-up warns of where the launch trains
    args = ["--checkpoint-interval", "2", "--keep-checkpoints", "3", "--decay-fraction", "0", "--warmup-steps", "8"]
    run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "6", *args))
    step4, step6 = list_checkpoints(run_dir)[-2:]
    (step4 / "manifest.json").unlink()
    weights = step6 / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    partial = run_dir / "checkpoints" / "step-00000008.tmp"  # what a SIGKILL inside save_state leaves behind
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 100)

    again = run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "8", *args))
    damage = f"model.safetensors is {size // 2:,} bytes, {size:,} when saved"
    assert f"warning: checkpoint {step6} is damaged ({damage}); skipping it\n" in again.stdout, again.stdout
    assert f"resumed from {step4} at step 4\n" in again.stdout
    assert train_steps(run_dir) == list(range(1, 9))  # steps 5 and 6 of the first launch were dropped, not repeated
    [previous] = run_dir.glob("previous-*")
    damaged = previous / "checkpoints" / step6.name  # out of the way of --resume auto and of pruning
    assert checkpoint_damage(damaged) == damage
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000004", "step-00000006", "step-00000008"]
    assert not list(run_dir.rglob("*.tmp"))  # the partial save cleared, not set aside with the damaged checkpoint

    # once more, finished (a requeued job, here with fewer steps): it says so, trains nothing and draws no progress
    # bar; nor does it warn of the plan's warmup, which all its steps were (it trains none)
    done = run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "7", *args))
    assert "the run is at step 8, past the 7 this launch plans: nothing to train (to go on, raise --max-steps" in (
        done.stdout
    )
    assert "warning: warmup_steps" in again.stdout and "warning: warmup" not in done.stdout, done.stdout
    assert done.stderr == "" and train_steps(run_dir) == list(range(1, 9)), done.stderr

    refused = run(tiny_cmd(None, run_dir, prepared_books, "--resume", str(damaged)), expect_rc=1)
    [line] = refused.stderr.strip().splitlines()
    assert line == (
        f"error: --resume {damaged}: the checkpoint is damaged ({damage}); resume from another one of "
        f"{previous / 'checkpoints'} (none), or --resume auto for its newest intact one"
    )

    fresh = run(tiny_cmd(None, run_dir, prepared_books, "--max-steps", "2", *args, "--resume", "never"))
    [second] = set(run_dir.glob("previous-*")) - {previous}
    assert f"moved checkpoints, config.yaml, loss.png, metrics.jsonl into {second} (the run this one replaces)\n" in (
        fresh.stdout
    )
    assert train_steps(run_dir) == [1, 2] and train_steps(second) == list(range(1, 9))
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000002"]
    assert [p.name for p in list_checkpoints(second)] == ["step-00000004", "step-00000006", "step-00000008"]


def last_line(output: str) -> str:
    """The last non-empty line a terminal shows (a progress bar redraws its line with carriage returns)."""
    return [line for line in output.replace("\r", "\n").splitlines() if line.strip()][-1]


def test_a_two_process_launch_ends_with_our_line_once(prepared_books, tmp_path):
    """Through `python -m training.launch` (accelerate launch without the launcher's tracebacks) on the 2-process gloo
    twin of the GPU YAMLs: bad input found on every rank after the process group started (data of another vocabulary)
    ends with our error line, printed once and last, not torchrun's ChildFailedError traceback, and so does an
    export check failed on rank 0, the only rank that runs it; a SIGTERM to the launcher saves a checkpoint and ends
    with the run's own line, not SignalException's traceback."""
    run_dir = tmp_path / "run"

    def launch(*args: str) -> list[str]:
        cmd = tiny_cmd("cpu_ddp2.yaml", run_dir, prepared_books, *args, launch_args=["-q"])
        return through_training_launch(cmd)

    data = tmp_path / "data"
    shutil.copytree(prepared_books, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 100_277  # cl100k's: more ids than the model has embeddings
    (data / "manifest.json").write_text(json.dumps(manifest))
    bad = run(launch("--data-dir", str(data)), expect_rc=1)
    assert "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert last_line(bad.stderr).startswith(f"error: {data} was tokenized with a 100277-id vocabulary"), bad.stderr
    assert bad.stderr.count("error: ") == 1, bad.stderr[-3000:]

    # The export is the main process's to write: it alone tries it at start-up and hands its verdict to rank 1, which
    # stops alike (it would wait in the process group if it went on) ...
    no_export = run(launch("--export-hf", "true"), expect_rc=1, env=broken_rank(tmp_path, rank="0"))
    assert last_line(no_export.stderr).startswith(
        "error: the export at the end of this run would fail (ImportError: transformers is broken on rank 0)"
    ), no_export.stderr[-3000:]
    assert no_export.stderr.count("error: ") == 1 and "Traceback" not in no_export.stderr, no_export.stderr[-3000:]

    # ... and never imports transformers, nor needs a Hub token for the push, which the main process alone makes:
    # where only rank 1's transformers is broken and only rank 1 lacks a token, the run trains (until the SIGTERM).
    # The main process alone asks the Hub (a local stand-in) of its token at start-up, once.
    args = ["--max-steps", "500", "--checkpoint-interval", "0", "--export-hf", "true", "--push-to-hub", "you/tiny"]
    with hub_endpoint() as (endpoint, asked):
        env = {**broken_rank(tmp_path, rank="1"), "HF_ENDPOINT": endpoint}
        launcher = start_and_wait(launch(*args), run_dir, until_step=3, env=env)
    assert [r["authorization"] for r in asked] == ["Bearer hf_not_a_real_token"]
    try:
        os.kill(launcher.pid, signal.SIGTERM)  # the launcher alone, as docker stop / Kubernetes / SLURM do
        out, _ = launcher.communicate(timeout=120)
    finally:
        kill_tree(launcher.pid)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "Traceback" not in out, out[-3000:]
    [saved] = list_checkpoints(run_dir)
    step = int(saved.name.split("-")[1])
    stopped = f"stopped at step {step} by a signal; checkpoint {saved}. To continue, run the same command"
    assert last_line(out) == stopped
    assert out.count("SIGTERM received") == 1  # rank 0 says it for both
    grace = r"checkpoint saved in \d+\.\d s \(a step takes \d+\.\d s\): .* set your grace period above \d+ s"
    assert re.search(grace, out), out[-3000:]

    # A refused resume (the checkpoint holds Muon's state): decided on rank 0 alone and handed to rank 1, which stops
    # alike (it would hang in the process group if it went on); our line once and last, the checkpoint untouched.
    refused = run(launch("--optimizer", "adamw"), expect_rc=1)
    assert last_line(refused.stderr).startswith("error: out_dir "), refused.stderr[-3000:]
    assert "the checkpoint holds muon state, this run asks for --optimizer adamw" in last_line(refused.stderr)
    assert refused.stderr.count("error: ") == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert list_checkpoints(run_dir) == [saved]
