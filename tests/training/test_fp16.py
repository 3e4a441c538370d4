"""The fp16 path of 1xgpu_fp16.yaml (fp16 autocast + accelerate's GradScaler), run on the CPU: accelerate applies
fp16 only on accelerators, so these tests drive torch's own autocast and GradScaler, as accelerate does on a GPU, or
hand accelerate a CPU GradScaler before prepare() to run training.step's Trainer as on a GPU."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from modeling.config import GPTConfig
from modeling.gpt import GPT
from training.optim import build_optimizer
from training.step import Batches, Trainer, TrainingAborted

SHAPE = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=50304)
TINY = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64)  # for the Trainer's step logic


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


def fp16_trainer(init_scale: float, backoff_factor: float = 0.5, max_bad_steps: int = 1) -> Trainer:
    """The Trainer as train_accel.py builds it under 1xgpu_fp16.yaml: the prepared GPT in fp16 autocast, fused AdamW
    behind accelerate's optimizer wrapper, which steps through the GradScaler."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, backoff_factor=backoff_factor)
    accelerator.native_amp = True  # what accelerate sets with its scaler on a GPU: prepare() then autocasts forward
    model = GPT(TINY)
    optimizer = build_optimizer(model.optimizer_groups(0.1), lr=3e-3, betas=(0.9, 0.95), device_type="cpu")
    model, optimizer = accelerator.prepare(model, optimizer)
    return Trainer(
        accelerator, model, optimizer, grad_clip=1.0, tokens_per_step=2 * TINY.block_size, max_bad_steps=max_bad_steps
    )


def one_batch() -> Batches:
    x = torch.randint(0, TINY.vocab_size, (2, TINY.block_size), generator=torch.Generator().manual_seed(1))
    while True:
        yield x, torch.roll(x, -1, dims=1)


def test_trainer_lets_the_scaler_skip_an_overflowing_step_and_trains_on_at_the_lowered_scale(
    fresh_accelerate_state, capsys
):
    """Scaled gradients that overflow fp16 (a real overflow: scale 2**60) leave every weight alone; the scaler's
    update() lowers the scale (in one step to 1 here), so the next step trains as a run started at that scale would.
    The overflow is the scaler's calibration: no bad step (two in a row would stop this run), no step counted."""
    trainer = fp16_trainer(init_scale=2.0**60, backoff_factor=2.0**-60, max_bad_steps=2)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    data = one_batch()
    trainer.train_step(data)
    assert not trainer.settle()
    assert trainer.accelerator.scaler.get_scale() == 1.0
    assert (trainer.progress.step, trainer.bad_steps) == (0, 0)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    trainer.train_step(data)  # "unscale_() has already been called" when the skipped step bypassed the scaler
    assert trainer.settle()
    assert trainer.progress.step == 1
    assert "step 1: fp16 gradients overflowed, update skipped; loss scale lowered to 1" in capsys.readouterr().out

    clean = fp16_trainer(init_scale=1.0)
    clean.train_step(one_batch())
    assert clean.settle()
    for name, want in clean.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], want), name


@pytest.mark.parametrize("cause", ["non-finite loss", "overflow at scale 1"])
def test_fp16_steps_a_lower_scale_cannot_mend_count_as_bad_steps(cause, fresh_accelerate_state):
    """As under bf16 and fp32: a non-finite loss (the scale acts on the backward only), or gradients that overflow
    unscaled, count toward max_bad_steps (here 1: the run stops)."""
    trainer = fp16_trainer(init_scale=2.0**16 if cause == "non-finite loss" else 1.0)
    head = trainer.model.lm_head.weight
    if cause == "non-finite loss":
        with torch.no_grad():
            head[0, 0] = float("nan")
    else:
        head.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(TrainingAborted, match="in 1 consecutive steps after step 0"):
        trainer.train_step(one_batch())
