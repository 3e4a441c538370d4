"""modeling.fused_ce: the chunked linear + cross-entropy equals F.cross_entropy over the full logits, and the rule that
picks one of the two forms for the model's loss."""

import functools

import pytest
import torch

from bench import loss_numerics as numerics
from modeling import cpu_linear, cpu_softmax, fused_ce
from modeling.fused_ce import (
    full_logits_cross_entropy,
    fused_linear_cross_entropy,
    linear_cross_entropy,
    takes_full_logits,
)

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


@functools.cache  # once per confidence: pytest sets the module fixture up again for each `fused` form it meets
def confident_case(p_target: float) -> tuple[torch.Tensor, ...]:
    h, weight, targets = numerics.confident_inputs(p_target)
    return h, weight, targets, numerics.reference(h, weight, targets)


@pytest.fixture(scope="module", params=CONFIDENCE, ids=lambda p: f"p_target={p:.8g}")
def confident(request):
    return confident_case(request.param)


# Each chunk's softmax is the C kernel (modeling/cpu_softmax.py) wherever gcc builds it, so the CPU's kernel case;
# its torch form (fused_ce.softmax_grad) is what GPUs, mps and CPUs without gcc run: tested here with the kernel
# turned off. Every launch YAML compiles the loss, whose torch form then takes its masked-sum form; eager takes
# gather/scatter_.
@pytest.fixture(
    scope="module", params=[("eager", "kernel"), ("compiled", "kernel"), ("eager", "torch"), ("compiled", "torch")],
    ids=lambda p: f"{p[0]}-{'C_kernel' if p[1] == 'kernel' else 'torch_form'}",
)  # fmt: skip
def fused(request):
    mode, softmax = request.param
    fused = lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_rows=64)  # 4 chunks
    with pytest.MonkeyPatch.context() as patch:
        if softmax == "torch":
            patch.setattr(cpu_softmax, "takes", lambda logits: False)
        yield torch.compile(fused) if mode == "compiled" else fused


# fp32 products by torch (MKL on x86) or, as on AVX-512 AMD CPUs, by oneDNN (modeling/cpu_linear.py), forced on
# either CPU
@pytest.mark.parametrize("onednn", [False, True], ids=["torch", "onednn"])
def test_fp32_matches_the_fp64_reference_even_when_confident(confident, fused, onednn, monkeypatch):
    monkeypatch.setattr(cpu_linear, "ONEDNN_FP32", onednn)
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


@pytest.mark.parametrize("slab", [96, 1000, 4096])
def test_bf16_logits_by_vocabulary_slabs_are_f_linears(slab):
    """One product per `slab` rows of the head (a ragged last slab at 96, one slab at 1,000 and 4,096): every entry is
    the dot product F.linear computes, rounded to bf16 alike (one bf16 step apart at most)."""
    h, weight, _ = make_inputs(torch.bfloat16)
    got, want = fused_ce.logits_by_slabs(h, weight, slab), torch.nn.functional.linear(h, weight)
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape == (N, V)
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)


def test_the_fused_loss_takes_its_bf16_logits_on_the_cpu_by_slabs(monkeypatch):
    """Under bf16 autocast on the CPU each chunk's logits come from logits_by_slabs, and slabs of 96 of the 1,000 ids
    give the loss and gradients one product gives, to rounding."""
    h, weight, targets = make_inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = loss_and_grads(fused_linear_cross_entropy, h, weight, targets)  # 1,000 ids: one slab of 4,096
        slabs, real = [], fused_ce.logits_by_slabs

        def spy(x: torch.Tensor, w: torch.Tensor, slab: int) -> torch.Tensor:
            slabs.append(slab)
            return real(x, w, slab)

        monkeypatch.setattr(fused_ce, "VOCAB_SLAB", 96)
        monkeypatch.setattr(fused_ce, "logits_by_slabs", spy)
        sliced = loss_and_grads(fused_linear_cross_entropy, h, weight, targets)
    assert slabs == [96]  # one chunk of 300 rows
    errors = [((s - w).norm() / w.norm()).item() for s, w in zip(sliced, whole, strict=True)]
    assert max(errors) < 1e-4, errors


GIB = 2**30
H100 = 80 * GIB  # an H100's memory, about (the rule reads the device's own)
B16_BF16 = 16 * 1024 * 50_304 * 2  # gpt2-124m's logits at micro-batch 16 in bf16: 1.5 GiB


@pytest.mark.parametrize(
    "device_type, compiling, logits_bytes, device_bytes, full",
    [
        ("cuda", True, B16_BF16, H100, True),  # compiled on CUDA: the full logits (7.62 ms / 1.51 GiB vs 8.70 / 3.02)
        ("cuda", True, H100 // 8, H100, True),  # at the cap
        ("cuda", True, H100 // 8 + 1, H100, False),  # past it: too large to hold, fused
        ("cuda", True, 4 * B16_BF16, 16 * GIB, False),  # B64 on a 16 GB card
        ("cuda", False, B16_BF16, H100, False),  # eager on CUDA (evals): fused (1.25 GiB vs 7.83)
        ("cpu", True, B16_BF16, None, False),  # CPUs: fused, compiled or not
        ("cpu", False, B16_BF16, None, False),
        ("mps", False, B16_BF16, None, False),
    ],
)
def test_the_rule_takes_the_full_logits_only_compiled_on_cuda_while_they_fit(
    device_type, compiling, logits_bytes, device_bytes, full
):
    assert takes_full_logits(device_type, compiling, logits_bytes, device_bytes) is full


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_models_loss_on_the_cpu_is_the_fused_form(compiled):
    """linear_cross_entropy (GPT.forward's loss) is the fused form, bit for bit, eager and compiled."""
    h, weight, targets = make_inputs(torch.float32)
    wrap = torch.compile if compiled else lambda fn: fn
    got = loss_and_grads(wrap(linear_cross_entropy), h, weight, targets)
    want = loss_and_grads(wrap(fused_linear_cross_entropy), h, weight, targets)
    plain = loss_and_grads(wrap(full_logits_cross_entropy), h, weight, targets)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not all(torch.equal(g, p) for g, p in zip(got, plain, strict=True))  # the forms round apart: it tells


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_two_forms_agree_compiled_where_the_rule_switches(precision):
    """Compiled (where the rule switches between them with the device and size), the full-logits form and the fused
    one give the same loss and grads: to rounding (the bf16 matmuls round alike in both; the sums differ)."""
    h, weight, targets = make_inputs(torch.float32)
    dtype = torch.bfloat16 if precision == "bf16" else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        full = loss_and_grads(torch.compile(full_logits_cross_entropy), h, weight, targets)
        fused = loss_and_grads(torch.compile(fused_linear_cross_entropy), h, weight, targets)
    errors = [((f - p).norm() / p.norm()).item() for f, p in zip(fused, full, strict=True)]
    # measured (loss, grad_h, grad_w) apart: fp32 0 / 5.3e-7 / 2.2e-7, bf16 0 / 2.7e-7 / 1.1e-5; ~10x margin
    bound = 5e-6 if precision == "fp32" else 1e-4
    assert max(errors) < bound, errors


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("marked", [fused_ce.cuda_memory_bytes, cpu_softmax.built], ids=lambda f: f.__name__)
def test_the_loss_rules_lookups_are_marked_constant_as_torch_marks_them(marked):
    """cuda_memory_bytes and cpu_softmax.built carry the mark @torch.compiler.assume_constant_result sets (set by
    hand, sparing every process the decorator's import of torch._dynamo; dynamo asks them once rather than trace a
    device query or a build): the day torch marks otherwise, this fails here, not on a GPU as a graph break."""

    def probe():
        return 0

    torch.compiler.assume_constant_result(probe)
    assert vars(probe) and vars(marked) == vars(probe)


@needs_cuda
def test_on_cuda_the_rule_compiles_in_one_graph_and_takes_the_full_logits():
    """On a CUDA device, compiled: the rule reads the device's memory while tracing without a graph break, and at a
    size well under the cap the loss is the full-logits form's; eager it is the fused form's."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2048, 256, generator=g).cuda()
    weight = (torch.randn(50_304, 256, generator=g) * 0.02).cuda()
    targets = torch.randint(0, 50_257, (2048,), generator=g).cuda()
    assert fused_ce.FULL_LOGITS_MAX_SHARE * fused_ce.cuda_memory_bytes(h.device) >= 2048 * 50_304 * 4
    explained = torch._dynamo.explain(linear_cross_entropy)(h, weight, targets)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.compiler.reset()
    got = loss_and_grads(torch.compile(linear_cross_entropy), h, weight, targets)
    want = loss_and_grads(torch.compile(full_logits_cross_entropy), h, weight, targets)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    eager = loss_and_grads(linear_cross_entropy, h, weight, targets)
    fused = loss_and_grads(fused_linear_cross_entropy, h, weight, targets)
    assert all(torch.equal(a, b) for a, b in zip(eager, fused, strict=True))
