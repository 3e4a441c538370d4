"""The fp16 path of 1xgpu_fp16.yaml (fp16 autocast + accelerate's GradScaler), run on the CPU: accelerate applies
fp16 only on accelerators, so these tests drive torch's own autocast and GradScaler, as accelerate does on a GPU."""

from __future__ import annotations

import pytest
import torch

from modeling.config import GPTConfig
from modeling.gpt import GPT
from training.optim import build_optimizer

SHAPE = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=50304)


def train(precision: str, steps: int = 6) -> tuple[list[float], GPT]:
    torch.manual_seed(0)
    model = GPT(SHAPE)
    optimizer = build_optimizer(model.optimizer_groups(0.1), lr=3e-3, betas=(0.9, 0.95), device_type="cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    x = torch.randint(0, 50257, (4, SHAPE.block_size), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):  # one batch, memorized: the loss falls fast, as in the steep early part of training
        with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "fp16"):
            _, loss = model(x, torch.roll(x, -1, dims=1))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, model


def test_fp16_autocast_with_loss_scaling_follows_the_fp32_run():
    fp32, _ = train("no")
    fp16, _ = train("fp16")
    assert fp16 == pytest.approx(fp32, abs=2e-2), (fp16, fp32)  # fp16's 10-bit mantissa; the loss itself is fp32
    assert fp32[-1] < fp32[0] - 0.5  # it trained


def test_fp16_overflow_skips_the_update_and_lowers_the_scale():
    """A step whose scaled gradients overflow fp16 changes no weight; the scaler halves its scale."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    optimizer = build_optimizer(model.optimizer_groups(0.1), lr=3e-3, betas=(0.9, 0.95), device_type="cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)  # scaled gradients overflow
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 50257, (2, SHAPE.block_size))
    with torch.autocast("cpu", dtype=torch.float16):
        _, loss = model(x, x)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**59
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
