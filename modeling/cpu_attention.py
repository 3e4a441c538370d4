"""Causal attention on a CPU at short context: whole batched matmuls around a softmax that inductor fuses.

torch's CPU flash-attention kernel runs B x H x T x T attention as many small blocks; with bf16 inputs its backward
reaches ~160 GFLOP/s on a Zen 5 whose bf16 matmuls do ~900. Here each product (two forward, four backward) is one
batched matmul. In bf16 runs oneDNN takes them in its bf16 math mode on fp32 tensors: inputs rounded at most to bf16
(q, k, v and dO already are bf16 values: exact), products summed in fp32, results fp32, as inside flash's blocks.
The scores, the softmax and its gradient stay fp32 in between, so nothing is rounded that flash keeps. Where oneDNN
does round (AMX), it rounds what flash rounds: the forward multiplies v by exp(s - max), whose largest entry is 1
exactly, and divides by the row's sum after, as flash does (normalized probabilities rounded to bf16 gave 1.2x flash's
output error on an AMX Xeon). The price is
the (B, H, T, T) fp32 probabilities kept for backward (flash recomputes them) and the masked half of the scores
computed anyway, hence the cap on T (BENCHMARKS.md, "Attention as whole matmuls, and GELU through its sigmoid").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _flash_on_amx() -> bool:
    """Whether torch's CPU flash kernel runs its bf16 blocks on AMX tiles here: an AMX CPU whose ATen kernels are
    AVX-512's (under ATEN_CPU_CAPABILITY=avx2, an AVX2-only CPU emulated, flash's bf16 backward is emulated: 10x)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and torch.cpu._is_amx_tile_supported()


# The longest sequence this path takes (read once: torch.compile guards on it as a constant). One layer's fwd + bwd
# against flash on a Zen 5, bf16: 0.50-0.58x the time at T 256, 0.60x at 512, 1.0-1.06x at 1,024; the saved
# probabilities cost B x H x T^2 x 4 bytes a layer. On an AMX Xeon, whose flash is fast, the whole step is within 2%
# either way at T 256 and 1.04-1.07x flash's at 512 (`python -m bench.attention_speed`; BENCHMARKS.md, "CPU
# attention: flash against whole matmuls").
MAX_T = 256 if _flash_on_amx() else 512


def _dense(t: Tensor) -> Tensor:
    """t with its last two dims dense in row or column order over collapsible batch dims: oneDNN reads either without
    a copy, where torch.matmul would copy any other layout itself."""
    return t if t.is_contiguous() or t.transpose(-1, -2).is_contiguous() else t.contiguous()


@torch.library.custom_op("bookgpt::bf16_products", mutates_args=())
def bf16_products(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for fp32 a and b in oneDNN's bf16 math mode: fp32 sums of products of the inputs rounded at most to bf16
    (oneDNN rounds them where it has bf16 kernels for the mode, e.g. AMX; on AVX-512 bf16 alone, as on a Zen 5, it
    keeps fp32 and still runs 2.4x faster than torch's default fp32 batched matmul through MKL)."""
    before = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        with torch.autocast("cpu", enabled=False):  # eager bf16 autocast would make it a bf16 matmul, bf16 result
            return _dense(a) @ _dense(b)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before


@bf16_products.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty((*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1]),
                       dtype=torch.float32)  # fmt: skip


def _setup_context(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
    a, b = ctx.saved_tensors
    grad_a = bf16_products(grad, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
    grad_b = bf16_products(a.transpose(-1, -2), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


bf16_products.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("bookgpt::bf16_scaled_products", mutates_args=())
def bf16_scaled_products(a: Tensor, b: Tensor, scale: Tensor) -> Tensor:
    """(a @ b) * scale: bf16_products with each row of the result scaled by scale (..., M, 1), fp32. Its backward keeps
    the scale out of the products' inputs, (grad @ bᵀ) * scale rather than (grad * scale) @ bᵀ: grad (dO) holds bf16
    values, exact under oneDNN's rounding, where grad * scale would be rounded."""
    return bf16_products(a, b) * scale


@bf16_scaled_products.register_fake
def _(a: Tensor, b: Tensor, scale: Tensor) -> Tensor:
    return bf16_products(a, b)


def _scaled_setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(*inputs, output)


def _scaled_backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    a, b, scale, out = ctx.saved_tensors
    grad_a = bf16_products(grad, b.transpose(-1, -2)) * scale if ctx.needs_input_grad[0] else None
    grad_b = bf16_products((a * scale).transpose(-1, -2), grad) if ctx.needs_input_grad[1] else None
    grad_scale = (grad * out).sum(-1, keepdim=True) / scale if ctx.needs_input_grad[2] else None
    return grad_a, grad_b, grad_scale


bf16_scaled_products.register_autograd(_scaled_backward, setup_context=_scaled_setup_context)


def takes(q: Tensor, dropout_p: float) -> bool:
    """Whether this path runs: training (autograd records q) in bf16 or fp32 on a CPU, without attention dropout, up
    to MAX_T. Inference keeps flash: the gain is in backward, and an eager fp32 forward alone is slower here."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float32)
        and q.requires_grad
        and torch.is_grad_enabled()
        and dropout_p == 0.0
        and q.shape[-2] <= MAX_T
    )


def causal_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q kᵀ / sqrt(d), causal) v for (B, H, T, d) tensors: the function of
    F.scaled_dot_product_attention(q, k, v, is_causal=True). bf16 inputs take bf16 products summed in fp32, fp32
    inputs fp32 matmuls; the softmax is fp32 in both."""
    dtype, T = q.dtype, q.shape[-2]
    # exact; cast once and laid out (B, H, T, d) in the graph (fused with the cast), saved for backward as they are
    q, k, v = (t.float().contiguous() for t in (q, k, v))
    products = bf16_products if dtype == torch.bfloat16 else torch.matmul
    scores = products(q, k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    # the mask from an index compare, not a stored (T, T) tensor: inductor then fuses mask, max, exp and sum per row;
    # int32 indices, half the vector work of int64's compare (its forward 8-14% faster, BENCHMARKS.md)
    i = torch.arange(T, device=q.device, dtype=torch.int32)
    scores = torch.where(i[None, :] > i[:, None], float("-inf"), scores)
    if dtype != torch.bfloat16:
        return torch.matmul(F.softmax(scores, dim=-1), v)
    # softmax's shift cancels in its gradient: the max is a constant to autograd
    weights = torch.exp(scores - scores.amax(-1, keepdim=True).detach())
    return bf16_scaled_products(weights, v, 1 / weights.sum(-1, keepdim=True)).to(dtype)
