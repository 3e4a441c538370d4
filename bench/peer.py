"""The external peer: build-nanogpt's GPT (karpathy/build-nanogpt, train_gpt2.py), trained the way its script does.

    python -m bench.ladder --rungs none --peer-dir /path/to/build-nanogpt [--preset small-cpu --micro-batch-size 8]

Nothing is copied or downloaded: the model classes are read from the peer's own train_gpt2.py at run time.
That script runs its whole training loop (fineweb shards, DDP set-up) at import, so only its top-level class
definitions, imports and its lr schedule (get_lr with its max_lr / min_lr) are executed (via ast); its own local
modules (hellaswag.py, eval only) are left out. bench.time_to_loss trains it with that schedule.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn

from modeling.config import PADDED_VOCAB_SIZE, GPTConfig

SCRIPT = "train_gpt2.py"
MODULE_NAME = "build_nanogpt_train_gpt2"
# Its training loop's settings (train_gpt2.py): configure_optimizers(weight_decay=0.1, learning_rate=6e-4),
# clip_grad_norm_(1.0), the vocab padded to 50,304, bf16 autocast.
WEIGHT_DECAY, LR, GRAD_CLIP, VOCAB_SIZE = 0.1, 6e-4, 1.0, PADDED_VOCAB_SIZE
SCHEDULE_NAMES = ("get_lr", "max_lr", "min_lr")  # its schedule; warmup_steps / max_steps are set per run

StepFn = Callable[[Tensor, Tensor], Tensor]


def peer_script(peer_dir: str | Path | None) -> Path | None:
    """The peer's train_gpt2.py, or None when no such file is there."""
    if peer_dir is None:
        return None
    path = Path(peer_dir) / SCRIPT
    return path if path.is_file() else None


def load_peer(script: Path) -> types.ModuleType:
    """A module holding only train_gpt2.py's classes (GPT, GPTConfig, ...) and the imports they need."""
    tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    local_modules = {p.stem for p in script.parent.glob("*.py")}

    def needed(name: str) -> bool:  # not its eval/data modules (hellaswag, fineweb), even where they were not copied
        top = name.split(".")[0]
        return top not in local_modules and importlib.util.find_spec(top) is not None

    def keep(node: ast.stmt) -> bool:
        if isinstance(node, ast.ClassDef):
            return True
        if isinstance(node, ast.FunctionDef):
            return node.name in SCHEDULE_NAMES
        if isinstance(node, ast.Assign):
            return all(isinstance(t, ast.Name) and t.id in SCHEDULE_NAMES for t in node.targets)
        if isinstance(node, ast.Import):
            return all(needed(alias.name) for alias in node.names)
        if isinstance(node, ast.ImportFrom):
            return node.level == 0 and needed(node.module or "")
        return False

    module = types.ModuleType(MODULE_NAME)
    module.__file__ = str(script)
    # configure_optimizers reads this global, which the (skipped) DDP set-up of the script defines.
    module.master_process = False
    sys.modules[MODULE_NAME] = module  # dataclasses resolves annotations through sys.modules
    code = compile(ast.Module(body=[n for n in tree.body if keep(n)], type_ignores=[]), str(script), "exec")
    exec(code, module.__dict__)
    return module


class PeerError(ValueError):
    """--peer-dir's train_gpt2.py is not the build-nanogpt script this module reads."""


def checked_peer(script: Path, schedule: bool = False) -> types.ModuleType:
    """load_peer's module, checked before any measuring: the names build_peer_step uses (and, with `schedule`, its lr
    schedule's), else PeerError naming the script. The ladder times the peer after its own rungs: a script found
    wrong only then ended the benchmark with a traceback, and the rungs' rows, measured by then, were lost."""
    try:
        module = load_peer(script)
    except Exception as err:  # its own code, run at its top level: any error at all
        raise PeerError(f"--peer-dir: {script} does not load ({type(err).__name__}: {err}); {_GIVE}") from None
    names = ["GPT", "GPTConfig", "GPT.configure_optimizers", *(SCHEDULE_NAMES if schedule else ())]
    missing = [name for name in names if _lookup(module, name) is None]
    if missing:
        raise PeerError(f"--peer-dir: {script} has no {', '.join(missing)}; {_GIVE}")
    return module


_GIVE = "give a checkout of karpathy/build-nanogpt, whose train_gpt2.py this benchmark reads"


def _lookup(module: types.ModuleType, dotted: str) -> object | None:
    found: object | None = module
    for part in dotted.split("."):
        found = getattr(found, part, None)
    return found


@contextmanager
def peer_matmul_precision() -> Iterator[None]:
    """The script's torch.set_float32_matmul_precision('high') (TF32 on CUDA, oneDNN's TF32 mode where a CPU has
    one), undone afterwards so our rows don't see it."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def build_peer_step(
    peer: types.ModuleType,
    config: GPTConfig,
    device: torch.device,
    compile_backend: str | None,
    autocast: bool = True,
    *,
    grad_accum: int = 1,
    schedule: tuple[int, int] | None = None,
) -> tuple[StepFn, nn.Module]:
    """One optimizer step of the peer's training loop (zero_grad, grad_accum bf16 autocast forward/backward passes
    of loss / grad_accum, clip 1.0, lr set per group, AdamW step) and its raw model. compile_backend None runs it
    eagerly; autocast False drops its bf16 autocast (plain fp32: not its recipe, a like-for-like check against
    ours). schedule (warmup_steps, max_steps) runs its get_lr(step) with its own max_lr / min_lr; None holds the lr
    at its peak (the ladder times steps, not schedules). The step takes grad_accum micro-batches stacked on dim 0."""
    peer_config = peer.GPTConfig(
        block_size=config.block_size,
        vocab_size=VOCAB_SIZE,
        n_layer=config.n_layer,
        n_head=config.n_head,
        n_embd=config.n_embd,
    )
    model = peer.GPT(peer_config).to(device)
    optimizer = model.configure_optimizers(weight_decay=WEIGHT_DECAY, learning_rate=LR, device_type=device.type)
    train_model = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    model.train()
    if schedule is not None:
        peer.warmup_steps, peer.max_steps = schedule
    taken = 0

    def step(x: Tensor, y: Tensor) -> Tensor:
        nonlocal taken
        optimizer.zero_grad()
        loss_sum = torch.zeros((), device=device)
        for xs, ys in zip(x.chunk(grad_accum), y.chunk(grad_accum), strict=True):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                _, loss = train_model(xs, ys)
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(train_model.parameters(), GRAD_CLIP)
        lr = LR if schedule is None else peer.get_lr(taken)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        taken += 1
        return loss_sum / grad_accum

    return step, model
