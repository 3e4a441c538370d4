"""Checkpoint folders: `checkpoints/step-00001000/`, written under a temporary name and renamed into place.

A folder without the `.tmp` suffix is complete by construction, so `--resume auto` can trust the newest one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.checkpointing import load_custom_state
from accelerate.utils import DistributedType

from modeling.disk import RERUN, DiskFull, disk_full_line, is_disk_full
from modeling.runs import (
    checkpoint_dir,
    checkpoint_engine,
    checkpoint_weights,
    is_checkpoint_dir,
    list_checkpoints,
    merge_shards,
)
from training.config import ConfigError, TrainConfig


def _not_the_tied_head(record: logging.LogRecord) -> bool:
    """safetensors stores a shared tensor once, so accelerate drops GPT's lm_head.weight (tied to wte.weight) and
    warns on every save; loading wte.weight restores both (the resume tests check it exactly), so that one
    warning is noise. Any other shared tensor still warns."""
    return "Removed shared tensor {'lm_head.weight'} while saving" not in record.getMessage()


logging.getLogger("accelerate.utils.other").addFilter(_not_the_tied_head)


@dataclass
class TrainProgress:
    """Counters saved with every checkpoint (registered with `accelerator.register_for_checkpointing`)."""

    step: int = 0  # optimizer steps taken
    tokens_seen: int = 0  # training tokens consumed over all ranks
    total_steps: int = 0  # the steps a time budget decided on (0: none decided; the config's count)
    train_seconds: float = 0.0  # a time budget's train-step time spent, as of its last decision
    # The batch shape of the launch that took the steps: processes, micro-batch size, accumulation (0: not known,
    # a checkpoint written before resumes could change it). A resume may change it (see `reshape`).
    world_size: int = 0
    micro_batch_size: int = 0
    grad_accum: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.total_steps = state.get("total_steps", 0)  # absent from checkpoints written before time budgets
        self.train_seconds = state.get("train_seconds", 0.0)  # absent from those written before re-timing
        self.world_size = state.get("world_size", 0)  # absent from those written before elastic resumes
        self.micro_batch_size = state.get("micro_batch_size", 0)
        self.grad_accum = state.get("grad_accum", 0)

    def reshape(self, world_size: int, micro_batch_size: int, grad_accum: int) -> str | None:
        """Take this launch's batch shape; after a resume, what changed from the checkpoint's (None: nothing, or
        the checkpoint does not say)."""
        saved = (self.world_size, self.micro_batch_size, self.grad_accum)
        now = (world_size, micro_batch_size, grad_accum)
        self.world_size, self.micro_batch_size, self.grad_accum = now
        if 0 in saved or saved == now:
            return None
        names = ("world size", "micro-batch", "accumulation")
        return ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(names, saved, now))


def ensure_writable(run_dir: str | Path) -> None:
    """Fail before training, not at the first checkpoint, when the run folder can't be written."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):  # a unique name: every rank probes the same folder at once
            pass
    except OSError as err:
        raise NotADirectoryError(
            f"out_dir {run_dir} is not writable ({err.strerror}); choose another --out-dir"
        ) from None


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """'' -> None; 'auto' -> newest complete checkpoint of this run (None if there is none); else that path."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path.is_dir() and is_checkpoint_dir(path)):
        raise FileNotFoundError(
            f"--resume {resume}: not a checkpoint folder (expected .../checkpoints/step-NNNNNNNN); "
            f"complete ones in {run_dir}: {[str(p) for p in list_checkpoints(run_dir)] or 'none'}"
        )
    return path


def _shape(cfg: TrainConfig) -> str:
    m = cfg.model_config()
    return (f"{cfg.init_from or cfg.preset} (n_layer {m.n_layer}, n_head {m.n_head}, n_embd {m.n_embd}, "
            f"block_size {m.block_size}, vocab_size {m.vocab_size}, bias {m.bias})")  # fmt: skip


def compare_resume_config(cfg: TrainConfig, checkpoint: Path) -> str | None:
    """Before anything is loaded: stop (ConfigError) when the checkpoint holds another model shape or another
    optimizer's state; else one line listing how this launch's config differs from the checkpoint's (None when it
    doesn't, or nothing says).

    The checkpoint's config.yaml is the launch that wrote it; older checkpoints have only their run folder's."""
    saved_yaml = next((p for p in (checkpoint, checkpoint.parent.parent) if (p / "config.yaml").is_file()), None)
    if saved_yaml is None:
        return None
    now = dataclasses.asdict(cfg)
    saved = {k: v for k, v in yaml.safe_load((saved_yaml / "config.yaml").read_text()).items() if k in now}
    theirs = TrainConfig(**saved)
    if _shape(theirs) != _shape(cfg):
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint is a {_shape(theirs)} model, this run's is {_shape(cfg)}; resume "
            "with the checkpoint's --preset/--block-size/--init-from, or start a new run with another --out-dir"
        )
    if theirs.optimizer != cfg.optimizer:  # the saved optimizer state is the other optimizer's
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint holds {theirs.optimizer} state, this run asks for "
            f"--optimizer {cfg.optimizer}; resume with --optimizer {theirs.optimizer}, or start a new run with another "
            "--out-dir (--init-from its export keeps the weights)"
        )
    changed = [f"{k} {v!r} -> {now[k]!r}" for k, v in saved.items() if k != "resume" and v != now[k]]
    return f"resuming with a changed config (checkpoint -> now): {', '.join(changed)}" if changed else None


# What a run stopped by a full disk is told to do (`{mount}`: see modeling.disk.disk_full_line).
RERUN_RESUMING = f"{RERUN} with --resume auto"


class CheckpointError(DiskFull):
    """A checkpoint could not be written for want of space (the folder left behind was removed)."""


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """What one checkpoint takes, before any exists: the weights plus AdamW's two moments of the same size (an
    optimizer with less state, such as Muon's one buffer, takes less)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


def clear_partial(run_dir: str | Path) -> None:
    """Remove this run's half-written checkpoints (`step-N.tmp`), which hold disk space: the run-folder lock
    guarantees no live run is writing them."""
    for stale in (Path(run_dir) / "checkpoints").glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def room_warning(run_dir: str | Path, one_checkpoint: int) -> str | None:
    """A start-up line when out_dir's filesystem cannot hold two more checkpoints (a save writes the new one
    before pruning the old)."""
    free = shutil.disk_usage(run_dir).free
    if free >= 2 * one_checkpoint:
        return None
    return (
        f"warning: out_dir {run_dir} has {_mb(free)} free, less than two checkpoints need ({_mb(2 * one_checkpoint)}); "
        "a save will fail: free space or choose another --out-dir"
    )


def save_checkpoint(accelerator: Accelerator, run_dir: str | Path, step: int, keep: int, meta: dict, need: int) -> Path:
    """`accelerator.save_state` into step-N.tmp, then rename to step-N and prune (see `prune_checkpoints`).

    save_state writes model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl and one
    custom_checkpoint_<i>.pkl per registered object (training progress, data loader position); we add
    meta.json (step, tokens seen, val loss when evaluated at this step) and the run's config.yaml (this launch's,
    which a resume compares with). A failed save leaves no folder behind; when the disk is what failed (less free
    than `need`, one checkpoint's bytes, or the last one's size) it raises CheckpointError saying so.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        clear_partial(run_dir)  # left by a run killed mid-save: they hold the space this save needs
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "meta.json").write_text(json.dumps(meta))
            shutil.copy2(Path(run_dir) / "config.yaml", tmp / "config.yaml")
    except Exception as err:  # torch reports a full disk as RuntimeError, safetensors and json as OSError
        shutil.rmtree(tmp, ignore_errors=True)
        complete = list_checkpoints(run_dir)
        need = _size(complete[-1]) if complete else need
        if not is_disk_full(err, run_dir, need):
            raise
        free = shutil.disk_usage(Path(run_dir)).free
        todo = (
            f"free space on {{mount}} ({_mb(need)} needed, {_mb(free)} free), lower --keep-checkpoints (a save needs "
            "room for one more than it keeps) or choose another --out-dir, then run the same command again with "
            "--resume auto"
        )
        kept = f"complete checkpoints untouched: {', '.join(p.name for p in complete) or 'none'}"
        raise CheckpointError(disk_full_line(final, kept, todo)) from err
    if accelerator.is_main_process:
        if final.exists():  # re-saving a step: swap so a complete copy exists at every instant
            stale = final.with_name(final.name + ".old")
            final.rename(stale)
            tmp.rename(final)
            shutil.rmtree(stale)
        else:
            tmp.rename(final)
        prune_checkpoints(run_dir, keep)
    accelerator.wait_for_everyone()
    return final


def _val_loss(checkpoint: Path) -> float | None:
    meta = checkpoint / "meta.json"
    return json.loads(meta.read_text()).get("val_loss") if meta.is_file() else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` (>= 1, so the resumable state survives) checkpoints and the one with the
    best val loss; returns the kept."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is the run's resumable state), got {keep}")
    found = list_checkpoints(run_dir)
    scored = [p for p in found if _val_loss(p) is not None]
    best = min(scored, key=_val_loss) if scored else None
    kept = found[-keep:]
    for old in found:
        if old not in kept and old != best:
            shutil.rmtree(old)
    return [p for p in found if p in kept or p == best]


def _engine(accelerator: Accelerator) -> str:
    """This launch's engine, named as checkpoint_engine names the one that wrote a checkpoint."""
    return {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed"}.get(
        accelerator.distributed_type, "DDP"
    )


_ENGINE_NAMES = {"DDP": "one process or DDP", "FSDP": "FSDP2", "DeepSpeed": "DeepSpeed"}
_RESUMES_ON = {
    "DDP": "on one process or with a DDP accelerate config",
    "FSDP": "with an FSDP2 or DDP accelerate config or on one process",
    "DeepSpeed": "with a DeepSpeed accelerate config",
}


def load_resume_state(
    accelerator: Accelerator,
    checkpoint: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    registered: list,
) -> str | None:
    """accelerator.load_state(checkpoint), on any number of processes. An FSDP2 checkpoint also resumes on one
    process or DDP: its model and optimizer shards (torch.distributed.checkpoint) are merged whole on each process
    and set with torch's state-dict API, which maps the saved parameter names onto this model (DDP and compile
    wrappers included); the schedule and the `registered` objects (accelerator.register_for_checkpointing's, in
    order) load as accelerate saved them. Other crossings of engines stop with one line. Returns what crossed
    (None: the engine that saved it loads it)."""
    saved, now = checkpoint_engine(checkpoint), _engine(accelerator)
    if saved == now or saved is None:  # None: accelerate names the missing file
        accelerator.load_state(str(checkpoint))
        return None
    if (saved, now) != ("FSDP", "DDP"):
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint was written by {_ENGINE_NAMES[saved]} and this launch runs "
            f"{_ENGINE_NAMES[now]}; resume it {_RESUMES_ON[saved]}, or start a new run with --init-from on its export "
            "(python -m training.export)"
        )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, checkpoint_weights(checkpoint)[0], options=whole)
    optimizer_state = merge_shards(checkpoint / "optimizer_0")["optimizer"]
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), optimizer_state, options=whole)
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.bin", weights_only=False))
    for index, obj in enumerate(registered):
        load_custom_state(obj, str(checkpoint), index)
    return "FSDP2 shards -> one whole model per process"
