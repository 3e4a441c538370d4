"""fp32 linears on AMD CPUs with AVX-512 through oneDNN's fp32 kernels instead of MKL's.

On x86 torch hands fp32 matmuls to MKL, which on AMD CPUs runs its AVX2 kernels: ~200 GFLOP/s on 2 Zen 5 cores whose
AVX-512 oneDNN kernels do ~450. torch.ops.mkldnn._linear_pointwise (the op inductor's CPU fusions call) runs oneDNN
on plain dense fp32 tensors, fp32 products summed in fp32 like MKL's: at the small models' shapes it takes 0.4-0.6x
MKL's time on a Zen 5 (BENCHMARKS.md, "fp32 matmuls through oneDNN on AMD"). On an AVX2-only Zen 3 oneDNN's AVX2
kernels are the slower ones (a step 1.18-1.24x MKL's time), so AMD CPUs without AVX-512 keep MKL, and so do Intel
CPUs, which MKL is tuned for. bf16 matmuls already go to oneDNN on every CPU.

Training only: inference keeps torch's kernels, as code outside the model computes with the same weights (the evals
score a bare GPT's head with F.linear and a wrapped one through lm_head, and must agree to the bit on 1 or 2
processes: tests/e2e/test_evals_cli.py). The two kernels' sums differ in the last bits (~3e-7 relative).

cpu_matmul_speeds times fp32 against bf16 matmuls here: the probe behind training's precision hints and the evals'
warning where bf16 is not native.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from modeling.device import X86, amd_cpu


def _onednn_beats_mkl() -> bool:
    """Whether this is an x86 AMD CPU with AVX-512 (Zen 4 and later) and torch's oneDNN: the CPUs where oneDNN's fp32
    kernels beat MKL's. ATen's CPU capability stands for the ISA, so ATEN_CPU_CAPABILITY=avx2 takes MKL, as a Zen 3."""
    if not X86 or not torch.backends.mkldnn.is_available():
        return False
    # not Linux (no /proc/cpuinfo to name the vendor): keep torch's choice
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512") and amd_cpu()


ONEDNN_FP32 = _onednn_beats_mkl()  # read once: torch.compile guards on it as a constant


def takes(*tensors: Tensor) -> bool:
    """Whether fp32 products of these tensors go through oneDNN: fp32 CPU tensors, outside autocast, where
    ONEDNN_FP32."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
        and not torch.is_autocast_enabled("cpu")
        and ONEDNN_FP32
    )


@torch.library.custom_op("bookgpt::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T + bias for fp32 x (..., in), weight (out, in) and bias (out,) or None, by oneDNN's fp32 kernels.
    Any of them may be a transposed view: oneDNN reads either order of a 2-D operand without a copy."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    """grad.T @ x for grad (N, out) and x (N, in), the (out, in) gradient of a linear's weight. oneDNN is fastest with
    the wider of out and in as its output's rows' length (a Zen 5: 0.4-0.7x the time of the other order)."""
    if grad.shape[1] >= x.shape[1]:
        return onednn_linear(x.t(), grad.t(), None).t()
    return onednn_linear(grad.t(), x.t(), None)


def _setup_context(ctx, inputs: tuple[Tensor, Tensor, Tensor | None], output: Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    x, weight = ctx.saved_tensors
    grad2 = grad.reshape(-1, grad.shape[-1])  # (N, out)
    grad_x = onednn_linear(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
    grad_w = weight_grad(grad2, x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_b = grad2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


onednn_linear.register_autograd(_backward, setup_context=_setup_context)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for 2-D tensors by the kernels the model's linears use: oneDNN's where takes(a, b), else torch's. The
    matmul speed probes (MFU's peak, the CPU precision choice) time this, so they measure what a step runs."""
    return onednn_linear(a, b.t(), None) if takes(a, b) else a @ b


class Linear(nn.Linear):
    """nn.Linear (same parameters, init and state dict) whose fp32 CPU products take oneDNN in training where
    ONEDNN_FP32."""

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad and takes(x, self.weight):
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# bf16 this many times slower than fp32 is emulated, not native (>= ~0.5x fp32 without AMX): AVX2-only cores run it
# 30-300x slower, AVX-512 cores without its bf16 instructions (Intel Cascade Lake) 4.5-7x (BENCHMARKS.md)
NO_NATIVE_BF16 = 3.0


def cpu_matmul_speeds(seconds: float = 1.0, n: int = 512) -> dict[str, float]:
    """TFLOP/s of an n x n CPU matmul by mixed_precision value ('no': fp32, 'bf16'), to compare the two: one
    thread's best single matmul times the threads torch uses (as measure_matmul_tflops), the dtypes taking turns
    for about `seconds`. On a busy machine some short matmuls still run undisturbed and both dtypes meet the same
    load, so the ratio holds where peak_tflops of each dtype in turn swings with the load each one met
    (BENCHMARKS.md, "`make train`'s precision"). n = 512: a small model's matmul, done between preemptions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mats = {mp: torch.randn(n, n, dtype=torch.bfloat16 if mp == "bf16" else torch.float32) for mp in ("no", "bf16")}
        for a in mats.values():
            matmul(a, a)  # warm-up: oneDNN builds its kernel on the first call
        best: dict[str, float] = {}
        deadline = time.perf_counter() + seconds
        while not best or time.perf_counter() < deadline:
            for mp, a in mats.items():
                start = time.perf_counter()
                matmul(a, a)
                best[mp] = min(best.get(mp, math.inf), time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return {mp: threads * 2 * n**3 / t / 1e12 for mp, t in best.items()}


def emulated_bf16(tflops: dict[str, float]) -> str | None:
    """What a warning says where bf16 matmuls are emulated here, from cpu_matmul_speeds' TFLOP/s; None where they are
    native (faster than NO_NATIVE_BF16 times slower than fp32)."""
    ratio = tflops["no"] / tflops["bf16"]
    if ratio < NO_NATIVE_BF16:
        return None
    return (
        f"this CPU has no native bf16 matmuls: bf16 runs {ratio:.0f}x slower than fp32 here (fp32 "
        f"{tflops['no'] * 1e3:.3g} GFLOP/s, bf16 {tflops['bf16'] * 1e3:.3g} GFLOP/s)"
    )
