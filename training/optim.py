"""Optimizer and learning-rate schedule: AdamW with decay/no-decay groups, cosine decay after linear warmup."""

from __future__ import annotations

import math
from functools import partial

import torch


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Fraction of the peak lr at optimizer step ``step`` (0-based): linear warmup, then cosine to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + 0.5 * (1.0 - min_lr_ratio) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    param_groups: list[dict], *, lr: float, betas: tuple[float, float], device_type: str
) -> torch.optim.AdamW:
    """AdamW, fused where torch has a fused kernel for the device (CUDA, and CPU since torch 2.4), else foreach."""
    fused = device_type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=1e-8, fused=fused, foreach=None if fused else True)


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = partial(lr_multiplier, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
