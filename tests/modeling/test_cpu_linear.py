"""modeling.cpu_linear: fp32 linears through oneDNN on AMD CPUs, held to MKL's fp32 accuracy against fp64.

The route is forced on (ON_AMD) where a test needs it, so that it runs on every CPU: the op is oneDNN's on any x86."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.loss_numerics import relative_errors
from modeling import cpu_linear
from modeling.cpu_linear import Linear


@pytest.fixture
def on_amd(monkeypatch):
    monkeypatch.setattr(cpu_linear, "ON_AMD", True)


def output_and_grads(linear, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    out = linear(x)
    params = [p for p in (linear.weight, linear.bias) if p is not None]
    return [out.detach(), *torch.autograd.grad(out, (x, *params), grad)]


# (in, out): the weight's gradient takes either operand order by which is wider, as the body's four linears do
@pytest.mark.parametrize(("n_in", "n_out"), [(64, 192), (256, 64)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_as_accurate_as_mkl_against_fp64(on_amd, n_in: int, n_out: int, bias: bool, compiled: bool):
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


def test_takes_fp32_on_the_cpu_outside_autocast_only(on_amd):
    x = torch.randn(3, 4)
    assert cpu_linear.takes(x, x)
    assert not cpu_linear.takes(x, x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a bf16 launch: autocast's bf16 matmuls, oneDNN's already
        assert not cpu_linear.takes(x, x)


def test_bf16_autocast_is_torch_linear_bit_for_bit(on_amd):
    """Under a bf16 launch the layer is F.linear under autocast, unchanged."""
    torch.manual_seed(0)
    ours = Linear(32, 48)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = ours(x), F.linear(x, ours.weight, ours.bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_off_amd_it_is_torch_linear_bit_for_bit(monkeypatch):
    monkeypatch.setattr(cpu_linear, "ON_AMD", False)
    torch.manual_seed(0)
    ours = Linear(32, 48)
    x = torch.randn(5, 32)
    assert torch.equal(ours(x), F.linear(x, ours.weight, ours.bias))


def test_inference_is_torch_linear_bit_for_bit(on_amd):
    """Under no_grad (evals, generation, validation) the layer computes what F.linear does with its weights, as the
    evals do on a bare model's head: the same scores through a wrapper or without one."""
    torch.manual_seed(0)
    ours = Linear(32, 48)
    x = torch.randn(5, 7, 32)
    with torch.no_grad():
        assert torch.equal(ours(x), F.linear(x, ours.weight, ours.bias))
