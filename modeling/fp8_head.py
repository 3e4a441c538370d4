"""The tied head's logits matmul in FP8 (torch._scaled_mm), for Hopper and Ada GPUs (compute capability 8.9+).

After modded-nanogpt's FP8 head (its record 19 took 8% off the step at GPT-2 124M on an H100), in our own form:
forward, the hidden states and the head each cast to e4m3 with one scale per tensor (its absolute max onto e4m3's
448), the logits in bf16; backward, the logits' gradient in e5m2 (the wider range a gradient needs) against the
e4m3 copies saved from forward: grad_h in bf16, grad_w in fp32. The tied weight itself stays as it is (fp32 master
weights): only the matmul's operands are FP8 copies. torch._scaled_mm also runs on CPUs (torch 2.13), where its
accuracy is tested against the bf16 head and fp64; training takes it only on CUDA 8.9+ (TrainConfig.fp8_head).
"""

from __future__ import annotations

import torch
from torch import Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first with FP8 tensor cores
DIM_MULTIPLE = 16  # torch._scaled_mm takes matrices whose dimensions are multiples of this


def supported(device: torch.device) -> bool:
    """Whether FP8 matmuls run on tensor cores here: a CUDA device of compute capability 8.9 or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def to_fp8(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x as dtype scaled so that its absolute max lands on dtype's largest value, and the scale back (fp32 scalar):
    x ~ x8 * scale."""
    scale = x.detach().abs().amax().float().clamp(min=1e-30) / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype), scale


def _column_major(x: Tensor) -> Tensor:
    """The same matrix laid out column by column, as _scaled_mm wants its second operand."""
    return x.t().contiguous().t()


class _FP8Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor) -> Tensor:
        h8, h_scale = to_fp8(h, E4M3)
        w8, w_scale = to_fp8(weight, E4M3)
        ctx.save_for_backward(h8, h_scale, w8, w_scale)
        ctx.dtypes = h.dtype, weight.dtype
        return torch._scaled_mm(h8, w8.t(), scale_a=h_scale, scale_b=w_scale, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad_logits: Tensor) -> tuple[Tensor, Tensor]:
        h8, h_scale, w8, w_scale = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        g8, g_scale = to_fp8(grad_logits, E5M2)
        grad_h = torch._scaled_mm(g8, _column_major(w8), scale_a=g_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
        grad_w = torch._scaled_mm(
            g8.t().contiguous(), _column_major(h8), scale_a=g_scale, scale_b=h_scale, out_dtype=torch.float32
        )
        return grad_h.to(h_dtype), grad_w.to(w_dtype)


def fp8_logits(h: Tensor, weight: Tensor) -> Tensor:
    """h @ weight.T in FP8 with bf16 logits; h (N, E), weight (V, E), both of any float dtype."""
    return _FP8Head.apply(h, weight)
