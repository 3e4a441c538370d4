"""modeling.fused_ce: the chunked linear + cross-entropy equals F.cross_entropy over the full logits."""

import pytest
import torch

from bench import loss_numerics as numerics
from modeling import cpu_linear
from modeling.fused_ce import fused_linear_cross_entropy

N, E, V = 300, 32, 1000


def make_inputs(dtype: torch.dtype, ignored_every: int | None = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, E, generator=g, dtype=dtype)
    weight = torch.randn(V, E, generator=g, dtype=dtype) * 0.3
    targets = torch.randint(0, V, (N,), generator=g)
    if ignored_every:
        targets[::ignored_every] = -100
    return h, weight, targets


def loss_and_grads(loss_fn, h, weight, targets, scale: float = 1.0):
    h, weight = h.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(h, weight, targets)
    (scale * loss).backward()
    return loss.detach(), h.grad, weight.grad


# 16 is raised to ceil(300 / MAX_CHUNKS) = 38; 64 leaves a ragged last chunk; 1024 is a single chunk
@pytest.mark.parametrize("chunk_rows", [16, 64, 1024])
def test_matches_cross_entropy_fp32_with_ignored_rows(chunk_rows):
    h, weight, targets = make_inputs(torch.float32)
    fused = lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_rows=chunk_rows)
    # a grad_output other than 1 (loss scaling, gradient accumulation) must scale the stored grads
    got, want = (
        loss_and_grads(fused, h, weight, targets, 3.0),
        loss_and_grads(numerics.plain_cross_entropy, h, weight, targets, 3.0),
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_ignored_rows_get_zero_gradient():
    h, weight, targets = make_inputs(torch.float32)
    _, grad_h, _ = loss_and_grads(fused_linear_cross_entropy, h, weight, targets)
    assert grad_h[targets == -100].abs().max() == 0
    assert grad_h[targets != -100].abs().min() > 0


def test_no_grad_computes_the_loss_only_and_a_frozen_head_gets_no_grad():
    h, weight, targets = make_inputs(torch.float32)
    h.requires_grad_()
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, weight.requires_grad_(), targets)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, numerics.plain_cross_entropy(h, weight, targets).detach())
    weight.requires_grad_(False)
    fused_linear_cross_entropy(h, weight, targets).backward()
    want_h = torch.autograd.grad(numerics.plain_cross_entropy(h, weight, targets), h)[0]
    torch.testing.assert_close(h.grad, want_h, atol=1e-5, rtol=1e-5)


def test_all_targets_ignored_is_nan_with_zero_grads_like_cross_entropy():
    h, weight, targets = make_inputs(torch.float32)
    targets[:] = -100
    loss, grad_h, grad_w = loss_and_grads(fused_linear_cross_entropy, h, weight, targets)
    want_loss, want_h, want_w = loss_and_grads(numerics.plain_cross_entropy, h, weight, targets)
    assert want_loss.isnan() and loss.isnan()
    assert torch.equal(grad_h, want_h) and torch.equal(grad_w, want_w)  # all zeros


def test_bf16_autocast_close_to_autocast_cross_entropy():
    h, weight, targets = make_inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_rows=128)
        got = loss_and_grads(fused, h, weight, targets)
        want = loss_and_grads(numerics.plain_cross_entropy, h, weight, targets)
    # fp32 master grads, like autocast's plain path
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=1e-2)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert (g - w).norm() / w.norm() < 2e-2


# From uniform to memorized text: where softmax and one-hot nearly cancel, the precision a shortcut loses shows.
CONFIDENCE = [0.5, 0.99995, 1 - 1e-8]


@pytest.fixture(scope="module", params=CONFIDENCE, ids=lambda p: f"p_target={p:.8g}")
def confident(request):
    h, weight, targets = numerics.confident_inputs(request.param)
    return h, weight, targets, numerics.reference(h, weight, targets)


# Every launch YAML compiles the loss, which then takes its masked-sum form; eager takes gather/scatter_.
@pytest.fixture(scope="module", params=["eager", "compiled"])
def fused(request):
    fused = lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_rows=64)  # 4 chunks
    return torch.compile(fused) if request.param == "compiled" else fused


# fp32 products by torch (MKL on x86) or, as on AMD CPUs, by oneDNN (modeling/cpu_linear.py), forced on either CPU
@pytest.mark.parametrize("on_amd", [False, True], ids=["torch", "onednn"])
def test_fp32_matches_the_fp64_reference_even_when_confident(confident, fused, on_amd, monkeypatch):
    monkeypatch.setattr(cpu_linear, "ON_AMD", on_amd)
    h, weight, targets, want = confident
    errors = numerics.relative_errors(numerics.loss_and_grads(fused, h, weight, targets, "fp32"), want)
    # F.cross_entropy in fp32 is 2e-3 (loss) and 8e-2 (grads) off at p_target = 1 - 1e-8
    assert max(errors) < 1e-5, errors


def assert_at_least_as_accurate_as_cross_entropy(fused, h, weight, targets, want, precision: str) -> None:
    """Loss, grad_h and grad_w of the fused loss within 1.1x F.cross_entropy's error against fp64 (+1e-6)."""
    got = numerics.relative_errors(numerics.loss_and_grads(fused, h, weight, targets, precision), want)
    plain = numerics.loss_and_grads(numerics.plain_cross_entropy, h, weight, targets, precision)
    plain_errors = numerics.relative_errors(plain, want)
    for name, g, p in zip(("loss", "grad_h", "grad_w"), got, plain_errors, strict=True):
        assert g <= 1.1 * p + 1e-6, f"{precision} {name}: fused {g:.3g} vs F.cross_entropy {p:.3g}"


def test_a_target_tied_at_the_max_with_another_id(fused):
    """Every target's head row has a twin, and the hidden states point at it: the target's logit ties with another
    id's at the row's max (p_target ~ 1/2). The compiled form takes the others' mass from the ids below the max only
    where the target is alone there."""
    g = torch.Generator().manual_seed(0)
    n, n_embd, vocab = 256, 64, 2048
    half = torch.randn(vocab // 2, n_embd, generator=g, dtype=torch.float64) / n_embd**0.5
    weight = torch.cat([half, half])  # id j + vocab / 2 is id j's twin
    targets = torch.randint(0, vocab // 2, (n,), generator=g)
    h = torch.randn(n, n_embd, generator=g, dtype=torch.float64) / n_embd**0.5 + 10 * weight[targets]
    targets[::9] = -100
    want = numerics.reference(h, weight, targets)
    p_target = torch.exp(-want[0]).item()
    assert 0.4 < p_target < 0.5, p_target  # the rest: ~5% over the other ids
    errors = numerics.relative_errors(numerics.loss_and_grads(fused, h, weight, targets, "fp32"), want)
    assert max(errors) < 1e-5, errors
    assert_at_least_as_accurate_as_cross_entropy(fused, h, weight, targets, want, "bf16")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_is_at_least_as_accurate_as_cross_entropy(confident, fused, precision):
    """Against fp64, under the autocast dtype a launch YAML selects (fp16 with accelerate's loss scaling)."""
    h, weight, targets, want = confident
    assert_at_least_as_accurate_as_cross_entropy(fused, h, weight, targets, want, precision)
