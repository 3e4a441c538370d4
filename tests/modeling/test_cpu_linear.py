"""modeling.cpu_linear: fp32 linears through oneDNN on AVX-512 AMD CPUs, held to MKL's fp32 accuracy against fp64.

The route is forced on (ONEDNN_FP32) where a test needs it, so that it runs on every CPU: the op is oneDNN's on
any x86."""

import platform
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.loss_numerics import relative_errors
from modeling import cpu_linear
from modeling.cpu_linear import Linear


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "ONEDNN_FP32", True)


def output_and_grads(linear, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    out = linear(x)
    params = [p for p in (linear.weight, linear.bias) if p is not None]
    return [out.detach(), *torch.autograd.grad(out, (x, *params), grad)]


# (in, out): the weight's gradient takes either operand order by which is wider, as the body's four linears do
@pytest.mark.parametrize(("n_in", "n_out"), [(64, 192), (256, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_as_accurate_as_mkl_against_fp64(onednn, n_in: int, n_out: int, bias: bool, compiled: bool):
    """Output and the gradients of input, weight and bias, against fp64: fp32 accuracy, within 2x of torch's own
    fp32 linear (oneDNN sums in another order: 1.4-1.6x its error at the model's shapes, ~3e-7 relative)."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ours = Linear(n_in, n_out, bias=bias)
    x = torch.randn(4, 50, n_in, generator=g)
    grad = torch.randn(4, 50, n_out, generator=g)
    plain = nn.Linear(n_in, n_out, bias=bias)
    plain.load_state_dict(ours.state_dict())
    exact = nn.Linear(n_in, n_out, bias=bias, dtype=torch.float64)
    exact.load_state_dict(ours.state_dict())
    want = output_and_grads(exact, x.double(), grad.double())
    got = output_and_grads(torch.compile(ours, fullgraph=True) if compiled else ours, x, grad)
    assert all(t.dtype == torch.float32 for t in got)
    errors = relative_errors(got, want)
    plain_errors = relative_errors(output_and_grads(plain, x, grad), want)
    for name, e, p in zip(("out", "dx", "dw", "db"), errors, plain_errors):
        assert e <= 2 * p + 1e-7 and e < 1e-6, f"{name}: oneDNN {e:.3g}, torch's fp32 linear {p:.3g}"


def test_takes_fp32_on_the_cpu_outside_autocast_only(onednn):
    x = torch.randn(3, 4)
    assert cpu_linear.takes(x, x)
    assert not cpu_linear.takes(x, x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 launch: autocast's bf16 matmuls, oneDNN's already
        assert not cpu_linear.takes(x, x)


def test_bf16_autocast_is_torch_linear_bit_for_bit(onednn):
    """Under a bf16 launch the layer is F.linear under autocast, unchanged."""
    torch.manual_seed(0)
    ours = Linear(32, 48)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ours(x), F.linear(x, ours.weight, ours.bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_off_the_route_it_is_torch_linear_bit_for_bit(monkeypatch):
    monkeypatch.setattr(cpu_linear, "ONEDNN_FP32", False)
    torch.manual_seed(0)
    ours = Linear(32, 48)
    x = torch.randn(5, 32)
    assert torch.equal(ours(x), F.linear(x, ours.weight, ours.bias))


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file(), reason="x86 Linux")
def test_the_route_is_taken_on_amd_cpus_with_avx512_only(monkeypatch):
    """On an AVX2-only Zen 3 oneDNN's fp32 kernels are the slower ones (BENCHMARKS.md): the route needs AVX-512 as
    ATen sees it (ATEN_CPU_CAPABILITY caps it), and an AMD CPU (Intel CPUs keep MKL)."""
    amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not cpu_linear._onednn_beats_mkl()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cpu_linear._onednn_beats_mkl() == amd


def test_inference_is_torch_linear_bit_for_bit(onednn):
    """Under no_grad (evals, generation, validation) the layer computes what F.linear does with its weights, as the
    evals do on a bare model's head: the same scores through a wrapper or without one."""
    torch.manual_seed(0)
    ours = Linear(32, 48)
    x = torch.randn(5, 7, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), F.linear(x, ours.weight, ours.bias))
