"""modeling.cpu_softmax: the fused loss's softmax as a C kernel on the CPU, against fp64 and against the loss's torch
form (modeling.fused_ce.softmax_grad), which it replaces where it is built and which stays where it is not."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from bench import loss_numerics as numerics
from modeling import cpu_softmax, fused_ce
from modeling.device import X86

ROWS, V = 64, 3000


def chunk(p_target: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's logits (ROWS, V) in dtype whose targets hold about p_target of each row's mass, their targets and
    row scales (every 5th row ignored: scale 0, target 0, as the fused loss passes them); row 1's target ties with
    another id at the max, row 2's lies far below the rest (its exp underflows)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, V, generator=g) * 2
    target = torch.randint(0, V, (ROWS, 1), generator=g)
    # the target's logit above the row's others by the margin that gives it p_target of the mass
    others = logits.exp().sum(-1, keepdim=True)
    margin = torch.log(torch.tensor(p_target / (1 - p_target))) + others.log()
    logits.scatter_(1, target, margin)
    logits[1, (target[1, 0] + 1) % V] = logits[1, target[1, 0]]
    logits[2, target[2, 0]] = -200.0
    scale = torch.full((ROWS, 1), 1 / 1000)
    scale[::5] = 0
    target[::5] = 0
    return logits.to(dtype), target, scale


def reference(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's loss and the loss's gradient, in fp64 from the same (rounded) logits."""
    log_p = torch.log_softmax(logits.double(), -1)
    onehot = torch.zeros_like(log_p).scatter_(1, target, 1.0)
    return -log_p.gather(1, target), (log_p.exp() - onehot) * scale.double()


def errors(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    return [((g.double() - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True)]


needs_kernel = pytest.mark.skipif(not cpu_softmax.built(), reason="the kernel is not built here (no gcc or libgomp)")


def test_the_kernel_is_built_where_gcc_is():
    """The suite's CPUs have gcc (torch.compile needs it): the tests here run the kernel, not only the torch form."""
    assert cpu_softmax.built() == (shutil.which("gcc") is not None)


@pytest.fixture(params=["native", "avx2"])
def kernel(request, monkeypatch):
    """The kernel as this process builds it (its CPU's ISA), and as gcc builds it for an AVX2-only CPU such as a Zen 3
    (or under ATEN_CPU_CAPABILITY=avx2): another vector width, another set of gcc's choices (its selects as AVX2
    blends), run here through the same op."""
    if request.param == "avx2":
        if not X86:
            pytest.skip("AVX2 is an x86 ISA")
        flags = cpu_softmax.isa_flags("AVX2")
        assert flags == ["-mno-avx512f"]
        library = cpu_softmax.build(flags)
        assert library is not None, "gcc builds the kernel for AVX2"
        monkeypatch.setattr(cpu_softmax, "_library", lambda: library)
    return request.param


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("p_target", [1e-4, 0.5, 0.99995, 1 - 1e-8], ids=str)
def test_as_accurate_as_the_torch_form_against_fp64(p_target, dtype, kernel):
    logits, target, scale = chunk(p_target, dtype)
    want = reference(logits, target, scale)
    out = logits.clone()
    loss = cpu_softmax.softmax_grad_(out, target, scale, True)
    got = errors((loss, out), want)
    for compiled in (False, True):
        form = torch.compile(fused_ce.softmax_grad) if compiled else fused_ce.softmax_grad
        torch_form = errors(form(logits.clone(), target, scale, compiled, True), want)
        # the gradient is rounded to dtype in both: the kernel's exps (2 ulp of fp32) do not show above that
        assert got[0] <= 1.1 * torch_form[0] + 1e-6 and got[1] <= 1.1 * torch_form[1] + 1e-7, (got, torch_form)
    assert got[0] < 1e-5, got  # the loss from fp32 sums, whatever the logits' dtype
    assert got[1] < (1e-6 if dtype == torch.float32 else 4e-3), got
    assert (out[::5] == 0).all()  # ignored rows: no gradient


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_with_a_nan_or_inf_logit_gets_a_nan_loss_and_gradient_as_in_the_torch_form(dtype, kernel):
    """A diverged step's logits: the step is skipped (or the run stopped) on its gradient norm alone, so a NaN or +inf
    logit must make its row's loss and gradient NaN, never a finite number, as F.cross_entropy's and the torch form's
    do; a -inf logit (an id the row rules out) is an exp of 0, and its row as the others stay as without it."""
    logits, target, scale = chunk(0.5, dtype)
    clean_out = logits.clone()
    clean_loss = cpu_softmax.softmax_grad_(clean_out, target, scale, True)
    bad = {3: float("nan"), 4: float("inf"), 6: float("-inf")}  # rows with a target (every 5th row is ignored)
    for row, value in bad.items():
        logits[row, (target[row, 0] + 7) % V] = value
    out = logits.clone()
    loss = cpu_softmax.softmax_grad_(out, target, scale, True)
    torch_loss, torch_grad = fused_ce.softmax_grad(logits.clone(), target, scale, False, True)
    for got_loss, grad in ((loss, out), (torch_loss, torch_grad)):
        assert got_loss[3].isnan().all() and got_loss[4].isnan().all(), got_loss[3:5]
        assert grad[3].isnan().all() and grad[4].isnan().all()
    assert torch.isfinite(loss[6]) and torch.isfinite(out[6]).all()
    assert out[6, (target[6, 0] + 7) % V] == 0  # exp(-inf): no mass, no gradient
    torch.testing.assert_close(loss[6], torch_loss[6], rtol=1e-5, atol=0)
    others = [r for r in range(ROWS) if r not in bad]
    assert torch.equal(loss[others], clean_loss[others]) and torch.equal(out[others], clean_out[others])


@needs_kernel
def test_the_loss_alone_leaves_the_logits_as_they_are():
    logits, target, scale = chunk(0.5, torch.bfloat16)
    out = logits.clone()
    loss = cpu_softmax.softmax_grad_(out, target, scale, False)
    assert torch.equal(out, logits)
    assert errors((loss,), reference(logits, target, scale)[:1])[0] < 1e-5


@needs_kernel
def test_the_same_bits_on_any_number_of_threads():
    """Each row is one thread's, in one order: a run resumed on other cores computes the same loss and gradient."""
    logits, target, scale = chunk(0.5, torch.bfloat16)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = logits.clone()
            results.append((cpu_softmax.softmax_grad_(out, target, scale, True), out))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(r, results[0], strict=True))


def test_without_gcc_the_fused_loss_keeps_its_torch_form(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    cpu_softmax._library.cache_clear()
    try:
        assert not cpu_softmax.built() and not cpu_softmax.takes(torch.zeros(2, 3))
        h, weight = torch.randn(8, 4), torch.randn(50, 4)
        targets = torch.randint(0, 50, (8,))
        torch.testing.assert_close(
            fused_ce.fused_linear_cross_entropy(h, weight, targets), numerics.plain_cross_entropy(h, weight, targets)
        )
    finally:
        cpu_softmax._library.cache_clear()


@needs_kernel
def test_a_build_is_kept_for_the_next_process_on_this_cpu_and_a_damaged_copy_built_again(monkeypatch, tmp_path):
    """The kernel is built once per machine and kept in the cache folder, one file per ISA build; a process that finds
    it loads it without gcc and computes the same bits; a copy cut short is built again; an unwritable cache leaves
    each process building its own."""
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path / "cache"))
    logits, target, scale = chunk(0.5, torch.float32)

    def computed(library) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(cpu_softmax, "_library", lambda: library)
        out = logits.clone()
        return cpu_softmax.softmax_grad_(out, target, scale, True), out

    built = computed(cpu_softmax.build([]))
    (kept,) = (tmp_path / "cache" / "kernels").iterdir()
    assert kept.name.startswith("cpu_softmax-") and kept.suffix == ".so"

    real_run = subprocess.run

    def no_gcc(*args, **kwargs):
        raise AssertionError("gcc ran although the cache holds the build")

    monkeypatch.setattr(subprocess, "run", no_gcc)
    loaded = computed(cpu_softmax.build([]))
    assert all(torch.equal(a, b) for a, b in zip(loaded, built, strict=True))
    if X86:  # the AVX2 build is another file beside it
        monkeypatch.setattr(subprocess, "run", real_run)
        assert cpu_softmax.build(cpu_softmax.isa_flags("AVX2")) is not None
        assert len(list(kept.parent.iterdir())) == 2

    # a copy cut short (a disk error; copies land whole by rename), in another cache folder: this process has the
    # first path loaded, and the C library hands a loaded path's library out again without reading the file
    damaged = tmp_path / "other" / "kernels" / kept.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(kept.read_bytes()[:100])
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(subprocess, "run", real_run)
    rebuilt = computed(cpu_softmax.build([]))
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, built, strict=True))
    assert damaged.read_bytes() == kept.read_bytes()

    monkeypatch.setenv("BOOKGPT_CACHE", str(kept))  # a file, not a folder: nothing can be kept there
    assert computed(cpu_softmax.build([])) is not None
    assert not [p for p in kept.parent.iterdir() if p.name.endswith(".tmp")]

    def no_home() -> Path:  # what pathlib raises for a user without a home folder (a container's uid)
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("BOOKGPT_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    assert computed(cpu_softmax.build([])) is not None
