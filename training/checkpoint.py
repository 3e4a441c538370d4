"""Checkpoint folders: `checkpoints/step-00001000/`, written under a temporary name and renamed into place.

A folder without the `.tmp` suffix is complete by construction, so `--resume auto` can trust the newest one.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate import Accelerator

_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class TrainProgress:
    """Counters saved with every checkpoint (registered with `accelerator.register_for_checkpointing`)."""

    step: int = 0  # optimizer steps taken
    tokens_seen: int = 0  # training tokens consumed over all ranks

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """'' -> None; 'auto' -> newest complete checkpoint of this run (None if there is none); else that path."""
    if not resume:
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path.is_dir() and _STEP_DIR.match(path.name)):
        raise FileNotFoundError(
            f"--resume {resume}: not a checkpoint folder (expected .../checkpoints/step-NNNNNNNN); "
            f"complete ones in {run_dir}: {[str(p) for p in list_checkpoints(run_dir)] or 'none'}"
        )
    return path


def save_checkpoint(accelerator: Accelerator, run_dir: str | Path, step: int, keep: int) -> Path:
    """`accelerator.save_state` into step-N.tmp, then rename to step-N and drop all but the newest `keep`.

    save_state writes model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl and one
    custom_checkpoint_<i>.pkl per registered object (training progress, data loader position).
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)  # left by a run killed mid-save
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # re-saving a step: swap so a complete copy exists at every instant
            stale = final.with_name(final.name + ".old")
            final.rename(stale)
            tmp.rename(final)
            shutil.rmtree(stale)
        else:
            tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
