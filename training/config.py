"""The one training config: a dataclass whose fields are also the YAML keys and the CLI flags.

The defaults are the recommended recipe (GPT-2 124M, Muon + AdamW, warmup-stable-decay); a run config holds only
what differs from them. Precedence: dataclass defaults < run-config file (``--config configs/x.yaml``) < command line.
Topology (processes, precision, compile, FSDP/DeepSpeed) lives only in the accelerate YAML, never here.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, ClassVar

import yaml

from modeling.config import GPTConfig, get_preset
from modeling.fp8_head import DIM_MULTIPLE as FP8_DIM_MULTIPLE
from modeling.runs import SHAPE_FIELDS, SHAPE_FLAGS, model_shape, shape_name

DEFAULT_DATA_DIR = "data/default"  # the embedded corpus; prepared automatically when missing
AUTO = "auto"  # micro_batch_size's value for "the largest that fits" (training.micro_batch)
INT_OR_AUTO = int | str  # micro_batch_size's type: a number or AUTO
OPTIMIZERS = ("adamw", "muon")
LR_SCHEDULES = ("cosine", "wsd")
ON_NEW_DATA = ("stop", "continue")
# Old names of renamed keys (YAML key or flag) -> the current name: still accepted, with one warning line.
RENAMED = {"eval_batches": "eval_windows"}
# A time budget is decided at the end of the warmup, from its steps after the first (which compiles): two at least.
BUDGET_MIN_WARMUP = 3


class ConfigError(ValueError):
    """A bad config value or key; the message says what was wrong and how to fix it."""


@dataclass
class TrainConfig:
    # --- model and data ---
    preset: str = field(
        default="gpt2-124m",
        metadata={
            "help": "model preset from modeling.config.PRESETS: the shape a run trains, unless n_layer, n_head, "
            "n_embd or block_size set their own over it"
        },
    )
    n_layer: int | None = field(
        default=None, metadata={"help": "transformer blocks; null: the preset's (models trained from scratch only)"}
    )
    n_head: int | None = field(
        default=None,
        metadata={
            "help": "attention heads, which must divide n_embd (GPT-2's heads are 64 wide); null: the preset's "
            "(models trained from scratch only)"
        },
    )
    n_embd: int | None = field(
        default=None, metadata={"help": "residual stream width; null: the preset's (models trained from scratch only)"}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": "context length (learned positions); null: the preset's, or init_from's n_positions. Any length "
            "for a model trained from scratch; with init_from at most its n_positions (the positions past them were "
            "never trained)"
        },
    )
    init_from: str = field(
        default="",
        metadata={
            "help": "start from these weights instead of a random init: a transformers GPT-2 folder (a run's "
            "export/) or a Hub id such as gpt2; its shape replaces the preset's"
        },
    )
    data_dir: str = field(
        default=DEFAULT_DATA_DIR,
        metadata={"help": f"folder with manifest.json and shards; {DEFAULT_DATA_DIR} is prepared on first use"},
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "recompute each block's activations in backward instead of storing them (per block, any engine): "
            "activation memory falls to ~1/9 + 1/n_layer of it for ~1/3 more compute; for models that do not fit"
        },
    )
    fp8_head: bool = field(
        default=False,
        metadata={
            "help": "the tied head's logits from an FP8 matmul (torch._scaled_mm: e4m3 forward, e5m2 gradients) where "
            "the loss takes the full logits (compiled, on CUDA); only on GPUs of compute capability 8.9+ (Ada, "
            "Hopper), elsewhere it stays off and the run says so; needs an n_embd divisible by 16"
        },
    )
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank (0: batches are tiny)"})
    # --- batch and budget (the token budget is the source of truth) ---
    micro_batch_size: int | str = field(
        default=16,
        metadata={
            "help": "sequences per forward pass per device, or auto: on CUDA the largest power of two up to 64 that "
            "divides the step's sequences per device and fits the free memory with headroom (estimated: "
            "training.micro_batch), elsewhere 8"
        },
    )
    total_batch_tokens: int = field(
        default=131_072,
        metadata={"help": "tokens per optimizer step over all ranks; sets gradient accumulation"},
    )
    max_steps: int = field(
        default=200,
        metadata={"help": "optimizer steps to train (200 × 131,072 tokens: ~15 epochs of the default train split)"},
    )
    max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "token budget; when set it overrides max_steps (a --max-steps flag replaces a run config's); a "
            "resume with another total_batch_tokens trains the steps that bring the tokens trained to it"
        },
    )
    time_budget_minutes: float = field(
        default=0.0,
        metadata={
            "help": "minutes of train steps (evals and saves not counted): at the end of the warmup the run times "
            "its steps and trains as many as fit, at most max_steps (or max_tokens), with the schedule spanning them "
            "(under wsd re-timed at each log step until the decay); 0: no time budget"
        },
    )
    # --- optimizer and schedule: Muon + AdamW under warmup-stable-decay, the recipe that won bench.time_to_loss ---
    optimizer: str = field(
        default="muon",
        metadata={
            "help": "muon: torch.optim.Muon (its Newton-Schulz in the launch YAML's precision, bf16 or fp32) for the "
            "blocks' 2-D matrices (at muon_lr) and AdamW (at lr) for the embeddings, LayerNorm gains and biases; "
            "adamw: AdamW for every tensor (GPT-2's recipe: add --lr-schedule cosine). Engines that shard each "
            "matrix (FSDP2, DeepSpeed) cannot run Muon: there the default trains with adamw, and saying muon stops"
        },
    )
    lr: float = field(
        default=6e-4,
        metadata={
            "help": "peak lr of AdamW: of every tensor under adamw, of the embeddings, norms and biases under muon. "
            "6e-4 is GPT-2 124M's AdamW lr (GPT-3 paper), right for both at 124M; larger models take less "
            "(GPT-3: 3e-4 at 350M, 2.5e-4 at 760M, 2e-4 at 1.3B), tiny CPU models more (3e-3 to 6e-3)"
        },
    )
    muon_lr: float = field(
        default=0.02,
        metadata={
            "help": "peak learning rate of Muon's matrices (optimizer muon), scaled per matrix by "
            "sqrt(max(1, rows / cols)) as in modded-nanogpt (0.02: its tuned value at 124M)"
        },
    )
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon's (Nesterov) momentum (optimizer muon)"})
    muon_momentum_warmup_steps: int = field(
        default=0,
        metadata={
            "help": "steps over which Muon's momentum rises linearly from 0.85 to muon_momentum (one of 0.85 or "
            "less stays as it is); 0: none"
        },
    )
    lr_schedule: str = field(
        default="wsd",
        metadata={
            "help": "after the linear warmup: cosine (decay to min_lr_ratio over the remaining steps) or wsd "
            "(warmup-stable-decay: constant, then linear decay to min_lr_ratio over the last decay_fraction of steps)"
        },
    )
    decay_fraction: float = field(
        default=0.2, metadata={"help": "fraction of all steps spent in the final linear decay (lr_schedule wsd)"}
    )
    decay_steps: int = field(
        default=0,
        metadata={
            "help": "steps in the final linear decay (lr_schedule wsd), counted back from the last step; when set it "
            "overrides decay_fraction (an anneal after a stable run of N steps: --max-steps N+K --decay-steps K)"
        },
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr as a fraction of the peak"})
    warmup_steps: int = field(default=20, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(
        default=0.1,
        metadata={"help": "decoupled weight decay on 2D+ tensors only (AdamW's and, under muon, Muon's matrices)"},
    )
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1"})
    beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global grad norm; 0 disables clipping"})
    max_bad_steps: int = field(
        default=5,
        metadata={
            "help": "consecutive non-finite-gradient steps skipped before the run aborts (fp16: loss-scale overflows "
            "not counted)"
        },
    )
    seed: int = field(default=1337, metadata={"help": "seed for init, data order and sampling"})
    # --- evaluation, logging, checkpoints ---
    out_dir: str = field(default="runs/default", metadata={"help": "run folder for logs, checkpoints, export"})
    log_interval: int = field(default=5, metadata={"help": "steps between logged metrics"})
    eval_interval: int = field(default=25, metadata={"help": "steps between val-loss evals; 0 disables"})
    eval_windows: int = field(
        default=320,
        metadata={
            "help": "val windows (block_size tokens each) per eval, spread evenly over the val split: the same set "
            "on any number of processes (all windows when the split has fewer)"
        },
    )
    eval_tasks: str = field(
        default="", metadata={"help": "benchmarks scored at every eval, e.g. hellaswag,lambada (see evals/)"}
    )
    eval_limit: int | None = field(default=None, metadata={"help": "first N examples per eval task (None: all)"})
    sample_interval: int = field(default=100, metadata={"help": "steps between text samples; 0 disables"})
    sample_prompt: str = field(default="ROMEO:", metadata={"help": "prompt for text samples"})
    sample_tokens: int = field(default=64, metadata={"help": "new tokens per text sample"})
    checkpoint_interval: int = field(default=100, metadata={"help": "steps between checkpoints; 0: end only"})
    keep_checkpoints: int = field(
        default=2,
        metadata={
            "help": "newest step checkpoints kept on disk (>= 1: the newest is the run's resumable state), plus the "
            "best-val one and, under wsd, the one from before the decay (where a longer run branches off); to save "
            "less often raise --checkpoint-interval"
        },
    )
    resume: str = field(
        default="auto",
        metadata={
            "help": "auto: continue the run in out_dir from its newest intact checkpoint (an empty out_dir starts "
            "afresh), so the same command run again continues; never: start afresh, first moving a run that "
            "out_dir holds into out_dir/previous-<time>/; or a checkpoint folder (.../step-NNNNNNNN) to continue from"
        },
    )
    on_new_data: str = field(
        default="stop",
        metadata={
            "help": "what a resume does where --data-dir holds other tokens than the checkpoint's data (books added, "
            "a subset for the decay): stop says so and changes nothing; continue keeps the weights, optimizer, "
            "schedule and step and reads the new data from its start. The checkpoint's own data resumes its position "
            "either way"
        },
    )
    trackers: str = field(default="", metadata={"help": "comma list of extra accelerate trackers, e.g. tensorboard"})
    peak_tflops: float | None = field(
        default=None, metadata={"help": "per-device peak TFLOP/s for MFU; default: table or measured"}
    )
    export_hf: bool = field(default=True, metadata={"help": "write a transformers folder at the end"})
    push_to_hub: str = field(
        default="", metadata={"help": "Hub repo id (you/name) to push the export and model card to at the end"}
    )
    hub_private_repo: bool = field(
        default=False,
        metadata={"help": "create the --push-to-hub repository as private (one that exists keeps its visibility)"},
    )

    # The fields the run-config file or the command line set (parse_config), as opposed to defaults: where the
    # engine cannot run the default optimizer the run takes another, but never one the user asked for.
    explicit: ClassVar[frozenset[str]] = frozenset()

    def replace(self, **changes: Any) -> TrainConfig:
        """dataclasses.replace, keeping `explicit` (a class variable there, which replace would reset)."""
        changed = dataclasses.replace(self, **changes)
        changed.explicit = self.explicit
        return changed

    def model_config(self) -> GPTConfig:
        """The model's shape: init_from's (a transformers folder or Hub id) or the preset's with n_layer, n_head and
        n_embd set over it; with block_size."""
        try:
            return model_shape(self.preset, self.block_size, self.init_from, self.n_layer, self.n_head, self.n_embd)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def model_name(self) -> str:
        """The model as the run's lines name it: init_from, or the preset and what the run sets over its shape."""
        return self.init_from or shape_name(self.preset, self.n_layer, self.n_head, self.n_embd)

    def __post_init__(self) -> None:
        """Every value checked here, once, so bad input fails before any work with one line saying what to use."""
        self.init_from = str(Path(self.init_from).expanduser()) if self.init_from.startswith("~") else self.init_from
        if self.init_from and Path(self.init_from).is_dir():  # absolute: export, evals, resume read its shape anywhere
            self.init_from = str(Path(self.init_from).resolve())
        try:
            get_preset(self.preset)
        except ValueError as err:  # unknown name: the message lists the valid ones
            raise ConfigError(str(err)) from None
        if self.keep_checkpoints < 1:
            raise ConfigError(
                f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}: the newest checkpoint is the run's "
                "resumable state; to save less often raise --checkpoint-interval (0: at the end only)"
            )
        if isinstance(self.micro_batch_size, str) and self.micro_batch_size != AUTO:
            raise ConfigError(f"micro_batch_size must be a whole number >= 1 or auto, got {self.micro_batch_size!r}")
        numbers = ("micro_batch_size",) if self.micro_batch_size != AUTO else ()
        positive = (*numbers, "total_batch_tokens", "max_steps", "log_interval", "eval_windows")
        for name in (*positive, "max_bad_steps", "sample_tokens"):
            if getattr(self, name) < 1:
                auto = " or auto" if name == "micro_batch_size" else ""  # the largest that fits: also an answer
                raise ConfigError(f"{name} must be >= 1{auto}, got {getattr(self, name)}")
        for name in (
            "warmup_steps",
            "decay_steps",
            "muon_momentum_warmup_steps",
            "eval_interval",
            "sample_interval",
            "checkpoint_interval",
            "num_workers",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (*SHAPE_FLAGS, "max_tokens", "eval_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (or null for the default), got {getattr(self, name)}")
        if not self.init_from or any(getattr(self, name) is not None for name in SHAPE_FIELDS):
            # the shape of a model trained from scratch, checked now (no file is read); an init_from run with shape
            # fields too is refused before its folder is read
            shape = self.model_config()
            if self.fp8_head and shape.n_embd % FP8_DIM_MULTIPLE:
                raise ConfigError(
                    f"fp8_head needs an n_embd divisible by {FP8_DIM_MULTIPLE} (torch._scaled_mm's FP8 matmul "
                    f"takes no other), got {shape.n_embd}: give another --n-embd, or --fp8-head false"
                )
        choices = (("optimizer", OPTIMIZERS), ("lr_schedule", LR_SCHEDULES), ("on_new_data", ON_NEW_DATA))
        for name, valid in choices:
            if getattr(self, name) not in valid:
                raise ConfigError(f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}")
        for name, example in (("out_dir", "runs/mine"), ("data_dir", "data/mybooks")):
            if not getattr(self, name).strip():  # '' is the working folder: no run or corpus should be mixed in there
                raise ConfigError(f"{name} may not be empty: give a folder, e.g. --{name.replace('_', '-')} {example}")
        if not self.resume:  # '' meant 'do not resume' before auto became the default
            raise ConfigError(f"resume must be auto, never or a checkpoint folder, got {self.resume!r}")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        floats = (  # name, whether its value is valid, the rule; every float must also be finite
            ("lr", self.lr > 0, "> 0"),
            ("muon_lr", self.muon_lr > 0, "> 0"),
            ("muon_momentum", 0 <= self.muon_momentum < 1, "in [0, 1)"),
            ("decay_fraction", 0 <= self.decay_fraction <= 1, "in [0, 1]"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("beta1", 0 <= self.beta1 < 1, "in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "in [0, 1)"),
            ("grad_clip", self.grad_clip >= 0, ">= 0 (0 disables clipping)"),
            ("peak_tflops", self.peak_tflops is None or self.peak_tflops > 0, "> 0 (or null to measure it)"),
            ("time_budget_minutes", self.time_budget_minutes >= 0, ">= 0 (0: no time budget)"),
        )
        for name, valid, rule in floats:
            value = getattr(self, name)
            if not valid or (value is not None and not math.isfinite(value)):
                raise ConfigError(f"{name} must be {rule}, got {value}")
        if self.push_to_hub and not self.export_hf:
            raise ConfigError("--push-to-hub pushes the run's export: drop --export-hf false")
        if self.hub_private_repo and not self.push_to_hub:  # privacy asked for, and nothing would be pushed
            raise ConfigError("--hub-private-repo is for --push-to-hub's repository: give --push-to-hub you/name too")
        if self.decay_steps > self.total_steps():
            raise ConfigError(
                f"decay_steps {self.decay_steps} is more than the run's {self.total_steps()} steps: the decay counts "
                "back from the last step; raise --max-steps or lower --decay-steps"
            )
        if self.time_budget_minutes and self.warmup_steps < BUDGET_MIN_WARMUP:
            raise ConfigError(
                f"time_budget_minutes needs warmup_steps >= {BUDGET_MIN_WARMUP}, got {self.warmup_steps}: the run "
                "times its steps during the warmup, whose lrs do not depend on how many steps follow"
            )

    def scores_tasks(self) -> bool:
        """Whether the run scores eval_tasks: at its val evals, so never with eval_interval 0."""
        return bool(self.eval_tasks) and self.eval_interval > 0

    def total_steps(self, step: int = 0, tokens_applied: int = 0) -> int:
        """Optimizer steps to run: from the token budget when one is given, else max_steps. A run at `step` whose
        steps held `tokens_applied` tokens (a resume, perhaps with another total_batch_tokens than its steps so far
        had) ends at the step that brings them to the budget."""
        return run_steps(self.max_steps, self.max_tokens, self.total_batch_tokens, step, tokens_applied)


def run_steps(
    max_steps: int, max_tokens: int | None, total_batch_tokens: int, step: int = 0, tokens_applied: int = 0
) -> int:
    """TrainConfig.total_steps of these fields (also of a run's saved config.yaml, read as a dict)."""
    if max_tokens is None:
        return max_steps
    return step + -(-max(0, max_tokens - tokens_applied) // total_batch_tokens)


def grad_accum_steps(total_batch_tokens: int, micro_batch_size: int, block_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step, so that every step sees exactly ``total_batch_tokens`` tokens."""
    tokens_per_micro_step = micro_batch_size * block_size * world_size
    if total_batch_tokens % tokens_per_micro_step:
        nearest = max(1, round(total_batch_tokens / tokens_per_micro_step)) * tokens_per_micro_step
        sequences, whole = divmod(total_batch_tokens, block_size * world_size)  # a step's sequences per process
        # the largest micro-batch below the one asked for that divides them: the batch (the recipe) unchanged
        fits = next((m for m in range(micro_batch_size, 0, -1) if not sequences % m), None) if not whole else None
        keep = f"--micro-batch-size {fits} (the same batch), or " if fits else ""
        raise ConfigError(
            f"total_batch_tokens={total_batch_tokens} is not a multiple of micro_batch_size × block_size × "
            f"processes = {micro_batch_size} × {block_size} × {world_size} = {tokens_per_micro_step}; "
            f"use e.g. {keep}--total-batch-tokens {nearest}"
        )
    return total_batch_tokens // tokens_per_micro_step


def _field_types() -> dict[str, tuple[type, bool]]:
    """Field name -> (base type, whether None is allowed): `int | None` -> (int, True)."""
    out = {}
    hints = typing.get_type_hints(TrainConfig)
    for name, hint in ((f.name, hints[f.name]) for f in fields(TrainConfig)):
        args = typing.get_args(hint)
        optional = type(None) in args
        out[name] = (next(a for a in args if a is not type(None)) if optional else hint, optional)
    return out


COMMA_LISTS = ("eval_tasks", "trackers")  # str fields that hold a comma list of names


def _coerce(name: str, value: Any, kind: type, optional: bool) -> Any:
    """Check a YAML value's type (ints are fine where floats are expected)."""
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} may not be empty (null)")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if name in COMMA_LISTS and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # `trackers: [tensorboard, wandb]`, as YAML writes a list, is the flag's comma list
    if kind is float and isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string, not as the float it is
        try:
            return float(value)
        except ValueError:
            pass
    if kind is int and isinstance(value, (float, str)):  # 2.5e9 tokens: a string to YAML, 2.5e+9 a float
        try:
            return _whole_number(str(value))
        except ValueError:
            pass
    what = {INT_OR_AUTO: "a whole number or auto", int: "a whole number"}.get(kind) or kind.__name__
    if kind is bool and not isinstance(value, bool) or kind is not bool and isinstance(value, bool):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    if not isinstance(value, kind) or kind == INT_OR_AUTO and isinstance(value, str) and value != AUTO:
        raise ConfigError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    return value


def _closest_field(name: str) -> str | None:
    """The TrainConfig field a mistyped key or flag (either spelling: max-steps, max_steps) most resembles."""
    close = difflib.get_close_matches(name.replace("-", "_"), [f.name for f in fields(TrainConfig)], n=1)
    return close[0] if close else None


def _unknown_key(key: str, source: str) -> ConfigError:
    close = _closest_field(key)
    hint = f"; did you mean '{close}'?" if close else f"; valid keys: {', '.join(f.name for f in fields(TrainConfig))}"
    return ConfigError(f"unknown config key '{key}' in {source}{hint}")


def _unknown_flag(arg: str) -> ConfigError:
    """A command-line argument no flag takes, with the flag it resembles as it is typed (--max-steps, not the
    YAML key max_steps)."""
    flag = arg.split("=")[0]
    close = _closest_field(flag.lstrip("-"))
    hint = f"did you mean --{close.replace('_', '-')}?" if close else "`python train_accel.py --help` lists them"
    return ConfigError(f"unknown flag {flag!r} on the command line; {hint}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (lines {seen[key]} and {key_node.start_mark.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a run-config YAML into a dict of TrainConfig fields, with one clear error per problem."""
    path = Path(path)
    if not path.is_file():
        said = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"run config {path} {said}; give a YAML file (configs/ holds examples)")
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}  # a SafeLoader
    except UnicodeDecodeError as err:
        raise ConfigError(f"run config {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"run config {path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"run config {path} must be a mapping of key: value, got {type(values).__name__}")
    for key in values:
        if not isinstance(key, str):
            raise ConfigError(
                f"run config {path}: the key {key!r} is not a name (YAML reads an unquoted number, yes/no, on/off or "
                "null as a value); use the TrainConfig keys that `python train_accel.py --help` lists"
            )
    values = {_current_name(key, str(path)): value for key, value in values.items()}
    types_ = _field_types()
    for key in values:
        if key not in types_:
            raise _unknown_key(key, str(path))
    return {key: _coerce(key, value, *types_[key]) for key, value in values.items()}


def _current_name(key: str, source: str | None) -> str:
    """A renamed key's current name, with one warning line (on the main process only); other keys as given.
    `source`: the YAML file, or None for a flag."""
    new = RENAMED.get(key)
    if new is None:
        return key
    if source is None:
        old_new = f"--{key.replace('_', '-')} is now --{new.replace('_', '-')}"
    else:
        old_new = f"'{key}' in {source} is now '{new}'"
    if os.environ.get("RANK", "0") == "0":  # the launcher's global rank; not set for one process
        print(f"warning: {old_new}; the old name still works for now, use the new one", file=sys.stderr)
    return new


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _whole_number(text: str) -> int:
    """A whole number as written: 524288, 524_288, or in e-notation (2.5e9, as token budgets are written);
    ValueError for anything else (2.5e-3, 1.5, four)."""
    try:
        number = Decimal(text.strip())  # exact, where float(2.5e9 + 1) would round
    except InvalidOperation:
        raise ValueError(f"not a number: {text!r}") from None
    if not number.is_finite() or number != number.to_integral_value():
        raise ValueError(f"not a whole number: {text!r}")
    return int(number)


def _parse_int(text: str) -> int:
    try:
        return _whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _parse_int_or_auto(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    try:
        return _whole_number(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or {AUTO}, got {text!r}") from None


def _parse_optional(value: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag's parser that also takes none/null (or nothing) for None."""

    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null", "") else value(text)

    parse.__name__ = getattr(value, "__name__", "value")  # argparse's error names it: "invalid float value: 'x'"
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Pretrain a GPT on books. Launch with `accelerate launch --config_file accelerate_configs/X.yaml`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,  # a typo must be an error, not a silent prefix match
    )
    # appended, so that a second --config is refused rather than silently replacing the first
    parser.add_argument(
        "--config", action="append", help="run-config YAML of TrainConfig fields (applied before the flags)"
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    types_ = _field_types()
    # the flags' own default is SUPPRESS (only what was given overrides the run-config), so the help states the field's
    names = [
        (f.name, f.name, f"{f.metadata['help']} (default: {f.default or repr(f.default)})") for f in fields(TrainConfig)
    ]
    names += [(old, new, argparse.SUPPRESS) for old, new in RENAMED.items()]  # renamed by parse_config
    for name, current, help_ in names:
        kind, optional = types_[current]
        parse = {bool: _parse_bool, int: _parse_int, INT_OR_AUTO: _parse_int_or_auto}.get(kind, kind)
        if optional:
            parse = _parse_optional(parse)
        flags = [f"--{name.replace('_', '-')}"] + ([f"--{name}"] if "_" in name else [])
        parser.add_argument(*flags, dest=name, type=parse, default=argparse.SUPPRESS, help=help_)
    return parser


def parse_config(argv: list[str] | None = None) -> tuple[TrainConfig, bool]:
    """CLI + optional run-config file -> (TrainConfig, print_only)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if unknown:
        raise _unknown_flag(unknown[0])
    overrides = vars(args)
    config_paths = overrides.pop("config") or []
    if len(config_paths) > 1:
        raise ConfigError(
            f"--config is given {len(config_paths)} times ({', '.join(config_paths)}); a run takes one run config: "
            "merge them into one file, or give the values that differ as flags"
        )
    config_path = config_paths[0] if config_paths else None
    print_only = overrides.pop("print_config")
    values = load_yaml(config_path) if config_path else {}
    flags = {_current_name(key, None): value for key, value in overrides.items()}
    # max_tokens, where set, decides the run's length over max_steps: a --max-steps flag on a run config that gives
    # max_tokens (the PG-19 configs) would otherwise be ignored, where every other flag replaces the file's value
    if "max_steps" in flags and "max_tokens" not in flags:
        values.pop("max_tokens", None)
    values.update(flags)
    cfg = TrainConfig(**values)
    cfg.explicit = frozenset(values)
    return cfg, print_only


def config_to_yaml(config: TrainConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)


def print_config_yaml(config: TrainConfig) -> str:
    """The config as --print-config shows it: config_to_yaml's, each shape field left null followed by a comment with
    the value the run takes (the preset's, or init_from's), so the text still gives the same run as a --config file.
    The values themselves are not written in: set, they would name the model `PRESET with n_layer ...` on the run's
    lines and model card, and with init_from they are refused."""
    shape = None if config.init_from else config.model_config()  # init_from's is in its config.json (maybe the Hub)
    lines = []
    for line in config_to_yaml(config).splitlines():
        name, _, value = line.partition(": ")
        if name in SHAPE_FLAGS and value == "null":
            line += f"  # {config.preset}'s: {getattr(shape, name)}" if shape else "  # init_from's"
        lines.append(line)
    return "\n".join(lines) + "\n"
