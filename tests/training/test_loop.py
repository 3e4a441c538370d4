"""The run built by training.loop.setup and its one optimizer step (training.step.Trainer): non-finite gradients
change nothing whether the verdict is read at once or one step late, the cadence test, the throughput clock, the
val loss over the spread windows, the optimizer an engine can run, the warning of a run that will memorize."""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils._pytree import tree_leaves

from data_prep.loader import EvalWindows
from data_prep.manifest import load_manifest
from data_prep.prepare import prepare
from data_prep.tokenizer import EOT_ID
from training.checkpoint import load_resume_state
from training.config import ConfigError, TrainConfig, parse_config
from training.loop import (
    TrainMetrics,
    describe_optimizer,
    due,
    memorization_warning,
    optimizer_for_engine,
    rewarm_warning,
    setup,
    trainer_for,
    unused_settings_warning,
    warmup_warning,
    window_loss_sum,
    write_sample,
)
from training.metrics import read_metrics
from training.optim import build_optimizer, build_scheduler, lr_multiplier
from training.step import StepOutput, Trainer, TrainingAborted, masks_on_device


def test_due_every_interval_and_at_the_last_step_unless_off():
    assert [s for s in range(1, 11) if due(4, s, last=s == 10)] == [4, 8, 10]
    assert not any(due(0, s, last=s == 10) for s in range(1, 11))


def test_a_sharding_engine_trains_the_default_with_adamw_and_stops_an_explicit_muon():
    default, _ = parse_config(["--lr", "3e-4"])
    cfg, note = optimizer_for_engine(default, "FSDP")
    assert (cfg.optimizer, cfg.lr, cfg.lr_schedule, cfg.muon_lr) == ("adamw", 3e-4, "wsd", default.muon_lr)
    assert note == (
        "note: FSDP shards each matrix; Muon needs whole ones, so this run trains with AdamW (lr 0.0003) under the "
        "same wsd schedule; --optimizer adamw silences this"
    )
    assert optimizer_for_engine(default, None) == (default, None)  # one process or DDP: the recipe as it is
    adamw, _ = parse_config(["--optimizer", "adamw"])
    assert optimizer_for_engine(adamw, "DeepSpeed") == (adamw, None)
    explicit, _ = parse_config(["--optimizer", "muon"])
    with pytest.raises(ConfigError, match=r"^optimizer muon runs on one process or DDP only, not DeepSpeed \(which"):
        optimizer_for_engine(explicit, "DeepSpeed")
    # setup() edits the config before this (the YAML's activation checkpointing): an explicit muon stays explicit
    with pytest.raises(ConfigError, match=r"^optimizer muon runs on one process or DDP only, not FSDP \(which"):
        optimizer_for_engine(explicit.replace(activation_checkpointing=True), "FSDP")


def test_a_run_past_four_epochs_of_its_train_split_is_warned_once_with_the_command_for_a_bigger_corpus():
    four_epochs = TrainConfig(max_steps=4, total_batch_tokens=1000)  # 4,000 tokens
    assert memorization_warning(four_epochs, train_tokens=1000) is None
    assert memorization_warning(TrainConfig(max_tokens=4001, total_batch_tokens=1), train_tokens=1000) == (
        "warning: this run plans 4,001 tokens, 4.0 epochs of the 1,000-token train split of data/default: past 4 "
        "epochs a model memorizes its data (val loss stalls, then rises); for a bigger corpus run "
        "`python -m data_prep.prepare --source pg19 --out data/pg19` and train with --data-dir data/pg19"
    )
    # the README's default command: 200 steps of 131,072 tokens over the default corpus's ~1.7M train tokens
    assert "plans 26,214,400 tokens, 15.2 epochs" in memorization_warning(TrainConfig(), train_tokens=1_720_000)
    budget = TrainConfig(time_budget_minutes=5, max_steps=600, total_batch_tokens=8192)  # make train's: at most
    assert memorization_warning(budget, train_tokens=1_000_000).startswith("warning: this run plans up to 4,915,200")
    pg19 = TrainConfig(data_dir="data/pg19", max_tokens=31_000_000_000)  # GPT-2 XL at 20 tokens a parameter
    assert memorization_warning(pg19, train_tokens=2_700_000_000).endswith(
        "for a bigger corpus join more sources into the corpus (data_prep.prepare --source a+b) or plan fewer tokens"
    )


@pytest.mark.parametrize("decay", [{"decay_fraction": 0.0}, {"decay_fraction": 0.25}, {"decay_steps": 3}])
def test_the_start_up_line_says_the_schedules_decay_as_the_schedule_runs_it(decay):
    """The stable part of a run annealed later (--decay-fraction 0) keeps the peak lr to its last step: the line said
    'wsd over the last 0 of steps to 0.1 x peak lr'."""
    cfg = TrainConfig(optimizer="adamw", lr_schedule="wsd", warmup_steps=2, max_steps=12, min_lr_ratio=0.1, **decay)
    groups = [{"name": "decay", "params": [torch.zeros(2, 2)], "weight_decay": 0.1}]
    line = describe_optimizer(cfg, groups, "no").partition(" | ")[2]
    lrs = [lr_multiplier(step, cfg, 12) for step in range(2, 12)]
    if decay == {"decay_fraction": 0.0}:
        assert line == "2 warmup steps, wsd with no decay: the peak lr to the last step" and set(lrs) == {1.0}
    else:
        last = "0.25 of steps" if "decay_fraction" in decay else "3 steps"
        assert line == f"2 warmup steps, wsd over the last {last} to 0.1 x peak lr" and lrs[-1] < 1.0


def test_an_anneal_on_few_books_is_warned_of_the_epochs_it_reads_of_them(prepared_books, tmp_path, capsys):
    """The anneal of docs/configuration.md: a stable run of 30 steps on the default books, then steps on a small
    curated set under --on-new-data continue. The warning counted the stable steps too, as epochs of the curated
    books (32 steps' 8,192 tokens: "5.5 epochs", for the 512 tokens read of them); it counts the steps after the
    resume, and, resumed again on the curated books, the epochs already read of them."""
    from train_accel import fit

    books = tmp_path / "curated"
    books.mkdir()
    (books / "notes.txt").write_text("".join(f"Note {i}: the river rose in the night.\n" for i in range(150)))
    curated = tmp_path / "curated-data"
    prepare(f"files:{books}", curated)
    tokens = load_manifest(curated).num_tokens("train")  # one document: its first 90%
    common = dict(
        preset="tiny-cpu", out_dir=str(tmp_path / "run"), micro_batch_size=2, total_batch_tokens=256, warmup_steps=2,
        peak_tflops=1.0, export_hf=False, eval_interval=0, sample_interval=0, log_interval=10, eval_windows=2,
    )  # fmt: skip

    def launch(steps: int, data: Path, train: bool = True, **more: object) -> list[str]:
        run = setup(TrainConfig(data_dir=str(data), max_steps=steps, checkpoint_interval=steps, **common, **more))
        if train:
            fit(run)
        run.lock.release()
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: this run plans")]

    assert launch(30, prepared_books, decay_fraction=0.0) == []
    assert 32 * 256 / tokens > 4 > 2 * 256 / tokens  # the whole run's tokens, those the anneal reads
    assert launch(32, curated, decay_steps=2, on_new_data="continue") == []
    epochs = (2 * 256 + 80 * 256) / tokens  # those read, then the steps to come
    assert launch(112, curated, train=False, decay_steps=2, on_new_data="continue") == [
        f"warning: this run plans 20,480 more tokens from step 32, {epochs:.1f} epochs in all of the {tokens:,}-token "
        f"train split of {curated}: past 4 epochs a model memorizes its data (val loss stalls, then rises); for a "
        "bigger corpus run `python -m data_prep.prepare --source pg19 --out data/pg19` and train with --data-dir "
        "data/pg19"
    ]


def test_a_warmup_as_long_as_the_run_is_warned():
    """--warmup-steps 1000 in a 2-step run trained at a sliver of its lr with no word. The line gives the highest lr
    the schedule reaches: a wsd decay cuts into a warmup as long as the run (it said the lr "nor decays"), and a
    cosine warmup of all the steps reaches the peak at the last (it said "never reaches its peak")."""
    assert warmup_warning(TrainConfig(max_steps=20, warmup_steps=19)) is None
    assert warmup_warning(TrainConfig(max_steps=20, warmup_steps=20, lr=3e-3)) == (
        "warning: warmup_steps 20 is not below the run's 20 steps: the run is all warmup, its lr 0.85x its peak "
        "(0.003) at most; give --warmup-steps below 20, or more steps"
    )  # step 16's, 17/20: from step 17 on, the decay over the last 4 steps (0.1 + 0.9 × 3/4) is below the warmup
    cosine = TrainConfig(max_steps=20, warmup_steps=20, lr_schedule="cosine")
    assert "the run is all warmup, its lr 1.00x its peak (0.0006) at most;" in warmup_warning(cosine)
    short = warmup_warning(TrainConfig(max_tokens=2, total_batch_tokens=1))  # 2 steps of the default 20 warmup
    assert "not below the run's 2 steps: the run is all warmup, its lr 0.10x its peak" in short


def test_a_resume_that_takes_a_decayed_lr_back_up_is_warned(tmp_path):
    """A finished cosine run of 10 steps (its next lr 0.1x the peak) resumed with --max-steps 20: the schedule trains
    step 11 at ~0.6x. Said, with the way to extend a run later (cosine keeps no point to branch off from); a resume
    that keeps or lowers the lr, one inside the warmup, or one with nothing left to train says nothing."""
    cfg = TrainConfig(lr_schedule="cosine", warmup_steps=2, max_steps=20)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_scheduler(optimizer, cfg)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    checkpoint = tmp_path / "run/checkpoints/step-00000010"
    checkpoint.mkdir(parents=True)
    now, ours = lr_multiplier(10, cfg, 20), schedule.next_multiplier()  # step 11's, by this launch's schedule
    assert rewarm_warning(cfg, checkpoint, 10, 20, 0.1, ours) == (
        f"warning: the checkpoint's schedule had decayed the lr to 0.10x its peak for step 11, and this launch's "
        f"20-step schedule trains that step at {now:.2f}x: the annealed weights go back up. No checkpoint from before "
        "a decay is kept to branch off from: a run meant to be extended trains under wsd with --decay-fraction 0 and "
        "anneals in a resumed run"
    )
    assert rewarm_warning(cfg, checkpoint, 10, 20, now, ours) is None  # the same schedule
    assert rewarm_warning(cfg, checkpoint, 1, 20, 0.1, ours) is None  # in the warmup: a warmup changed
    assert rewarm_warning(cfg, checkpoint, 20, 20, 0.1, ours) is None  # nothing left to train


def test_the_rewarm_warning_names_the_checkpoint_from_before_the_decay(tmp_path):
    """A wsd run of 10 steps, its checkpoint of step 9 saved before the decay, resumed from step 10 with 20 steps: the
    line names step 9 to resume from; the later checkpoints are set aside only where the run goes on in that folder
    (a --resume PATH into another --out-dir leaves them)."""
    run_dir = tmp_path / "run"
    for step, before in ((9, True), (10, False)):
        folder = run_dir / f"checkpoints/step-{step:08d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text(f'{{"step": {step}, "before_decay": {str(before).lower()}}}')
    cfg = TrainConfig(warmup_steps=2, max_steps=20, out_dir=str(run_dir))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = build_scheduler(optimizer, cfg)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    ours = schedule.next_multiplier()  # step 11's, by this launch's schedule
    line = rewarm_warning(cfg, run_dir / "checkpoints/step-00000010", 10, 20, 0.1, ours)
    assert line.startswith("warning: the checkpoint's schedule had decayed the lr to 0.10x its peak for step 11, and "
                           "this launch's 20-step schedule trains that step at 1.00x"), line  # fmt: skip
    assert line.endswith(f"branch off before the decay: --resume {run_dir}/checkpoints/step-00000009 (the later "
                         "checkpoints are moved into previous-<time>/)"), line  # fmt: skip
    elsewhere = cfg.replace(out_dir=str(tmp_path / "other"))
    line = rewarm_warning(elsewhere, run_dir / "checkpoints/step-00000010", 10, 20, 0.1, ours)
    assert line.endswith(f"--resume {run_dir}/checkpoints/step-00000009"), line
    assert rewarm_warning(cfg, run_dir / "checkpoints/step-00000009", 9, 20, 0.55, ours) is None  # the branch


def test_settings_the_run_never_reads_are_warned(tmp_path):
    """--muon-lr under --optimizer adamw, --decay-fraction under --lr-schedule cosine, --eval-tasks with --eval-interval
    0: the run trained as if they were not given, with no word. Only what the run config or flags set is named; the
    defaults never are."""
    assert unused_settings_warning(parse_config(["--optimizer", "adamw", "--lr-schedule", "cosine"])[0]) is None
    assert unused_settings_warning(parse_config(["--muon-lr", "0.01", "--decay-fraction", "0.3"])[0]) is None
    cfg, _ = parse_config(
        ["--optimizer", "adamw", "--lr-schedule", "cosine", "--muon-lr", "0.01", "--decay-fraction", "0.3"]
    )
    assert unused_settings_warning(cfg) == (
        "warning: set but never read by this run (optimizer adamw, lr_schedule cosine): muon_lr (optimizer muon "
        "only), decay_fraction (lr_schedule wsd only); they change nothing"
    )
    run_config = tmp_path / "run.yaml"
    run_config.write_text("muon_momentum_warmup_steps: 100\n")
    cfg, _ = parse_config(["--config", str(run_config), "--optimizer", "adamw"])
    assert "muon_momentum_warmup_steps (optimizer muon only); they change nothing" in unused_settings_warning(cfg)
    # a sharding engine's AdamW in place of the default Muon (its note says so) leaves a given Muon lr unread too
    engine_cfg, _ = optimizer_for_engine(parse_config(["--muon-lr", "0.01"])[0], "FSDP")
    assert "muon_lr (optimizer muon only)" in unused_settings_warning(engine_cfg)
    # --decay-steps decides the decay's length: a --decay-fraction beside it is not read either
    both, _ = parse_config(["--max-steps", "14", "--decay-steps", "4", "--decay-fraction", "0.3"])
    assert unused_settings_warning(both) == (
        "warning: set but never read by this run (decay_steps 4): decay_fraction (decay_steps 0 only); they change "
        "nothing"
    )
    # with --eval-interval 0 there are no val evals: the tasks they would score were never scored, with no word
    evals = ["--eval-tasks", "hellaswag", "--eval-limit", "8"]
    assert unused_settings_warning(parse_config(["--eval-interval", "5", *evals])[0]) is None
    # no tasks, said so (bench.time_to_loss's runs), and a recipe's eval_windows, which a benchmark reads itself
    assert (
        unused_settings_warning(parse_config(["--eval-interval", "0", "--eval-tasks", "", "--eval-windows", "8"])[0])
        is None
    )
    assert unused_settings_warning(parse_config(["--eval-interval", "0", *evals])[0]) == (
        "warning: set but never read by this run (eval_interval 0): eval_tasks (eval_interval above 0 only), "
        "eval_limit (eval_interval above 0 only); they change nothing"
    )
    # the token budget decides the run's length: a --max-steps beside it is not read
    assert unused_settings_warning(parse_config(["--max-steps", "50", "--max-tokens", "4096"])[0]) == (
        "warning: set but never read by this run (max_tokens 4096): max_steps (max_tokens unset only); they change "
        "nothing"
    )
    # a limit on no task's examples, and a prompt for samples never drawn
    assert unused_settings_warning(
        parse_config(["--eval-limit", "8", "--sample-interval", "0", "--sample-prompt", "Hi"])[0]
    ) == (
        "warning: set but never read by this run (sample_interval 0, eval_tasks none): sample_prompt (sample_interval "
        "above 0 only), eval_limit (eval_tasks set only); they change nothing"
    )


def test_setup_prints_each_warning_once(prepared_books, tmp_path, capsys):
    cfg = TrainConfig(
        preset="tiny-cpu", data_dir=str(prepared_books), out_dir=str(tmp_path / "run"), micro_batch_size=2,
        total_batch_tokens=256, max_steps=5000, warmup_steps=5000, peak_tflops=1.0, export_hf=False,
    )  # fmt: skip
    setup(cfg)  # 1.28M tokens over ~117k train tokens
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert lines == [memorization_warning(cfg, load_manifest(prepared_books).num_tokens("train")), warmup_warning(cfg)]


def test_val_loss_is_the_mean_over_the_set_on_one_or_two_ranks(prepared_books, tiny_gpt):
    """window_loss_sum summed over ranks / windows == the plain fp64 mean of each window's cross-entropy, on
    1 process and on 2 (whose filler rows must add nothing)."""
    block, count = tiny_gpt.config.block_size, 23
    one = EvalWindows(prepared_books, "val", block, count, 4)
    with torch.no_grad():
        per_window = [
            F.cross_entropy(tiny_gpt(x[None])[0][0].double(), y) for x, y in map(one.dataset.__getitem__, one.indices)
        ]
    want = torch.stack(per_window).mean()
    cpu = torch.device("cpu")
    got_one = window_loss_sum(tiny_gpt, one, cpu) / count
    two = [EvalWindows(prepared_books, "val", block, count, 3, rank=r, world_size=2) for r in (0, 1)]
    got_two = sum(window_loss_sum(tiny_gpt, w, cpu) for w in two) / count
    torch.testing.assert_close(got_one.double(), want, rtol=1e-5, atol=0.0)
    torch.testing.assert_close(got_two.double(), want, rtol=1e-5, atol=0.0)


def nan_grads_at(steps: set[int], counter: list[int]):
    """A gradient hook that makes the gradient NaN during the given (0-based) train_step calls."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if counter[0] in steps else grad

    return hook


def small_trainer(
    fused: bool, bad: set[int], max_bad_steps: int = 5, device: str = "cpu", muon: bool = False
) -> tuple[Trainer, torch.nn.Module, list[int]]:
    """fused AdamW; plain AdamW (fused False); or Muon for the weight matrix with fused AdamW for the bias."""
    torch.manual_seed(0)
    model = ModelWithLoss().to(device)
    groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
    if muon:
        groups = [{"name": "no_decay", "params": [model.lin.bias], "weight_decay": 0.0},
                  {"name": "muon", "params": [model.lin.weight], "weight_decay": 0.1}]  # fmt: skip
    if fused or muon:
        optimizer = build_optimizer(groups, lr=1e-2, betas=(0.9, 0.95), device_type=device)
    else:
        optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=False, fused=False)
    scheduler = build_scheduler(optimizer, TrainConfig(warmup_steps=2, max_steps=8, min_lr_ratio=0.1))
    counter = [0]
    model.lin.weight.register_hook(nan_grads_at(bad, counter))
    trainer = Trainer(
        Accelerator(cpu=device == "cpu"), model, optimizer, scheduler, grad_accum=2, grad_clip=1.0, tokens_per_step=16,
        max_bad_steps=max_bad_steps,
    )  # fmt: skip
    return trainer, model, counter


class ModelWithLoss(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lin(x)
        return out, torch.nn.functional.mse_loss(out, y)


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def run_steps(trainer: Trainer, counter: list[int], n: int) -> list[dict]:
    """n train_step calls, settling after each; the state after every one."""
    data, states = batches(), []
    for i in range(n):
        counter[0] = i
        trainer.train_step(data)
        trainer.settle()
        states.append(
            {
                "step": trainer.progress.step,
                "tokens": (trainer.progress.tokens_applied, trainer.progress.tokens_seen),
                "lr": trainer.scheduler.get_last_lr()[0],
                "weights": copy.deepcopy(trainer.model.state_dict()),
                "opt": copy.deepcopy(tree_leaves(trainer.optimizer.state_dict())),  # both optimizers' under muon
            }
        )
    return states


@pytest.mark.parametrize(
    "fused, muon", [(True, False), (False, False), (False, True)], ids=["masked-on-device", "checked-on-host", "muon"]
)
def test_non_finite_step_changes_no_weight_no_optimizer_state_and_no_counter(fused, muon):
    trainer, _, counter = small_trainer(fused, bad={2}, muon=muon)
    assert masks_on_device(trainer.accelerator, trainer.optimizer) is fused  # Muon has no found_inf
    states = run_steps(trainer, counter, 4)
    assert [s["step"] for s in states] == [1, 2, 2, 3]  # call 2 skipped
    # its tokens were read (the data moves on) but trained no step: --max-tokens counts the steps' tokens
    assert [s["tokens"] for s in states] == [(16, 16), (32, 32), (32, 48), (48, 64)]
    assert states[2]["lr"] == states[1]["lr"]  # the schedule did not advance
    for key, value in states[1]["weights"].items():
        assert torch.equal(states[2]["weights"][key], value), key
    before, after = states[1]["opt"], states[2]["opt"]  # every tensor and hyperparameter of the state
    assert len(after) == len(before) and any(isinstance(v, torch.Tensor) and v.any() for v in before)
    assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(after, before))
    assert not torch.equal(states[3]["weights"]["lin.weight"], states[2]["weights"]["lin.weight"])  # trains on


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_one_step_late_verdict_trains_exactly_like_the_immediate_one(device, fresh_accelerate_state):
    """Masked on the device and read during the next step == read before the update, bit for bit: the same losses,
    step counts and weights. On CUDA the verdict comes through pinned memory behind an event (the first-light script
    runs this on a GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    lagged, _, lag_counter = small_trainer(fused=True, bad={1, 4}, device=device)
    immediate, _, counter = small_trainer(fused=True, bad={1, 4}, device=device)
    data, lagged_losses, steps = batches(), [], []
    for i in range(7):  # no settle between steps: each verdict is read during the next step
        lag_counter[0] = i
        lagged_losses.append(lagged.train_step(data).loss)
        steps.append(lagged.progress.step)  # counts the step before: its verdict was read during this one
    lagged.settle()
    immediate_losses, data = [], batches()
    states = []
    for i in range(7):
        counter[0] = i
        immediate_losses.append(immediate.train_step(data).loss)
        immediate.settle()
        states.append({"step": immediate.progress.step, "lr": immediate.scheduler.get_last_lr()[0]})
    assert torch.equal(torch.stack(lagged_losses), torch.stack(immediate_losses))
    assert steps == [0] + [s["step"] for s in states[:-1]] == [0, 1, 1, 2, 3, 3, 4]
    assert lagged.progress.step == states[-1]["step"] == 5
    assert lagged.scheduler.get_last_lr()[0] == states[-1]["lr"]
    for key, value in immediate.model.state_dict().items():
        assert torch.equal(lagged.model.state_dict()[key], value), key


def test_consecutive_non_finite_steps_abort():
    trainer, _, counter = small_trainer(fused=True, bad={1, 2, 3}, max_bad_steps=3)
    with pytest.raises(TrainingAborted, match="in 3 consecutive steps after step 1"):
        run_steps(trainer, counter, 5)


@pytest.fixture(scope="module")
def tiny_run(prepared_books, tmp_path_factory):
    out = tmp_path_factory.mktemp("loop") / "run"
    cfg = TrainConfig(
        preset="tiny-cpu", data_dir=str(prepared_books), out_dir=str(out), micro_batch_size=2,
        total_batch_tokens=256, max_steps=6, log_interval=3, peak_tflops=1.0, export_hf=False,
    )  # fmt: skip
    return setup(cfg)


def test_first_throughput_window_leaves_the_first_step_out(tiny_run, capsys):
    """The first step (compile, warm-up) only logs the start-up row; the window after it counts later steps."""
    run = tiny_run
    trainer = trainer_for(run, stop=False)
    metrics = TrainMetrics(run)
    data = iter(run.train_loader)
    out: StepOutput | None = None
    spans = []
    for pause in (0.5, 0.0, 0.0):  # the first step is slow, as a compiling one is
        start = time.perf_counter()
        metrics.step_started()
        out = trainer.train_step(data)
        trainer.settle()
        time.sleep(pause)
        metrics.step_finished(run.progress.step)
        spans.append(time.perf_counter() - start)
    row = metrics.log(run.progress.step, out)
    # the mean of steps 2 and 3 as timed from outside; with step 1 in the window it would be >= 0.5 s higher
    assert row["step_time_s"] == pytest.approx(sum(spans[1:]) / 2, abs=0.05)
    assert row["tokens_per_sec"] == pytest.approx(256 / row["step_time_s"])
    logged = read_metrics(run.run_dir / "metrics.jsonl")
    first = [r for r in logged if "time_to_first_step_s" in r]
    assert len(first) == 1 and first[0]["step"] == 1 and first[0]["time_to_first_step_s"] >= 0.5
    # the start-up row: setup's phases, then the first step's, and the rest as other, adding up to the total
    phases = {k: v for k, v in first[0].items() if k.startswith("startup_")}
    assert [k for k in phases if k != "startup_other_s"] == [
        "startup_imports_s", "startup_config_s", "startup_accelerator_s", "startup_data_s", "startup_model_s",
        "startup_prepare_s", "startup_outputs_check_s", "startup_probes_s", "startup_first_step_s",
    ]  # fmt: skip
    assert phases["startup_first_step_s"] >= 0.5 and min(phases.values()) >= 0
    # this run is eager: its line names no compile (a compiling launch's: tests/e2e/test_first_light.py)
    assert re.search(r", first step \d+\.\d, other", capsys.readouterr().out)
    assert sum(phases.values()) == pytest.approx(first[0]["time_to_first_step_s"])
    # a log whose window is empty (the first step is also a log step) has no throughput to report
    assert "tokens_per_sec" not in metrics.log(run.progress.step, out)


def test_a_training_sample_ends_at_the_first_endoftext_after_every_token_was_generated(
    prepared_books, tmp_path, capsys
):
    """samples.txt and the sample line ran on past <|endoftext|> into the next document, where evals.generate stops.
    The text is cut there, while generate() still takes all sample_tokens forward passes: under FSDP2 or ZeRO-3 each
    gathers weights with collectives, so every rank must take as many."""
    cfg = TrainConfig(
        preset="tiny-cpu", data_dir=str(prepared_books), out_dir=str(tmp_path / "run"), micro_batch_size=2,
        total_batch_tokens=256, max_steps=4, sample_tokens=6, peak_tflops=1.0, export_hf=False,
    )  # fmt: skip
    run = setup(cfg)
    model = run.sampler
    with torch.no_grad():  # every position's final hidden state is v, and the end-of-text id's logit 100 from it
        v = torch.randn(model.config.n_embd)
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(v)
        model.lm_head.weight[EOT_ID] = 100 * v / v.norm() ** 2
    passes = []
    model.transformer.h[0].register_forward_hook(lambda *_: passes.append(1))
    capsys.readouterr()
    write_sample(run, 3)
    assert len(passes) == cfg.sample_tokens
    assert (run.run_dir / "samples.txt").read_text() == "--- step 3 ---\nROMEO:\n"
    assert capsys.readouterr().out == "sample @ step 3: 'ROMEO:'\n"


def test_a_checkpoint_another_engine_cannot_load_stops_with_one_line(tmp_path, fresh_accelerate_state):
    """A DeepSpeed ZeRO checkpoint (its partitions in pytorch_model/) on one process: stopped before anything loads,
    saying which engines can resume it."""
    zero = tmp_path / "step-00000002"
    (zero / "pytorch_model").mkdir(parents=True)
    with pytest.raises(ConfigError) as err:
        load_resume_state(Accelerator(cpu=True), zero, None, None, None, [])
    assert str(err.value) == (
        f"--resume {zero}: the checkpoint was written by DeepSpeed and this launch runs one process or DDP; resume "
        "it with a DeepSpeed accelerate config, or start a new run with --init-from on its export (python -m "
        "training.export)"
    )
