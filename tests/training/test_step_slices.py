"""training.step.Trainer after an out-of-memory retry (tests/e2e/test_oom.py makes a real one): each micro-batch
cut into row slices, weighted by their share of rows, makes the same update as the whole micro-batch, even slices
of unequal size. Gradient accumulation over grad_accum micro-batches is kept (accelerate counts micro-steps)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from modeling.config import GPTConfig
from modeling.gpt import GPT
from training.step import Trainer


def gpt_trainer(pieces: int) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64))
    # SGD: Adam would blow up the rounding noise of gradients that are zero in exact arithmetic (the key bias's).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = Trainer(Accelerator(cpu=True), model, optimizer, grad_accum=2, grad_clip=1.0, tokens_per_step=48)
    trainer.accelerator.gradient_accumulation_steps = 2
    trainer.pieces = pieces  # as a retry leaves it
    return trainer


def batches():
    g = torch.Generator().manual_seed(1)
    while True:
        tokens = torch.randint(0, 64, (3, 9), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("pieces", [2, 3])
def test_sliced_micro_batches_make_the_same_steps(pieces):
    whole, sliced = gpt_trainer(1), gpt_trainer(pieces)
    for trainer in (whole, sliced):
        data = batches()
        trainer.losses = [trainer.train_step(data).loss.item() for _ in range(3)]
        trainer.settle()
    assert sliced.progress.step == whole.progress.step == 3
    assert sliced.losses == pytest.approx(whole.losses, rel=1e-6)
    for (name, got), want in zip(sliced.model.state_dict().items(), whole.model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
