"""modeling.cpu_attention: causal attention as whole matmuls on a CPU, held to flash's accuracy against fp64."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench.loss_numerics import relative_errors
from modeling import cpu_attention
from modeling.cpu_attention import MAX_T, bf16_products, causal_attention
from testkit import REPO


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_inputs(sharpness: float, dtype: torch.dtype, T: int = 200) -> list[torch.Tensor]:
    """q, k, v laid out as the model makes them (heads split from one (B, T, 3C) projection) and rounded to dtype.
    sharpness scales q and k: 1 gives scores of ~N(0, 1), 6 scores up to ~+-30, where one key takes nearly all the
    weight, as trained heads do."""
    B, H, d = 2, 2, 64
    qkv = torch.randn(B, T, 3 * H * d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    qkv[..., : 2 * H * d] *= sharpness
    q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in qkv.to(dtype).split(H * d, dim=2))
    return [t.detach().requires_grad_() for t in (q, k, v)]


def output_and_grads(attention, q, k, v, grad: torch.Tensor) -> list[torch.Tensor]:
    out = attention(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]


@contextlib.contextmanager
def onednn_rounding_as_on_amx():
    """bookgpt::bf16_products as oneDNN's bf16 math mode runs it where it has bf16 kernels (AMX): both inputs rounded
    to bf16, products summed in fp32. Most CPUs keep fp32 inputs (AVX-512 bf16 alone, AVX2): this makes any CPU test
    what an AMX Xeon computes. The kernel is registered for the block only."""

    def rounded_inputs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return a.bfloat16().float() @ b.bfloat16().float()

    with torch.library._scoped_library("bookgpt", "IMPL") as lib:
        lib.impl("bf16_products", rounded_inputs, "CPU")
        yield


@pytest.mark.parametrize("sharpness", [1.0, 3.0, 6.0])
@pytest.mark.parametrize(
    "dtype, onednn",
    [(torch.bfloat16, "this-cpu"), (torch.bfloat16, "amx-rounding"), (torch.float32, "this-cpu")],
    ids=["bf16", "bf16-amx-rounding", "fp32"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("T", [200, MAX_T], ids=["T200", "max_T"])
def test_as_accurate_as_flash_against_fp64(sharpness: float, dtype: torch.dtype, onednn: str, compiled: bool, T: int):
    """Output and the three gradients, on the same rounded inputs, against fp64 attention: no worse than torch's CPU
    flash kernel in the dtype (cpu_bf16.yaml's bf16 and cpu.yaml's fp32), from diffuse to near one-hot heads, with
    this CPU's oneDNN and with an AMX CPU's rounding (normalized probabilities rounded to bf16 gave 1.17-1.25x
    flash's output error there), at a short context and at the longest this path takes (MAX_T: 512, 256 on AMX)."""
    with onednn_rounding_as_on_amx() if onednn == "amx-rounding" else contextlib.nullcontext():
        check_against_flash(sharpness, dtype, compiled, T)


def check_against_flash(sharpness: float, dtype: torch.dtype, compiled: bool, T: int) -> None:
    q, k, v = attention_inputs(sharpness, dtype, T)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    want = output_and_grads(flash, *(t.detach().double().requires_grad_() for t in (q, k, v)), grad.double())
    ours = torch.compile(causal_attention, dynamic=False) if compiled else causal_attention
    got = output_and_grads(ours, q, k, v, grad)
    assert all(t.dtype == dtype for t in got)
    errors = relative_errors(got, want)
    flash_errors = relative_errors(output_and_grads(flash, q, k, v, grad), want)
    for name, e, f in zip(("out", "dq", "dk", "dv"), errors, flash_errors, strict=True):
        assert e <= 1.1 * f + 1e-7, f"{dtype} sharpness {sharpness} {name}: ours {e:.3g}, flash {f:.3g}"


def test_bf16_products_sum_in_fp32_and_round_no_more_than_to_bf16():
    """The op's contract, against fp64: fp32 sums of products of inputs rounded at most to bf16 (oneDNN rounds them
    where it has bf16 kernels for its math mode, e.g. AMX; with AVX-512 bf16 alone it keeps fp32). Inputs that are
    bf16 values (q, k, v and dO in a bf16 run) give exact products either way."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 40, 300, generator=g), torch.randn(3, 300, 50, generator=g)
    exact = a.double() @ b.double()
    rounded = a.bfloat16().double() @ b.bfloat16().double()
    got = bf16_products(a, b)
    assert got.dtype == torch.float32
    assert (got - exact).abs().max() <= 1.1 * (rounded - exact).abs().max()
    got = bf16_products(a.bfloat16().float(), b.bfloat16().float())
    assert (got - rounded).abs().max() < 1e-4  # values ~20: a bf16 result would be ~0.06 off


def test_bf16_autocast_changes_nothing():
    """Under a bf16 launch YAML without compile (cpu_eager.yaml --mixed_precision bf16) autocast is on around the op:
    its matmuls must stay fp32 sums, as without autocast."""
    q, k, v = attention_inputs(3.0, torch.bfloat16, T=32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = output_and_grads(causal_attention, q, k, v, grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = output_and_grads(causal_attention, q, k, v, grad)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_leaves_the_global_matmul_precision_as_it_found_it():
    before = torch.backends.mkldnn.matmul.fp32_precision
    q, k, v = attention_inputs(1.0, torch.bfloat16, T=16)
    out = causal_attention(q, k, v)
    out.sum().backward()
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_max_t_is_shorter_where_flash_runs_on_amx():
    """An AMX CPU's flash kernel is fast: the whole matmuls stop at T 256 there (the step at 512 was 1.04-1.07x
    flash's on an AMX Xeon), at 512 elsewhere, including an AMX CPU whose ATen kernels are held to AVX2, where flash's
    bf16 backward is emulated."""

    def max_t(**env: str) -> int:
        code = "from modeling import cpu_attention; print(cpu_attention.MAX_T)"
        run = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=REPO, capture_output=True,
                             text=True, check=True)  # fmt: skip
        return int(run.stdout)

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # the OS's word on AMX, not torch's private check that MAX_T reads
        amx = any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo.read_text().splitlines())
        avx512_aten = os.environ.get("ATEN_CPU_CAPABILITY", "avx512").lower().startswith("avx512")
        assert MAX_T in (256, 512) and (MAX_T == 256) == (amx and avx512_aten)
    assert max_t(ATEN_CPU_CAPABILITY="avx2") == 512


def test_takes_cpu_training_in_bf16_and_fp32_up_to_max_t_without_dropout():
    def q(T: int = MAX_T, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(1, 1, T, 8, dtype=dtype, requires_grad=True)

    assert cpu_attention.takes(q(), 0.0) and cpu_attention.takes(q(dtype=torch.float32), 0.0)
    assert not cpu_attention.takes(q(MAX_T + 1), 0.0)  # flash is faster at long context (and keeps no T x T)
    assert not cpu_attention.takes(q(), 0.1)  # attention dropout: SDPA's
    assert not cpu_attention.takes(q(dtype=torch.float16), 0.0)
    assert not cpu_attention.takes(q().detach(), 0.0)  # inference: flash
    with torch.no_grad():
        assert not cpu_attention.takes(q(), 0.0)
