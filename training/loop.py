"""A training run built once from the config (setup), its cadences, its throughput metrics and its outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from filelock import FileLock

from data_prep import ensure_default_corpus
from data_prep.loader import IGNORE_INDEX, EvalWindows, TokenLoader
from data_prep.manifest import PG19_DIR, Manifest, prepare_command
from data_prep.tokenizer import get_encoding, gpt2_vocab_and_merges, prompt_tokens
from evals.data import load_examples
from evals.generate import sample_text
from evals.plot import plot_evals
from evals.runner import evaluate_tasks, parse_tasks
from modeling import fp8_head
from modeling.config import GPTConfig
from modeling.device import device_name
from modeling.disk import append_bytes, atomic_write_bytes, disk_full_reported, is_disk_full
from modeling.gpt import GPT
from modeling.runs import (
    CONFIG_FILE,
    EVALS_PLOT,
    EXPORT_DIR,
    LOSS_PLOT,
    METRICS_FILE,
    SAMPLES_FILE,
    checkpoint_step,
    load_checkpoint,
    plain_state_dict,
)
from training.checkpoint import (
    PREVIOUS,
    TrainProgress,
    before_decay_checkpoint,
    checkpoint_bytes,
    clear_partial,
    ensure_writable,
    is_before_decay,
    list_checkpoints,
    load_resume_state,
    outputs_in_the_way,
    plan_resume,
    room_warning,
    sample_header,
    sampled,
    set_aside,
)
from training.config import AUTO, DEFAULT_DATA_DIR, ConfigError, TrainConfig, config_to_yaml, grad_accum_steps
from training.distributed import (
    build_accelerator,
    check_launch,
    check_ranks_agree,
    decided_on_main,
    engine_name,
    generation_model,
    no_gpu_note,
    read_same_data,
    set_deepspeed_batch,
    yaml_activation_checkpointing,
)
from training.export import ExportError
from training.export_check import ExportCheck, export_failure, export_problem
from training.hub import check_model_card, check_push, push, write_model_card
from training.metrics import (
    StartupClock,
    check_trackers,
    cpu_precision_hint,
    gpu_precision_hint,
    memory_stats,
    peak_tflops,
    plot_losses,
    precision_name,
    run_trackers,
    startup_line,
)
from training.micro_batch import resolve_micro_batch
from training.optim import (
    MUON_MOMENTUM_START,
    Schedule,
    build_scheduler,
    decay_start,
    highest_multiplier,
    newton_schulz_dtype,
    optimizer_for,
)
from training.runlock import drop_if_unused, lock_run_folder
from training.step import StepOutput, Trainer

# Engines that shard each matrix over the processes (FSDP2's DTensor rows, DeepSpeed's flat partitions): Muon, which
# orthogonalizes whole matrices, is neither verified equal to DDP under them nor checkpointed by them (FSDP2's
# distributed optimizer state dict wants one optimizer's standard layout): the default optimizer becomes AdamW there,
# and an explicit muon stops at start-up.
SHARDED_ENGINES = {
    DistributedType.FSDP: "FSDP",
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.MEGATRON_LM: "Megatron-LM",
}


# Up to ~4 epochs, repeated tokens train almost as well as new ones; past that returns fall fast and the model
# memorizes its data (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models").
MEMORIZE_EPOCHS = 4


def optimizer_for_engine(cfg: TrainConfig, engine: str | None) -> tuple[TrainConfig, str | None]:
    """The config this engine trains (under a sharding engine, the default muon becomes adamw, with the schedule and
    lr kept) and the note that says so; an explicit muon there stops with a ConfigError."""
    if cfg.optimizer != "muon" or engine is None:
        return cfg, None
    if "optimizer" in cfg.explicit:
        raise ConfigError(
            f"optimizer muon runs on one process or DDP only, not {engine} (which shards the matrices that Muon "
            "orthogonalizes whole); launch with a DDP accelerate config (e.g. accelerate_configs/8xh100.yaml) or "
            "use --optimizer adamw"
        )
    resolved = cfg.replace(optimizer="adamw")
    note = (
        f"note: {engine} shards each matrix; Muon needs whole ones, so this run trains with AdamW (lr {cfg.lr:g}) "
        f"under the same {cfg.lr_schedule} schedule; --optimizer adamw silences this"
    )
    return resolved, note


def memorization_warning(
    cfg: TrainConfig, train_tokens: int, step: int = 0, tokens_applied: int = 0, epochs_read: float = 0.0
) -> str | None:
    """One warning line when the run plans more than MEMORIZE_EPOCHS epochs of its train split (for a time budget,
    the most it may train), naming the command that prepares a bigger corpus; None otherwise. A resume at `step`
    (its steps' `tokens_applied`) plans the steps after it, on top of the `epochs_read` of this split before it:
    none where the run went on from other data (an anneal on curated books reads them alone, not the steps trained
    on the big corpus)."""
    planned = (cfg.total_steps(step, tokens_applied) - step) * cfg.total_batch_tokens
    epochs = epochs_read + planned / train_tokens
    if epochs <= MEMORIZE_EPOCHS:
        return None
    at_most = "up to " if cfg.time_budget_minutes else ""
    tokens, in_all = (f"more tokens from step {step}", " in all") if step else ("tokens", "")
    if Path(cfg.data_dir) == Path(PG19_DIR):
        bigger = "join more sources into the corpus (data_prep.prepare --source a+b) or plan fewer tokens"
    else:
        bigger = f"run `{prepare_command(PG19_DIR, 'pg19')}` and train with --data-dir {PG19_DIR}"
    return (
        f"warning: this run plans {at_most}{planned:,} {tokens}, {epochs:.1f} epochs{in_all} of the "
        f"{train_tokens:,}-token train split of {cfg.data_dir}: past {MEMORIZE_EPOCHS} epochs a model memorizes its "
        f"data (val loss stalls, then rises); for a bigger corpus {bigger}"
    )


def rewarm_warning(
    cfg: TrainConfig, checkpoint: Path, step: int, total_steps: int, saved: float, now: float
) -> str | None:
    """One warning line when a resume's schedule (more steps, a shorter decay) takes the lr back up from a decay the
    checkpoint at `step` was trained into (the next step's lr as a fraction of the peak: `saved` by the checkpoint's
    schedule, `now` by this launch's), naming the checkpoint its run kept from before a wsd decay, where a run planned
    longer from the start branches off; None otherwise."""
    if step < cfg.warmup_steps or step >= total_steps or saved >= 1.0 or now <= saved * 1.001:
        return None
    if is_before_decay(checkpoint):  # its steps were not decayed, only the next one would have been
        return None
    line = (
        f"warning: the checkpoint's schedule had decayed the lr to {saved:.2f}x its peak for step {step + 1}, and "
        f"this launch's {total_steps}-step schedule trains that step at {now:.2f}x: the annealed weights go back up"
    )
    branch = before_decay_checkpoint(checkpoint.parent.parent)
    if cfg.lr_schedule == "wsd" and branch is not None and checkpoint_step(branch) < step:
        # in this run's folder, the checkpoints after it are set aside (training.checkpoint.set_aside)
        here = checkpoint.parent.parent.resolve() == Path(cfg.out_dir).resolve()
        aside = f" (the later checkpoints are moved into {PREVIOUS}<time>/)" if here else ""
        return (
            f"{line}. To train as a run planned for {total_steps} steps from the start, branch off before the decay: "
            f"--resume {branch}{aside}"
        )
    return (
        f"{line}. No checkpoint from before a decay is kept to branch off from: a run meant to be extended trains "
        "under wsd with --decay-fraction 0 and anneals in a resumed run"
    )


def branch_step(cfg: TrainConfig, total_steps: int) -> int | None:
    """The step after which a run of total_steps saves the checkpoint a longer run branches off from (a wsd run with
    checkpoints on: its decay_start; the pruning keeps it); None where it saves none."""
    return decay_start(cfg, total_steps) if cfg.checkpoint_interval else None


def warmup_warning(cfg: TrainConfig) -> str | None:
    """One warning line when the lr warmup is as long as the run (at most its steps, for a time budget): the run
    is all warmup, its lr a fraction of the peak the run config names. None otherwise."""
    steps = cfg.total_steps()
    if cfg.warmup_steps < steps:
        return None
    return (
        f"warning: warmup_steps {cfg.warmup_steps} is not below the run's {steps} steps: the run is all warmup, its "
        f"lr {highest_multiplier(cfg, steps):.2f}x its peak ({cfg.lr:g}) at most; give --warmup-steps below {steps}, "
        "or more steps"
    )


# What the val evals alone read (eval_interval 0: none) and the samples (sample_interval 0: none), that a user gives
# expecting scores or samples; eval_windows and sample_tokens, which recipe YAMLs set, are left unnamed (a benchmark
# that turns the run's evals off measures its own over eval_windows).
EVAL_SETTINGS = ("eval_tasks", "eval_limit")
SAMPLE_SETTINGS = ("sample_prompt",)
# The settings that one optimizer or schedule reads alone -> (the field that chooses it, its value).
READ_ONLY_UNDER = {
    "muon_lr": ("optimizer", "muon"),
    "muon_momentum": ("optimizer", "muon"),
    "muon_momentum_warmup_steps": ("optimizer", "muon"),
    "decay_fraction": ("lr_schedule", "wsd"),
    "decay_steps": ("lr_schedule", "wsd"),
}


def unused_settings_warning(cfg: TrainConfig) -> str | None:
    """One warning line naming what the run config or flags set that this run never reads (--muon-lr under adamw,
    --decay-fraction under cosine or beside --decay-steps, --eval-tasks with --eval-interval 0, --sample-prompt with
    --sample-interval 0): such a run trained as if they were not given, with no word. None otherwise."""
    unused = [  # (the setting, the setting of this run that leaves it unread, what that would have to be)
        (name, key, f"{key} {value} only")
        for name, (key, value) in READ_ONLY_UNDER.items()
        if name in cfg.explicit and getattr(cfg, key) != value
    ]
    if "decay_fraction" in cfg.explicit and cfg.decay_steps and cfg.lr_schedule == "wsd":  # decay_steps decides
        unused.append(("decay_fraction", "decay_steps", "decay_steps 0 only"))
    off = [("eval_interval", EVAL_SETTINGS), ("sample_interval", SAMPLE_SETTINGS)]  # no val evals, no samples
    for key, names in off:
        if not getattr(cfg, key):
            given = [name for name in names if name in cfg.explicit and getattr(cfg, name) not in ("", None)]
            unused += [(name, key, f"{key} above 0 only") for name in given]
    if {"max_steps", "max_tokens"} <= cfg.explicit and cfg.max_tokens is not None:  # the token budget decides
        unused.append(("max_steps", "max_tokens", "max_tokens unset only"))
    if cfg.eval_interval and cfg.eval_limit is not None and not cfg.eval_tasks:  # the val loss alone: no examples
        unused.append(("eval_limit", "eval_tasks", "eval_tasks set only"))
    if not unused:
        return None
    keys = dict.fromkeys(key for _, key, _ in unused)  # in order, once each
    this_run = ", ".join(f"{key} {getattr(cfg, key) if getattr(cfg, key) != '' else 'none'}" for key in keys)
    named = ", ".join(f"{name} ({only})" for name, _, only in unused)
    return f"warning: set but never read by this run ({this_run}): {named}; they change nothing"


def due(interval: int, step: int, last: bool) -> bool:
    """The one cadence test: every `interval` optimizer steps and at the last one; interval 0 turns it off."""
    return bool(interval) and (step % interval == 0 or last)


@dataclass
class Run:
    """Everything setup() builds; the loop only reads it (and advances progress)."""

    cfg: TrainConfig
    run_dir: Path
    resumed_from: Path | None  # the checkpoint this launch continued from (None: afresh)
    model_config: GPTConfig
    accelerator: Accelerator
    manifest: Manifest
    train_loader: TokenLoader
    val_windows: EvalWindows
    model: torch.nn.Module  # prepared
    sampler: torch.nn.Module  # the module to call generate() on (training.distributed.generation_model)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # prepared (accelerate's wrapper), for the Trainer to step
    schedule: Schedule  # the one it wraps: what the loop asks about the lrs and spans
    progress: TrainProgress
    grad_accum: int
    total_steps: int
    flops_per_token: int
    peak_tflops: float
    checkpoint_bytes: int  # one checkpoint's size, estimated before any exists
    lock: FileLock | None  # the run folder's, held until this process exits (None on other ranks)
    startup: StartupClock  # the start-up's phases, timed until the end of the first step
    # the resumed step's sample is missing from samples.txt (a kill between its save and its sample): fit writes it
    resample: bool

    def is_last(self, step: int) -> bool:
        return step == self.total_steps

    def wants(self, step: int) -> bool:
        """Whether anything is logged, evaluated, sampled, saved or decided after optimizer step `step`."""
        cfg, last = self.cfg, self.is_last(step)
        intervals = (cfg.log_interval, cfg.eval_interval, cfg.sample_interval, cfg.checkpoint_interval)
        return last or self.budget_due(step) or self.before_decay(step) or any(due(i, step, last) for i in intervals)

    def before_decay(self, step: int) -> bool:
        """Whether the checkpoint from before the decay is saved after optimizer step `step` (branch_step)."""
        return step == branch_step(self.cfg, self.total_steps)

    def budget_due(self, step: int) -> bool:
        """Whether the time budget's step count is (re)decided after optimizer step `step`: at the end of the
        warmup (or the first step after it that was timed), then at every log step while a longer run would still
        have given the steps so far the same lrs (wsd: until its decay starts; cosine: never)."""
        cfg = self.cfg
        if not cfg.time_budget_minutes or step < cfg.warmup_steps:
            return False
        if not self.progress.total_steps:
            return True
        last = self.is_last(step)
        return due(cfg.log_interval, step, last) and not last and self.schedule.keeps_past(self.total_steps + 1)

    def span(self, total_steps: int) -> None:
        """Train to total_steps, the schedule ending there; saved with the progress, so a resumed run keeps it."""
        self.total_steps = self.progress.total_steps = total_steps
        self.schedule.span(total_steps)


def budget_steps(budget_minutes: float, step_s: float, *, elapsed_s: float, done: int, cap: int) -> int:
    """The optimizer steps that fit in `budget_minutes` of train steps when `done` of them took `elapsed_s` and
    the next take `step_s` seconds each; at most `cap` and at least the `done` ones."""
    return max(done, min(cap, done + int((budget_minutes * 60 - elapsed_s) / step_s)))


def initial_model(cfg: TrainConfig, model_config: GPTConfig) -> GPT:
    """GPT-2 init, or the weights of cfg.init_from."""
    if not cfg.init_from:
        return GPT(model_config)
    from modeling.hf_export import load_hf  # imports transformers (~3 s): only runs that need it pay for it

    try:
        return load_hf(cfg.init_from, model_config)
    except ValueError as err:  # weights that do not load (the shape was read when the config was)
        raise ConfigError(f"init_from {cfg.init_from}: {err}") from None


def setup(cfg: TrainConfig, startup: StartupClock | None = None) -> Run:
    """The fixed build order: run folder, Accelerator, seed, data, model, optimizer, schedule, one prepare(),
    resume, run info. Precision, compile and distribution come from the launch YAML. `startup` times the phases
    (a fresh clock when None)."""
    startup = startup or StartupClock()
    trackers = [t.strip() for t in cfg.trackers.split(",") if t.strip()]
    check_launch()  # before anything is written
    if yaml_activation_checkpointing():
        cfg = cfg.replace(activation_checkpointing=True)
    check_trackers(trackers)
    run_dir = Path(cfg.out_dir)
    if run_dir.resolve() == Path(cfg.data_dir).resolve():  # set_aside keeps a data dir inside out_dir, not out_dir
        raise ConfigError(
            f"out_dir and data_dir are one folder ({cfg.out_dir}): a fresh start there would set the dataset aside "
            "with the run; give the run a folder of its own, e.g. --out-dir runs/mine"
        )
    ensure_writable(run_dir)
    lock = lock_run_folder(run_dir)
    try:
        return _set_up_locked(cfg, startup, trackers, run_dir, lock)
    except BaseException:
        drop_if_unused(run_dir, lock)  # a start-up that stopped before writing leaves no empty run folder behind
        raise


def _set_up_locked(
    cfg: TrainConfig, startup: StartupClock, trackers: list[str], run_dir: Path, lock: FileLock | None
) -> Run:
    """setup's build order once the run folder is locked."""
    model_config = cfg.model_config()
    startup.lap("config")  # the config read, the run folder locked

    auto = cfg.micro_batch_size == AUTO
    # The export the end of the run writes, tried by the main process, which writes it: beside a GPU in a process
    # of its own (training.export_check), started before the Accelerator where the launch says this process will be
    # that one, so it overlaps CUDA's and the process group's start too; on a CPU in check_outputs, below.
    export_check = ExportCheck(model_config) if cfg.export_hf and ExportCheck.expected_here() else None
    accelerator = build_accelerator(
        grad_clip=cfg.grad_clip,
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, not micro-steps × processes
        log_with=run_trackers(trackers, run_dir),
        project_dir=str(run_dir),
    )
    check_ranks_agree(accelerator, dataclasses.asdict(cfg), run_dir)
    beside = cfg.export_hf and accelerator.is_main_process and accelerator.device.type != "cpu"
    if export_check and not beside:  # the launch was read wrong: no child here
        export_check.cancel()
        export_check = None
    elif beside and not export_check:  # a GPU other than CUDA's, or a launch read wrong the other way
        export_check = ExportCheck(model_config)
    cfg, engine_note = optimizer_for_engine(cfg, SHARDED_ENGINES.get(accelerator.distributed_type))
    # before any work, against the optimizer this engine runs: a refused resume stops every rank alike
    resume_from, resume_notes = decided_on_main(accelerator, lambda: plan_resume(cfg))
    for note in (no_gpu_note(accelerator.device), engine_note):
        if note:
            accelerator.print(note)
    world_size = accelerator.num_processes
    if auto:  # the run from here on is the one launched with the size picked
        size, why = resolve_micro_batch(
            accelerator, model_config, cfg.total_batch_tokens, cfg.activation_checkpointing, cfg.optimizer == "muon"
        )
        cfg = cfg.replace(micro_batch_size=size)
    grad_accum = grad_accum_steps(cfg.total_batch_tokens, cfg.micro_batch_size, model_config.block_size, world_size)
    accelerator.gradient_accumulation_steps = grad_accum
    set_deepspeed_batch(accelerator, cfg.micro_batch_size, grad_accum)
    if auto:
        accelerator.print(f"micro-batch: auto -> {cfg.micro_batch_size} ({why}; accumulation {grad_accum})")
    device = accelerator.device
    set_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere+; no effect on CPU
    torch.backends.cudnn.allow_tf32 = True
    startup.lap("accelerator")

    manifest, train_loader, val_windows = build_data(cfg, accelerator, model_config)
    startup.lap("data")

    # Model, optimizer, schedule, then one prepare() that applies the launch YAML's engine to them.
    model = initial_model(cfg, model_config)
    model.activation_checkpointing = cfg.activation_checkpointing
    fp8_note = set_fp8_head(model, cfg, device)
    if fp8_note:
        accelerator.print(fp8_note)
    param_groups = model.optimizer_groups(cfg.weight_decay, muon=cfg.optimizer == "muon")
    optimizer = optimizer_for(cfg, param_groups, device.type, accelerator.mixed_precision)
    # said before prepare(): DeepSpeed's ZeRO replaces each group's tensors with its flat partitions in place
    optimizer_text = describe_optimizer(cfg, param_groups, accelerator.mixed_precision)
    total_steps = cfg.total_steps()
    schedule = build_scheduler(optimizer, cfg)
    flops_per_token = model.flops_per_token()
    num_params = model.num_params()  # before prepare(): ZeRO-3 leaves each rank's parameters empty
    one_checkpoint = checkpoint_bytes(model)
    startup.lap("model")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, schedule)  # scheduler: a wrapper of it
    startup.lap("prepare")
    progress = TrainProgress()
    progress.reshape(world_size, cfg.micro_batch_size, grad_accum)
    registered = [progress, train_loader]
    accelerator.register_for_checkpointing(*registered)

    # Resume: model, optimizer, schedule, RNG, counters and the exact data position, as one unit.
    for note in resume_notes:
        accelerator.print(note)
    if resume_from is not None:
        configured = schedule.configured()
        crossed = load_resume_state(accelerator, resume_from, model, optimizer, scheduler, registered)
        saved_multiplier = schedule.next_multiplier()  # the checkpoint's schedule's, for the next step
        schedule.keep_configured(configured)
        accelerator.step = 0  # accumulate()'s micro-step count: a checkpoint is at a step, whatever its accumulation
        accelerator.print(f"resumed from {resume_from} at step {progress.step}")
        changes = [c for c in (crossed, progress.reshape(world_size, cfg.micro_batch_size, grad_accum)) if c]
        new_data = new_data_note(train_loader)
        if changes or new_data:
            epoch = f" of epoch {train_loader.epoch}" if train_loader.epoch else ""
            data = new_data or f"data position {train_loader.tokens:,} tokens{epoch} kept"
            accelerator.print(f"resume: {', '.join(changes)}{'; ' if changes else ''}{data}")
        startup.lap("resume")
    # a token budget counts the tokens of the steps taken: where the checkpoint's steps held another number of tokens
    # a step than this launch's, the run ends at another step than the config alone gives
    if progress.tokens_applied is None:  # a checkpoint from before they were counted: as if at this batch
        progress.tokens_applied = progress.step * cfg.total_batch_tokens
    planned = cfg.total_steps(progress.step, progress.tokens_applied)
    if planned != total_steps:
        total_steps = planned
        schedule.span(total_steps)
    # after the resume: the epochs of this data are those read of it (none, where the run went on from other data)
    # and the steps still to train; a finished run launched again trains none, and its plan warns of nothing
    trains = progress.step < total_steps
    warnings = (
        trains
        and memorization_warning(
            cfg, manifest.num_tokens("train"), progress.step, progress.tokens_applied, train_loader.epochs_read
        ),
        trains and warmup_warning(cfg),
        unused_settings_warning(cfg),
    )
    for warning in warnings:
        if warning:
            accelerator.print(warning)
    # What the end of the run writes, decided by the main process, which writes it, before this launch writes
    # anything; every rank stops alike.
    hub_note = decided_on_main(
        accelerator, lambda: check_outputs(cfg, model_config, export_check, progress.step, resume_from)
    )
    if hub_note:
        accelerator.print(hub_note)
    startup.lap("outputs_check")
    if accelerator.is_main_process:
        # the first write of this launch: one run per folder from here
        moved = set_aside(run_dir, progress.step, resume_from, Path(cfg.data_dir))
        if moved:
            print(moved, flush=True)
        clear_partial(run_dir)  # a killed save's leftovers hold the space the next save needs
        before_decay = branch_step(cfg, total_steps) is not None  # one kept besides keep_checkpoints
        best_val = cfg.eval_interval > 0  # the last step evaluates and saves: some checkpoint has a val loss
        warning = room_warning(run_dir, one_checkpoint, cfg.keep_checkpoints, before_decay, best_val)
        if warning:
            print(warning, flush=True)
    accelerator.wait_for_everyone()
    # every rank writes a sample (generate() gathers sharded weights collectively): one answer for all
    resample = bool(progress.step) and decided_on_main(accelerator, lambda: not sampled(run_dir, progress.step))
    startup.mark()

    peak, peak_source = peak_tflops(device, accelerator.mixed_precision, cfg.peak_tflops)
    hint = precision_hint(accelerator, peak_given=cfg.peak_tflops is not None) if accelerator.is_main_process else None
    if hint:
        accelerator.print(hint)
    startup.lap("probes")
    run = Run(
        cfg, run_dir, resume_from, model_config, accelerator, manifest, train_loader, val_windows, model,
        generation_model(accelerator, model), optimizer, scheduler, schedule, progress, grad_accum, total_steps,
        flops_per_token, peak, one_checkpoint, lock, startup, resample,
    )  # fmt: skip
    if progress.total_steps and cfg.time_budget_minutes:  # resumed after a time budget's decision: the same steps
        run.span(progress.total_steps)
    elif progress.total_steps:  # the budget turned off on resume: max_steps or max_tokens decide, as in a new run
        progress.total_steps = 0
        run.schedule.span(run.total_steps)
    rewarmed = None  # (the lr's fraction of its peak for the next step by the checkpoint's schedule, by this one's)
    if resume_from is not None:
        now = schedule.next_multiplier()
        warning = rewarm_warning(cfg, resume_from, progress.step, run.total_steps, saved_multiplier, now)
        if warning:
            accelerator.print(warning)
            rewarmed = (round(saved_multiplier, 4), round(now, 4))
    log_run_info(run, num_params, peak_source, optimizer_text, rewarmed)
    return run


def set_fp8_head(model: GPT, cfg: TrainConfig, device: torch.device) -> str | None:
    """Turn the model's FP8 head on where cfg.fp8_head asks for it and this device and the model's sizes take it; the
    note saying why it stays off where they do not (None: on, or not asked for)."""
    if not cfg.fp8_head:
        return None
    # not the 50,257 rows of an --init-from model (nor its width, where a run of its own shape exported it):
    # torch._scaled_mm takes dimensions of a multiple of 16 (TrainConfig refuses a scratch run's other widths)
    on_device = fp8_head.supported(device)
    sizes = (model.config.vocab_size, model.config.n_embd)
    model.fp8_head = on_device and not any(size % fp8_head.DIM_MULTIPLE for size in sizes)
    if not on_device:
        return (
            f"note: fp8_head is off on {device.type}: FP8 matmuls need a CUDA GPU of compute capability "
            f"{'.'.join(map(str, fp8_head.MIN_CAPABILITY))} or more (Ada, Hopper)"
        )
    if not model.fp8_head:
        return (
            f"note: fp8_head is off: FP8 matmuls need a vocabulary and an n_embd divisible by "
            f"{fp8_head.DIM_MULTIPLE}, and {cfg.init_from}'s has {model.config.vocab_size:,} ids, n_embd "
            f"{model.config.n_embd}"
        )
    return None


def precision_hint(accelerator: Accelerator, *, peak_given: bool) -> str | None:
    """One line where the launch YAML's precision is not the one to train in on this GPU or CPU; None where it is.
    On a CPU it times fp32 and bf16 matmuls (~1 s): a given MFU peak spares that probe (quiet runs), but not under
    bf16, which crawls where it is not native."""
    device, mixed_precision = accelerator.device, accelerator.mixed_precision
    if device.type == "cuda":
        return gpu_precision_hint(mixed_precision, torch.cuda.is_bf16_supported(), torch.cuda.get_device_name(device))
    if device.type == "cpu" and (not peak_given or mixed_precision == "bf16"):
        return cpu_precision_hint(mixed_precision)  # fp32 or bf16: which is faster here?
    return None


def check_outputs(
    cfg: TrainConfig, model_config: GPTConfig, export_check: ExportCheck | None, step: int, resumed_from: Path | None
) -> str | None:
    """What write_outputs and write_sample need, checked before any training, in the run folder as this launch
    (continuing after `step` from checkpoint `resumed_from`, or afresh) will leave it: nothing in the way of the
    files and the export folder it writes; the loss plot (matplotlib) and, where the run exports,
    the Hub push (a repository id, a token the Hub takes for it, or a note where the Hub could not say;
    training.hub.check_push), the model card (huggingface_hub, the manifest) and the export (transformers, a GPT-2
    shape, a one-layer model and the tokenizer written in a temporary folder: the verdict of export_check, started at
    start-up beside a GPU, else the check run here).
    Run on the main process, which alone writes and pushes them: the other ranks never import transformers, nor
    need a token (on a cluster, perhaps only machine 0 has one)."""
    # fail now, not after days of training
    files = [CONFIG_FILE, METRICS_FILE, LOSS_PLOT]
    files += [SAMPLES_FILE] if cfg.sample_interval else []
    files += [EVALS_PLOT] if cfg.scores_tasks() else []
    in_the_way = outputs_in_the_way(
        Path(cfg.out_dir), step, resumed_from, Path(cfg.data_dir), files, [EXPORT_DIR] if cfg.export_hf else []
    )
    if in_the_way:
        raise ConfigError(f"{'; '.join(in_the_way)}: move it aside, then run the same command again")
    try:  # loss.png's plotting library, loaded as plot_losses loads it (0.5 s; its font cache built on first use)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except Exception as err:  # missing, or built against another numpy
        raise ConfigError(
            f"loss.png at the end of this run could not be drawn: matplotlib does not load ({type(err).__name__}: "
            f"{' '.join(str(err).split())}); reinstall it (pip install --force-reinstall matplotlib)"
        ) from err
    if not cfg.export_hf:
        return None
    hub_note = check_push(cfg.push_to_hub, cfg.out_dir, private=cfg.hub_private_repo) if cfg.push_to_hub else None
    try:
        check_model_card(dataclasses.asdict(cfg))
    except Exception as err:  # huggingface_hub missing or broken, a manifest it cannot read
        raise export_failure(f"{type(err).__name__}: {err}") from err
    if export_check is not None:
        export_check.verdict()
    elif problem := export_problem(model_config):
        raise export_failure(problem)
    return hub_note


def new_data_note(loader: TokenLoader) -> str | None:
    """After a resume under --on-new-data continue on other tokens than the checkpoint's: where the checkpoint's
    data was left and what is read now (None: the checkpoint's own data, resumed at its position, or no resume)."""
    state = loader.left_behind
    if state is None:
        return None
    digest = state.get("data_digest")  # absent from checkpoints written before it was kept
    was = f"data {digest[:12]}" if digest else f"data of {state['num_windows']:,} windows"
    epoch = f" of epoch {state['epoch']}" if state["epoch"] else ""
    return (
        f"new data (--on-new-data continue): the checkpoint's {was} was left at {int(state['tokens']):,} "
        f"tokens{epoch}; {loader.manifest.data_dir} (data {loader.manifest.content_digest[:12]}) is read from its "
        "start, the weights, optimizer, schedule and step go on"
    )


def build_data(
    cfg: TrainConfig, accelerator: Accelerator, model_config: GPTConfig
) -> tuple[Manifest, TokenLoader, EvalWindows]:
    """The manifest, this rank's train loader and its share of the val windows. Prepared shards are the contract
    with data_prep; the default corpus is prepared on first use, and benchmark data is provisioned now, not at the
    first eval."""
    if cfg.data_dir == DEFAULT_DATA_DIR:  # by each machine where it is not shared (prepare's lock: one at a time)
        with accelerator.local_main_process_first():
            if accelerator.is_local_main_process:
                ensure_default_corpus(cfg.data_dir, log=accelerator.print)
    manifest = read_same_data(accelerator, cfg.data_dir)
    if cfg.scores_tasks():
        with accelerator.local_main_process_first():
            for task in parse_tasks(cfg.eval_tasks):
                load_examples(task, cfg.eval_limit)
    if manifest.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"{cfg.data_dir} was tokenized with a {manifest.vocab_size}-id vocabulary but the "
            f"{cfg.model_name()} model has {model_config.vocab_size} embeddings; prepare the data with the "
            "GPT-2 tokenizer"
        )
    block_size = model_config.block_size
    loader_args = dict(rank=accelerator.process_index, world_size=accelerator.num_processes, seed=cfg.seed)
    train_loader = TokenLoader(
        cfg.data_dir, "train", block_size, cfg.micro_batch_size, **loader_args,
        num_workers=cfg.num_workers, pin_memory=accelerator.device.type == "cuda",
        restart_on_other_data=cfg.on_new_data == "continue",
    )  # fmt: skip
    val_windows = EvalWindows(
        cfg.data_dir, "val", block_size, cfg.eval_windows, cfg.micro_batch_size,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
    )  # fmt: skip
    return manifest, train_loader, val_windows


def log_run_info(
    run: Run, num_params: int, peak_source: str, optimizer_text: str, rewarmed: tuple[float, float] | None
) -> None:
    """The run's facts to every tracker and config.yaml to the run folder, and one summary line. rewarmed: the lr
    multipliers (before, now) where this launch took a decayed lr back up (rewarm_warning), for the model card."""
    cfg, accelerator = run.cfg, run.accelerator
    world_size, device = accelerator.num_processes, accelerator.device
    plugin = accelerator.state.dynamo_plugin
    dynamo = str(plugin.backend)
    per_block = plugin.backend != "NO" and bool(plugin.use_regional_compilation)  # each Block compiled on its own
    run_info = {
        **dataclasses.asdict(cfg),
        "grad_accum_steps": run.grad_accum,
        "world_size": world_size,
        "device": device_name(device),
        "data_path": str(Path(cfg.data_dir).resolve()),
        "val_windows": len(run.val_windows.indices),  # --eval-windows, or all the val split has where it has fewer
        "val_tokens": len(run.val_windows.indices) * run.model_config.block_size,
        "start_step": run.progress.step,  # a resumed launch's first step is the next
        "planned_steps": run.total_steps,  # the model card's "of N planned" (a time budget's: its decisions' rows)
        "new_data": new_data_note(run.train_loader),  # metrics.jsonl's launch row keeps where the data changed
        # and where a resume took a decayed lr back up (two numbers: a tracker's config takes scalars)
        "rewarmed_from": rewarmed and rewarmed[0],
        "rewarmed_to": rewarmed and rewarmed[1],
        "mixed_precision": accelerator.mixed_precision,
        "dynamo_backend": dynamo,
        "dynamo_regional": per_block,
        "params": num_params,
        "peak_tflops_per_device": run.peak_tflops,
        "peak_tflops_source": peak_source,
    }
    accelerator.init_trackers("bookgpt", config={k: v for k, v in run_info.items() if v is not None})
    if accelerator.is_main_process:
        config = run.run_dir / CONFIG_FILE
        with disk_full_reported(config, "the checkpoints are untouched"):
            atomic_write_bytes(config, config_to_yaml(cfg).encode())
    engine = f"{name}, " if (name := engine_name(accelerator)) else ""  # DDP, FSDP2 or DeepSpeed ZeRO-N
    accelerator.print(
        f"{cfg.model_name()}: {num_params:,} params | {world_size} process(es) on {device.type}, {engine}"
        f"{precision_name(accelerator.mixed_precision)}, dynamo {dynamo}{' per block' if per_block else ''} | "
        f"{cfg.micro_batch_size} × {run.model_config.block_size} tokens × {run.grad_accum} accumulation × "
        f"{world_size} = {cfg.total_batch_tokens:,} tokens/step | {describe_steps(run)} | "
        f"{run.manifest.num_tokens('train'):,} train tokens ({len(run.train_loader)} micro-batches/epoch/rank) | "
        f"val loss on {len(run.val_windows.indices):,} of {len(run.val_windows.dataset):,} val windows, spread | "
        f"MFU against {run.peak_tflops:.3g} TFLOP/s per device ({peak_source}) | " + optimizer_text
    )


def describe_steps(run: Run) -> str:
    """The step count, or the time budget that will decide it (the start-up line)."""
    budget = run.cfg.time_budget_minutes
    if not budget or run.progress.total_steps:
        return f"{run.total_steps} steps"
    return f"as many steps as fit in {budget:g} min of training (at most {run.total_steps}; timed in the warmup)"


def describe_optimizer(cfg: TrainConfig, param_groups: list[dict], mixed_precision: str) -> str:
    """The optimizer(s) with their peak lrs and parameter groups (Muon's with the dtype of its Newton-Schulz
    iterations), then the schedule (the start-up line's end)."""

    def listing(groups: list[dict]) -> str:
        return ", ".join(f"{len(g['params'])} tensors {g['name']} (wd {g['weight_decay']:g})" for g in groups)

    text = f"AdamW lr {cfg.lr:g}: {listing([g for g in param_groups if g['name'] != 'muon'])}"
    if cfg.optimizer == "muon":
        muon = [g for g in param_groups if g["name"] == "muon"]
        momentum, warmup = f"momentum {cfg.muon_momentum:g}", cfg.muon_momentum_warmup_steps
        if warmup:
            momentum += f" (from {min(MUON_MOMENTUM_START, cfg.muon_momentum):g} over {warmup} steps)"
        ns = str(newton_schulz_dtype(mixed_precision)).removeprefix("torch.")
        text = f"Muon lr {cfg.muon_lr:g} {momentum}, Newton-Schulz in {ns}: {listing(muon)}; {text}"
    if cfg.lr_schedule == "wsd" and not (cfg.decay_steps or cfg.decay_fraction):  # the stable part, annealed later
        return f"{text} | {cfg.warmup_steps} warmup steps, wsd with no decay: the peak lr to the last step"
    last = f"{cfg.decay_steps} steps" if cfg.decay_steps else f"{cfg.decay_fraction:g} of steps"
    decay = f" over the last {last}" if cfg.lr_schedule == "wsd" else ""
    return f"{text} | {cfg.warmup_steps} warmup steps, {cfg.lr_schedule}{decay} to {cfg.min_lr_ratio:g} x peak lr"


def trainer_for(run: Run, stop: object) -> Trainer:
    """The run's Trainer; `stop` is truthy once this rank was asked to stop (training.signals.StopRequest)."""
    cfg = run.cfg
    return Trainer(
        run.accelerator, run.model, run.optimizer, run.scheduler,
        grad_accum=run.grad_accum, grad_clip=cfg.grad_clip, tokens_per_step=cfg.total_batch_tokens,
        max_bad_steps=cfg.max_bad_steps, progress=run.progress, stop=lambda: bool(stop), run_dir=run.run_dir,
        resumed_from=run.resumed_from,
    )  # fmt: skip


class TrainMetrics:
    """Throughput, MFU and the train rows of metrics.jsonl, every log_interval steps, at the last and at a stop.

    Its clock counts train_step() time only (evals, samples and saves are left out) and starts after the first
    step: that one carries compile and warm-up. At its end the start-up row (time_to_first_step_s from the process's
    start, and its phases: training.metrics.StartupClock) is logged and, on the main process, printed on one line."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.first = True
        self.window_s, self.window_steps = 0.0, 0
        self._started = 0.0
        self.last_step_s = 0.0  # the latest step's time, its verdict read (what a stop waits for before saving)
        self.step_seconds: list[float] = []  # under a time budget: the steps' times since its last decision
        self.untimed = 1  # steps a time budget counts at the median rate: this process's first, which compiles

    def step_started(self) -> None:
        self._started = time.perf_counter()

    def step_finished(self, step: int) -> None:
        now = time.perf_counter()
        self.last_step_s = now - self._started
        if self.first:
            self.first = False
            startup = self.run.startup
            startup.lap("first_step")
            row = startup.row()
            self.run.accelerator.log(row, step=step)
            compiled = self.run.accelerator.state.dynamo_plugin.backend != "NO"
            self.run.accelerator.print(startup_line(row, compiled))
            return
        self.window_s += self.last_step_s
        self.window_steps += 1
        # kept by a save, with or without a time budget: one given on a resume counts the steps before it too
        self.run.progress.train_seconds += self.last_step_s
        if self.run.cfg.time_budget_minutes:
            self.step_seconds.append(self.last_step_s)

    def decide_budget(self) -> None:
        """Set the run's step count from the time budget: the train time spent and the median step since the last
        decision (the slowest rank's of each) give the steps that fit; the run ends at the count nearest to that
        which keeps the lrs of the steps taken, so it trains exactly as a --max-steps run of that count."""
        run, accelerator, cfg, progress = self.run, self.run.accelerator, self.run.cfg, self.run.progress
        median = statistics.median(self.step_seconds)
        spent = progress.train_seconds + self.untimed * median
        slowest = accelerator.gather(torch.tensor([median, spent], device=accelerator.device)).view(-1, 2).amax(0)
        step_s, progress.train_seconds = slowest.tolist()
        self.step_seconds, self.untimed = [], 0
        cap = cfg.total_steps(progress.step, progress.tokens_applied)
        wanted = budget_steps(
            cfg.time_budget_minutes, step_s, elapsed_s=progress.train_seconds, done=progress.step, cap=cap
        )
        decided, total = progress.total_steps, run.schedule.nearest_span(wanted, run.total_steps)
        if total == decided:
            return
        run.span(total)
        accelerator.log({"total_steps": total, "budget_step_time_s": step_s}, step=progress.step)
        if decided:  # a re-timing: logged, and the progress bar's total moves
            return
        capped = ", the most max_steps allows" if total == cap else ""
        retimed = " (re-timed at each log step until its decay starts)" if cfg.lr_schedule == "wsd" else ""
        accelerator.print(
            f"time budget: {step_s:.2f} s a step here, so {total} steps ({total * cfg.total_batch_tokens:,} tokens"
            f"{capped}) in {cfg.time_budget_minutes:g} min of training; the lr schedule ends there{retimed}"
        )

    def due(self, step: int) -> bool:
        return due(self.run.cfg.log_interval, step, self.run.is_last(step))

    def log(self, step: int, out: StepOutput) -> dict[str, float]:
        """Log the train row for `step` (the one host read of loss and grad norm) and start a new window."""
        run, accelerator = self.run, self.run.accelerator
        world_size = accelerator.num_processes
        lrs = run.schedule.lrs_of_step(step)  # the step's own, not the next one's
        row = {
            "train_loss": accelerator.reduce(out.loss, "mean").item(),
            "lr": lrs[0],  # AdamW's (its groups come first)
            "grad_norm": out.grad_norm.item(),
        }
        if run.cfg.optimizer == "muon":
            row["muon_lr"] = lrs[-1]  # the last group's (GPT.optimizer_groups)
        if self.window_steps:  # none when the first step is also a log step
            step_s = self.window_s / self.window_steps
            tokens_per_sec = run.cfg.total_batch_tokens / step_s
            row |= {
                "step_time_s": step_s,
                "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_device": tokens_per_sec / world_size,
                "mfu": run.flops_per_token * tokens_per_sec / (run.peak_tflops * 1e12 * world_size),
            }
        row |= {"tokens_seen": run.progress.tokens_seen, "epoch": run.train_loader.epoch}
        row |= memory_stats(accelerator.device)
        accelerator.log(row, step=step)
        self.window_s, self.window_steps = 0.0, 0
        return row


@torch.no_grad()
def window_loss_sum(model: torch.nn.Module, windows: EvalWindows, device: torch.device) -> torch.Tensor:
    """The sum of the mean losses of this rank's share of `windows`; summed over ranks and divided by
    len(windows.indices) it is the mean over the whole set. `model(x, y)` returns (anything, the mean loss over
    the targets that are not IGNORE_INDEX), as our GPT and nanoGPT-style models do."""
    total = torch.zeros((), device=device)
    for x, y in windows:
        real = int((y[:, 0] != IGNORE_INDEX).sum())  # windows of the set; the other rows fill the micro-batch
        _, loss = model(x.to(device), y.to(device))
        if real:
            total += loss * real
    return total


def force_eager() -> contextlib.AbstractContextManager:
    """torch.compile's stance "force_eager" where something may be compiled; where torch._dynamo was never imported
    nothing is, and an eager process is spared that import (1.9 s)."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Val loss over the `eval_windows` windows spread over the val split (a fixed set, so evals compare), plus
    the `eval_tasks` benchmark scores; the same numbers on every rank.

    Eager, also under a compiling launch YAML: in eval mode and without grad the compiled model would compile a
    graph of its own (the step-0 eval, before the first step, paid it: 93 of 309 s to the first step on a busy
    2-core CPU at tiny-cpu, and tens of seconds on a GPU), and the benchmarks' varying lengths more. A forward pass
    costs a third of a step; eager, the loss takes its fused form (modeling.fused_ce.takes_full_logits)."""
    cfg, accelerator, model = run.cfg, run.accelerator, run.model
    with force_eager():
        model.eval()
        loss_sum = accelerator.reduce(window_loss_sum(model, run.val_windows, accelerator.device), "sum")
        model.train()
        metrics = {"val_loss": loss_sum.item() / len(run.val_windows.indices)}
        if cfg.eval_tasks:
            metrics.update(evaluate_tasks(model, accelerator, cfg.eval_tasks, cfg.eval_limit, get_encoding()))
    return metrics


@torch.no_grad()
def write_sample(run: Run, step: int) -> None:
    """A sample (temperature 1, top-k 50) from the configured prompt, appended to samples.txt. Every rank calls
    it: with sharded weights (FSDP2, ZeRO-3) generate() gathers them collectively. Eager: blocks compiled in place
    (regional compilation) would otherwise compile a graph for each new token's cache length. The text ends at the
    first <|endoftext|>, as evals.generate's samples do, cut after generating: stopping there could leave the ranks
    at different numbers of forward passes, and their collectives waiting for each other."""
    accelerator, model = run.accelerator, run.sampler
    model.eval()
    prompt = prompt_tokens(run.cfg.sample_prompt)
    idx = torch.tensor([prompt], device=accelerator.device)
    generator = torch.Generator(device=accelerator.device).manual_seed(step)
    with accelerator.autocast(), force_eager():
        out = model.generate(idx, run.cfg.sample_tokens, temperature=1.0, top_k=50, generator=generator)
    model.train()
    text = sample_text(run.cfg.sample_prompt, out[0, len(prompt) :].tolist())
    if accelerator.is_main_process:
        samples = run.run_dir / SAMPLES_FILE
        kept = "it keeps every complete sample, the checkpoints are untouched"
        with disk_full_reported(samples, kept):
            append_bytes(samples, f"{sample_header(step)}{text}\n".encode())
    accelerator.print(f"sample @ step {step}: {text!r}")


def write_outputs(run: Run) -> None:
    """The run folder's deliverables: the loss curve, a transformers-loadable export with its model card, and
    the Hub push when asked for."""
    cfg, accelerator, run_dir = run.cfg, run.accelerator, run.run_dir
    # The final checkpoint is complete by now: after a full disk, a resumed run is at its last step and writes these.
    # None in run_dir: a run continued from another folder's checkpoint at its last step, which is the final one.
    checkpoints = list_checkpoints(run_dir)
    final = checkpoints[-1] if checkpoints else run.resumed_from
    kept = f"the final checkpoint {final} and metrics.jsonl are complete"
    if accelerator.is_main_process:
        for plot, png in [(plot_losses, LOSS_PLOT)] + ([(plot_evals, EVALS_PLOT)] if cfg.scores_tasks() else []):
            with disk_full_reported(run_dir / png, kept):
                plot(run_dir / METRICS_FILE, run_dir / png)
    if cfg.export_hf:
        export_model = final_model(run, final)  # on the main process; None on the others
        if export_model is not None:
            with disk_full_reported(run_dir / EXPORT_DIR, kept):
                export_final(run_dir, export_model, run.progress.step)
                write_model_card(run_dir, cfg.push_to_hub or None)
    written = [LOSS_PLOT, *([EVALS_PLOT] if cfg.scores_tasks() else []), *([f"{EXPORT_DIR}/"] if cfg.export_hf else [])]
    accelerator.print(f"run folder: {run_dir} (checkpoints: {len(checkpoints)}, {', '.join(written)})")
    if cfg.push_to_hub and accelerator.is_main_process:
        accelerator.print(f"pushed to {push(run_dir, cfg.push_to_hub, private=cfg.hub_private_repo)}")


def final_model(run: Run, final_checkpoint: Path) -> GPT | None:
    """The trained weights in a plain GPT on the main process (None on the others; every rank must call it). From
    the model itself (gathered from its shards under FSDP2), except under DeepSpeed: ZeRO's module holds the weights
    in the compute dtype (bf16 on GPUs), under ZeRO-3 a shard that accelerate gathers only where
    zero3_save_16bit_model is on (off by `accelerate config`'s default), so there the final checkpoint's fp32 master
    weights, read as `python -m training.export` reads them."""
    accelerator = run.accelerator
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        if not accelerator.is_main_process:
            return None
        with contextlib.redirect_stderr(io.StringIO()):  # zero_to_fp32's progress lines: the run's last are its own
            return load_checkpoint(run.run_dir, final_checkpoint)[0]
    state_dict = accelerator.get_state_dict(run.model)  # a collective under FSDP2
    if not accelerator.is_main_process:
        return None
    model = GPT(run.model_config)
    model.load_state_dict(plain_state_dict(state_dict))
    return model


def export_final(run_dir: Path, model: GPT, step: int) -> None:
    """The run's export/ (a transformers folder) of the weights of optimizer step `step`, which it records, written
    under a temporary name and renamed into place (replacing the export of an earlier end of this run, resumed since).
    A failure leaves the checkpoints, and says how to export the newest of them, which holds these same weights."""
    export = run_dir / EXPORT_DIR
    try:
        from modeling.hf_export import export_hf  # imports transformers (~3 s): only runs that export pay for it

        export_hf(model, export, gpt2_vocab_and_merges(), step)  # written whole or not at all
    except Exception as err:  # after all the training, whatever it is: one line that says how to finish the job
        if is_disk_full(err, export):
            raise
        raise ExportError(
            f"the export to {export} failed after training ({type(err).__name__}: {err}); the run's checkpoints are "
            f"kept: export the newest (the final weights) with `python -m training.export {shlex.quote(str(run_dir))}`"
        ) from err
