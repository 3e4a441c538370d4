"""modeling.fp8_head: the head's logits from torch._scaled_mm (which runs on the CPU too) against the bf16 head and
fp64: logits, loss and both gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import loss_numerics as numerics
from modeling.fp8_head import fp8_logits
from modeling.fused_ce import linear_cross_entropy

# Small: on an AMX Xeon torch hands FP8 matmuls to oneDNN, which runs them with its scalar reference kernel (one
# 512 x 256 x 4,096 product took 48 s; a case of the accuracy test at this size 1.6 s). The errors are the same at both.
N, E, V = 128, 128, 1024


def logits_loss_grads(head, h, weight, targets, dtype=torch.float32) -> list[torch.Tensor]:
    h, weight = h.to(dtype).clone().requires_grad_(), weight.to(dtype).clone().requires_grad_()
    logits = head(h, weight)
    loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
    loss.backward()
    assert h.grad.dtype == h.dtype and weight.grad.dtype == weight.dtype  # fp32 master weights get fp32 grads
    return [t.detach().double() for t in (logits, loss, h.grad, weight.grad)]


def bf16_head(h, weight):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return h @ weight.t()


@pytest.mark.usefixtures("fp8_matmul")  # tests/conftest.py: skips where oneDNN is held to an ISA without FP8
@pytest.mark.parametrize("weight_std", [0.02, 0.06])  # GPT-2's init, and a trained head's wider spread
def test_fp8_head_against_fp64_and_the_bf16_head(weight_std):
    """Measured relative errors against fp64 (logits / loss / grad_h / grad_w), both weight spreads: bf16 2.9e-3 /
    <6e-5 / 2.5e-3 / 2.6e-3, FP8 3.75e-2 / <8.3e-5 / 2.67e-2 / 2.65e-2 (e4m3 keeps 3 mantissa bits to bf16's 7).
    Bounds: 1.5x those (the loss's: 2.4x)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, E, generator=g)
    weight = torch.randn(V, E, generator=g) * weight_std
    targets = torch.randint(0, V, (N,), generator=g)
    want = logits_loss_grads(lambda a, b: a @ b.t(), h, weight, targets, torch.float64)
    fp8 = logits_loss_grads(fp8_logits, h, weight, targets)
    bf16 = logits_loss_grads(bf16_head, h, weight, targets)

    def errors(got):
        return [((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True)]

    fp8_errors, bf16_errors = errors(fp8), errors(bf16)
    for name, err, bound in zip(("logits", "loss", "grad_h", "grad_w"), fp8_errors, (0.056, 2e-4, 0.04, 0.04)):
        assert err < bound, f"{name}: {err:.3g}"
    assert fp8_errors[0] > 5 * bf16_errors[0]  # it is the FP8 matmul that ran, not a bf16 one


@pytest.mark.usefixtures("fp8_matmul")
@pytest.mark.parametrize("p_target", [0.99995, 1 - 1e-8], ids=str)
def test_fp8_head_stays_within_a_few_times_the_bf16_heads_error_as_predictions_grow_confident(p_target):
    """Long training makes predictions confident (memorized text): the loss then nears 0 and the logits' rounding
    weighs on it most. Against fp64 (bench.loss_numerics' confident rows), FP8's loss and gradient errors were 1.3-3.7x
    the bf16 head's there (0.0156 / 0.136 / 0.107 at p 0.99995, 0.39 / 0.41 / 0.41 at 1 - 1e-8, for bf16's 0.012 /
    0.055 / 0.053 and 0.11 / 0.12 / 0.11), where its logits alone are 13x: a bound of 5x the bf16 head's."""
    h, weight, targets = (t.float() if t.is_floating_point() else t for t in numerics.confident_inputs(p_target))
    want = logits_loss_grads(lambda a, b: a @ b.t(), h, weight, targets, torch.float64)

    def errors(head) -> list[float]:
        got = logits_loss_grads(head, h, weight, targets)
        return [((a - b).norm() / b.norm()).item() for a, b in zip(got[1:], want[1:], strict=True)]

    fp8, bf16 = errors(fp8_logits), errors(bf16_head)
    for name, f, b in zip(("loss", "grad_h", "grad_w"), fp8, bf16, strict=True):
        assert f <= 5 * b, f"{name}: FP8 {f:.3g}, bf16 {b:.3g}"


def test_the_models_loss_takes_fp8_only_with_the_full_logits():
    """On the CPU the loss is the fused form, which ignores fp8: the same loss bit for bit."""
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(64, 32, generator=g), torch.randn(128, 32, generator=g) * 0.1
    targets = torch.randint(0, 128, (64,), generator=g)
    assert torch.equal(linear_cross_entropy(h, weight, targets, fp8=True), linear_cross_entropy(h, weight, targets))


@pytest.mark.usefixtures("fp8_matmul")  # tests/conftest.py: skips where oneDNN is held to an ISA without FP8
def test_compiled_in_one_graph_and_equal_to_eager():
    """Training compiles the FP8 head (it is taken with the full logits, under torch.compile on CUDA): no graph break,
    and inductor's loss and grads are eager's, to fp32 rounding: inductor sums the softmax in another order on some
    CPUs (on a 16-core AMX Xeon the loss was 1 ulp apart, 9.5e-8 relative; the grads equal)."""

    def loss(h, weight, targets):
        return F.cross_entropy(fp8_logits(h, weight).float(), targets)

    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(64, 32, generator=g), torch.randn(128, 32, generator=g) * 0.1
    targets = torch.randint(0, 128, (64,), generator=g)
    explained = torch._dynamo.explain(loss)(h, weight, targets)
    assert explained.graph_break_count == 0, explained.break_reasons

    def run(fn):
        h_, weight_ = h.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h_, weight_, targets)
        out.backward()
        return out, h_.grad, weight_.grad

    for got, want in zip(run(torch.compile(loss)), run(loss), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # ~10 ulps; the FP8 rounding is 3.7e-2
