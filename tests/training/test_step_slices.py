"""training.step.Trainer after an out-of-memory retry (tests/e2e/test_oom.py makes a real one): each micro-batch
cut into row slices, weighted by their share of rows, makes the same update as the whole micro-batch, even slices
of unequal size. Gradient accumulation over grad_accum micro-batches is kept (accelerate counts micro-steps), and
the failed attempt's gradients are dropped."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator

from modeling.config import GPTConfig
from modeling.gpt import GPT
from training.step import Trainer


def gpt_trainer(pieces: int, grad_accum: int = 2) -> Trainer:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64))
    # SGD: Adam would blow up the rounding noise of gradients that are zero in exact arithmetic (the key bias's).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = grad_accum
    # Prepared, as training runs it: accelerate's optimizer wrapper clears gradients only at the accumulation's sync.
    model, optimizer = accelerator.prepare(model, optimizer)
    trainer = Trainer(
        accelerator, model, optimizer, grad_accum=grad_accum, grad_clip=1.0, tokens_per_step=24 * grad_accum
    )
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


def test_out_of_memory_mid_accumulation_drops_the_earlier_micro_batches_gradients(capsys):
    """Out of memory in micro-batch 1 of 3, after micro-batch 0's backward: the retry starts from no gradients, so its
    update is that of a run sliced from the start (micro-batch 0's gradients counted once, not twice)."""
    clean, retried = gpt_trainer(pieces=2, grad_accum=3), gpt_trainer(pieces=1, grad_accum=3)
    forwards = 0

    def allocate(module: torch.nn.Module, args: tuple) -> None:
        nonlocal forwards
        forwards += 1
        if forwards == 2:  # micro-batch 1's forward: a real allocation failure, larger than any address space
            torch.empty(2**62, dtype=torch.uint8)

    retried.model.register_forward_pre_hook(allocate)
    for trainer in (clean, retried):
        data = batches()
        trainer.losses = [trainer.train_step(data).loss.item() for _ in range(2)]
        trainer.settle()
    assert "step 1: out of memory at micro-batch 3; retrying at 2 × 6 accumulation" in capsys.readouterr().out
    assert retried.progress.step == clean.progress.step == 2
    assert retried.losses == clean.losses
    for (name, got), want in zip(retried.model.state_dict().items(), clean.model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
