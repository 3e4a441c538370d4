"""Run eval tasks on a model: the hook the training loop calls, and what the CLI uses."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import tiktoken
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import Tensor

from evals import EvalError, hellaswag, lambada
from evals.data import load_examples
from evals.scoring import Request, Scores, score_requests

# Each task module has requests(examples, encoding), predictions(scores) and metrics(examples, scores).
TASKS: dict[str, ModuleType] = {"hellaswag": hellaswag, "lambada": lambada}
DEFAULT_BATCH_SIZE = 32  # sequences per forward; a HellaSwag example is 4 of them


@dataclass
class TaskRun:
    examples: list[dict]
    scores: Scores  # one per request
    predictions: dict[str, Tensor]  # one per example
    metrics: dict[str, float]


def parse_tasks(tasks: str | Iterable[str]) -> list[str]:
    """'hellaswag,lambada' or a list of names -> validated names, in order, without duplicates."""
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [t.strip() for t in tasks]
    names = [n for n in dict.fromkeys(names) if n]
    if not names:
        raise EvalError(f"no eval task given; choose from {', '.join(TASKS)}")
    for name in names:
        if name not in TASKS:
            close = difflib.get_close_matches(name.lower(), TASKS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise EvalError(f"unknown eval task '{name}': {hint}valid tasks: {', '.join(TASKS)}")
    return names


def run_task(
    model: torch.nn.Module,
    task: str,
    encoding: tiktoken.Encoding,
    limit: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    accelerator: Accelerator | None = None,
) -> TaskRun:
    """Score the first `limit` examples of `task` (all if None); results are the same on every rank.

    `model` is our GPT (or its accelerate-prepared wrapper); eval mode is set for the run and restored after.
    """
    (task,) = parse_tasks([task])
    if limit is not None and limit <= 0:
        raise EvalError(f"eval limit must be a positive number of examples (or None for all), got {limit}")
    if batch_size <= 0:
        raise EvalError(f"eval batch size must be positive, got {batch_size}")
    module = TASKS[task]
    if accelerator is None:
        examples, requests = _task_inputs(task, limit, encoding)
    else:
        # One process per machine provisions the data on first use while the others wait.
        with accelerator.local_main_process_first():
            examples, requests = _task_inputs(task, limit, encoding)
    raw = accelerator.unwrap_model(model, keep_torch_compile=False) if accelerator else model
    forward = _forward_module(model, raw, accelerator)
    was_training = raw.training
    raw.eval()
    try:
        scores = score_requests(forward, requests, raw.config.block_size, batch_size, accelerator)
    finally:
        raw.train(was_training)
    return TaskRun(examples, scores, module.predictions(scores), module.metrics(examples, scores))


def evaluate_tasks(
    model: torch.nn.Module,
    accelerator: Accelerator | None,
    tasks: str | Iterable[str],
    limit: int | None,
    encoding: tiktoken.Encoding,
) -> dict[str, float]:
    """The training hook: {"hellaswag_acc_norm", "hellaswag_acc", "lambada_acc", "lambada_ppl"} for the tasks
    asked, the same numbers on every rank. Every rank must call it (the ranks share the work)."""
    out: dict[str, float] = {}
    for task in parse_tasks(tasks):
        out.update(run_task(model, task, encoding, limit, DEFAULT_BATCH_SIZE, accelerator).metrics)
    return out


@functools.lru_cache(maxsize=4)
def _task_inputs(task: str, limit: int | None, encoding: tiktoken.Encoding) -> tuple[list[dict], list[Request]]:
    # Kept for the periodic evals of a training run: tokenizing all of HellaSwag takes seconds.
    examples = load_examples(task, limit)
    return examples, TASKS[task].requests(examples, encoding)


def _forward_module(model: torch.nn.Module, raw: torch.nn.Module, accelerator: Accelerator | None) -> torch.nn.Module:
    # Sharded engines gather their weights inside the wrapper's forward, so they must be called through it.
    # Elsewhere the bare module is better: a compiled one would recompile for every new eval shape.
    if accelerator and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return model
    return raw
