"""Activation checkpointing (GPT.activation_checkpointing): the same loss and gradients, less saved activation."""

from __future__ import annotations

import pytest
import torch

from modeling.config import GPTConfig
from modeling.gpt import GPT
from testkit import COMPILED_TINY, compiled_tiny_batch


def loss_and_grads(checkpointed: bool, compiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Compiled: AOTAutograd with inductor's decompositions and its min-cut partitioner, which decides what the
    backward recomputes, and eager kernels: inductor's graphs without its C++ builds (31 kernels, ~20 s of a cold
    cache), which are a CPU's and not the GPU's Triton ones, where checkpointing is used."""
    torch.manual_seed(0)
    model = GPT(COMPILED_TINY)
    model.activation_checkpointing = checkpointed
    forward = torch.compile(model, backend="aot_eager_decomp_partition") if compiled else model
    _, loss = forward(*compiled_tiny_batch())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradients_equal_the_plain_models(compiled):
    plain_loss, plain = loss_and_grads(checkpointed=False, compiled=compiled)
    loss, grads = loss_and_grads(checkpointed=True, compiled=compiled)
    assert torch.equal(loss, plain_loss)
    for name, grad in grads.items():  # recomputation replays the same fp32 arithmetic
        torch.testing.assert_close(grad, plain[name], rtol=1e-6, atol=1e-7, msg=name)


def saved_bytes(checkpointed: bool, n_layer: int) -> int:
    """Bytes autograd keeps for backward after the forward, weights left out (activation memory)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=128, block_size=128, vocab_size=50304))
    model.activation_checkpointing = checkpointed
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    x = torch.randint(0, 50257, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return sum(saved.values())


def test_checkpointing_keeps_only_each_blocks_input():
    """Per block (the difference between 8 and 4 blocks, so the embeddings and the loss cancel out): a plain block
    keeps 16 fp32 values per token and channel for backward, a checkpointed one its input (1)."""
    tokens_x_channels = 4 * 128 * 128
    plain = (saved_bytes(False, 8) - saved_bytes(False, 4)) / 4 / (4 * tokens_x_channels)
    checkpointed = (saved_bytes(True, 8) - saved_bytes(True, 4)) / 4 / (4 * tokens_x_channels)
    assert checkpointed == pytest.approx(1.0, abs=0.1), checkpointed
    assert plain > 10 * checkpointed, (plain, checkpointed)
