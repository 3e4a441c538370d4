"""The speed ladder's parts (bench.rungs, .measure, .report, .peer) at a tiny size: the rung variants, the targets
and the peer loader are honest."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

import pytest
import torch
from torch._dynamo.eval_frame import OptimizedModule

from bench import peer
from bench.ladder import run_ladder, run_peers
from bench.measure import Bench, Result, flops_per_token, peak_kind, unless_out_of_memory, untimed_bf16
from bench.report import target_lines
from bench.rungs import REPO, RUNGS, Recipe, Role, Trainer, full_recipe_trainer, launch_config, tf32_matmuls
from modeling.config import PADDED_VOCAB_SIZE, REAL_VOCAB_SIZE, GPTConfig, get_preset
from modeling.gpt import GPT
from modeling.reference import ReferenceGPT
from training.metrics import cuda_matmul_kind, datasheet_peak
from training.step import Trainer as StepTrainer


def test_reference_variants_compute_the_same_loss():
    """Rungs 1 and 6 change kernels, not math: same weights, same loss and gradients as the baseline model."""
    config = get_preset("tiny-cpu")
    x, y = torch.randint(0, REAL_VOCAB_SIZE, (2, 2, config.block_size))
    models = []
    for recipe in (RUNGS[0].apply(Recipe()), RUNGS[6].apply(RUNGS[1].apply(Recipe()))):
        torch.manual_seed(0)
        models.append(recipe.build_model(config))
    baseline, variant = models
    assert not any(isinstance(m, type(baseline.final_norm)) for m in variant.modules())
    losses = [m.loss(x, y) for m in models]
    torch.testing.assert_close(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(baseline.out_head.weight.grad, variant.out_head.weight.grad)


def test_targets_compare_with_the_peer_as_published_and_report_the_fp32_peer_without_a_target():
    row = lambda label, tok_s, role, **kw: Result(label, f"row {label} {tok_s}", "", role, tok_s=tok_s, **kw)
    rows = [
        row("0", 1000.0, Role.BASELINE),
        row("7", 3000.0, Role.RUNG),  # neither the baseline nor the full recipe, whatever its speed
        row("11", 2000.0, Role.FULL_RECIPE),
        row("peer", 1100.0, Role.PEER),
        row("peer", 1500.0, Role.PEER, as_published=False),
    ]
    assert target_lines(rows) == [
        "full recipe / rung 0: 2.00x (target >= 5.0x): NOT met",
        "full recipe / best peer (row peer 1100.0): 1.82x (target >= 1.5x): met",
        "full recipe / peer at rung 11's precision (row peer 1500.0): 1.33x (no target: not the peer's own recipe)",
    ]
    assert target_lines(rows[:2] + rows[3:]) == []  # no full-recipe row, nothing to compare


def test_gpu_target_is_mfu_against_the_measured_bf16_peak():
    full = Result("11", "full recipe", "", Role.FULL_RECIPE, tok_s=100_000.0, model_tflops=440.0)
    mfu_line = "full recipe MFU against the measured bf16 matmul peak ({:.0f} TFLOP/s): {} (target >= 55%): {}"
    assert target_lines([full], measured_bf16_tflops=750.0) == [mfu_line.format(750.0, "58.7%", "met")]
    assert target_lines([full], measured_bf16_tflops=820.0) == [mfu_line.format(820.0, "53.7%", "NOT met")]
    assert target_lines([full]) == []  # CPU: no measured GPU peak, no MFU target


def test_flops_per_token_counts_tied_and_untied_heads():
    config = get_preset("tiny-cpu")
    assert flops_per_token(GPT(config), config) == GPT(config).flops_per_token()
    reference = ReferenceGPT(config)  # untied: tok_emb is a lookup, out_head a matmul
    matmul_params = sum(p.numel() for p in reference.parameters()) - REAL_VOCAB_SIZE * 64 - 64 * 64
    assert flops_per_token(reference, config) == 6 * matmul_params + 12 * 2 * 64 * 64


def test_peer_loader_runs_only_classes_imports_and_its_schedule(tmp_path):
    """A stand-in train_gpt2.py whose top level would train (here: raise) and import a local eval module; its
    get_lr and max_lr / min_lr are kept, its run-length globals (set per run by the benchmark) are not."""
    (tmp_path / "hellaswag.py").write_text("raise RuntimeError('local eval module imported')\n")
    (tmp_path / peer.SCRIPT).write_text(
        "import math\nfrom hellaswag import render_example\n\n"
        "class GPTConfig:\n    size = math.pi\n\n"
        "max_lr = 6e-4\nmin_lr = max_lr * 0.1\nwarmup_steps = 715\n"
        "def get_lr(it):\n    return max_lr if it < warmup_steps else min_lr\n\n"
        "def train():\n    pass\n\n"
        "raise RuntimeError('training loop ran')\n"
    )
    assert peer.peer_script(tmp_path / "absent") is None
    module = peer.load_peer(peer.peer_script(tmp_path))
    assert module.GPTConfig.size == math.pi and not hasattr(module, "render_example")
    assert not hasattr(module, "warmup_steps") and not hasattr(module, "train")
    module.warmup_steps = 2
    assert [module.get_lr(it) for it in (1, 2)] == [6e-4, 6e-4 * 0.1]
    (tmp_path / "hellaswag.py").unlink()  # train_gpt2.py carried alone, as to a GPU machine (BENCHMARKS "GPU")
    assert peer.load_peer(peer.peer_script(tmp_path)).GPTConfig.size == math.pi


def test_bf16_rows_are_not_timed_on_a_cpu_whose_bf16_is_20x_slower(tmp_path):
    """An AVX2-only CPU multiplies bf16 30-300x slower than fp32: rungs 5-10 and the peer's bf16 recipe are n/a there,
    saying why, where timing them would take minutes a step; a CPU whose bf16 is merely slower (Cascade Lake, ~5x)
    or faster still times them."""
    config, cpu = get_preset("tiny-cpu"), torch.device("cpu")
    slow_bf16 = Bench(config, cpu, tmp_path, 1, 1, 1, {"bf16": 0.002, "fp32": 0.2}, 0)
    launch = launch_config(REPO / "accelerate_configs" / "cpu.yaml")
    rows = run_ladder(slow_bf16, {5, 10}, launch, None, 1)
    (tmp_path / peer.SCRIPT).write_text("class GPTConfig:\n    pass\n")
    module = peer.load_peer(peer.peer_script(tmp_path))
    rows += run_peers(slow_bf16, tmp_path, module, "inductor", recipe_precision="bf16")  # its two bf16 rows only
    assert [(r.label, r.status) for r in rows] == [("5", "n/a"), ("10", "n/a"), ("peer", "n/a"), ("peer", "n/a")]
    why = "this CPU's bf16 matmuls run 100x slower than fp32 (no native bf16): not timed"
    assert all(r.reason == why for r in rows)
    for bf16 in (0.04, 0.8):  # 5x slower, 4x faster
        assert untimed_bf16(cpu, bf16, 0.2) is None


@pytest.mark.skipif(not os.environ.get("BENCH_PEER_DIR"), reason="set BENCH_PEER_DIR to a build-nanogpt checkout")
def test_real_peer_trains_one_step():
    config = get_preset("tiny-cpu")
    module = peer.load_peer(peer.peer_script(os.environ["BENCH_PEER_DIR"]))
    step, model = peer.build_peer_step(module, config, torch.device("cpu"), compile_backend=None)
    x, y = torch.randint(0, REAL_VOCAB_SIZE, (2, 2, config.block_size))
    before = model.lm_head.weight.detach().clone()
    assert math.isclose(step(x, y).item(), math.log(PADDED_VOCAB_SIZE), abs_tol=0.5)
    assert not torch.equal(before, model.lm_head.weight)


def tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_is_set_for_its_row_only(prepared_books, tf32):
    """Each row runs (build, steps, profile) under its own TF32 setting, and the next row starts from the one
    before it: rung 2's TF32 cannot leak into later rows, nor be missing from a row that needs it."""
    config = get_preset("tiny-cpu")
    bench = Bench(config, torch.device("cpu"), prepared_books, 1, 1, 1, {"fp32": 1.0}, 0)
    seen = []

    def make() -> Trainer:
        model = torch.nn.Linear(1, 1)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            seen.append(tf32_flags())
            return torch.zeros(())

        seen.append(tf32_flags())
        return Trainer(step, model, False, 1, "fp32")

    before = tf32_flags()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
    try:
        row = bench.measure(Result("2", "TF32", ""), make, deep_profile=False, tf32=tf32)
        assert row.status == "ok" and row.tok_s > 0
        assert seen and set(seen) == {(tf32, tf32)}  # at build time and at every step
        assert tf32_flags() == (not tf32, not tf32)  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_an_out_of_memory_row_is_reported_not_raised():
    def out_of_memory() -> Result:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.28 GiB")

    row = Result("0", "baseline", "ReferenceGPT", Role.BASELINE)
    result = unless_out_of_memory(row, out_of_memory)
    assert (result.label, result.role, result.status) == ("0", Role.BASELINE, "n/a")
    assert result.reason == "out of memory (CUDA out of memory. Tried to allocate 12.28 GiB)"
    assert target_lines([result]) == []  # an OOM row is no baseline to compare with


def test_a_cpu_allocation_that_fails_is_an_out_of_memory_row():
    """On the CPU running out of memory is the allocator's RuntimeError, not torch.OutOfMemoryError; any other
    RuntimeError is a bug to see, not a row."""
    row = Result("9", "vocab 50,304", "")
    result = unless_out_of_memory(row, lambda: torch.empty(2**50))  # 4 PiB: past any machine's address space
    assert result.status == "n/a" and result.reason.startswith("out of memory (")
    assert "DefaultCPUAllocator: can't allocate memory" in result.reason

    def broken() -> Result:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        unless_out_of_memory(row, broken)


@dataclasses.dataclass
class MemoryCappedBench(Bench):
    """A device that holds micro-batches of up to fits_up_to sequences: a larger one runs out of memory where its
    measurement starts, as CUDA reports it. The trainer is built and a batch that fits is measured for real; only
    the out-of-memory is made up: a rung runs out of a CPU's memory only past all the machine has, which Linux may
    grant and then kill the process for."""

    fits_up_to: int = 0

    def _measure(self, row: Result, trainer: Trainer, deep_profile: bool, tf32: bool) -> Result:
        if trainer.micro_batch_size > self.fits_up_to:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {trainer.micro_batch_size} GiB")
        return super()._measure(row, trainer, deep_profile, tf32)


@pytest.mark.parametrize(
    ("fits_up_to", "cap", "expected"),
    [
        (1, 2, ("ok", 1, "")),  # the search goes below the base micro-batch (2) and keeps B=1
        (0, 2, ("n/a", None, "out of memory (nothing fits, B=4 down to B=1)")),  # accelerate's search reaches zero
        (1, 1, ("n/a", None, "out of memory (CUDA out of memory. Tried to allocate 2 GiB)")),  # no search: rung 9's
    ],
)
def test_rung_10_after_rung_9_ran_out_of_memory_is_a_row(prepared_books: Path, fits_up_to: int, cap: int, expected):
    """Rung 9 runs out of memory at the base micro-batch: rung 10 still makes a row (the largest micro-batch that fits,
    rung 9's n/a row left out of its comparison; or n/a) and the ladder goes on, instead of a TypeError or
    accelerate's RuntimeError losing the rest of the ladder and its report."""
    config = GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=16)  # rungs 9-10 are bf16: slow on AVX2 CPUs
    peaks = {"bf16": 1.0, "fp32": 1.0}  # bf16 rows timed whatever this CPU's bf16 speed
    bench = MemoryCappedBench(config, torch.device("cpu"), prepared_books, 2, 1, 1, peaks, 0, fits_up_to=fits_up_to)
    launch = launch_config(REPO / "accelerate_configs" / "cpu.yaml")
    rung_9, rung_10 = run_ladder(bench, {9, 10}, launch, "eager", cap)
    assert (rung_9.label, rung_9.status, rung_9.tok_s) == ("9", "n/a", None)
    assert rung_9.reason == "out of memory (CUDA out of memory. Tried to allocate 2 GiB)"
    assert (rung_10.label, rung_10.status, rung_10.micro_batch_size, rung_10.reason) == ("10", *expected)
    if rung_10.status == "ok":
        assert rung_10.tok_s > 0
        assert re.fullmatch(r"largest that fits \(cap 2x\): B=1; tried B=1: [\d,]+ tok/s; kept B=1", rung_10.notes[-1])


def test_fp32_rows_that_run_tf32_on_cuda_are_scored_against_the_tf32_peak():
    """An H100's fp32 matmuls run 7x faster as TF32: an fp32 row with TF32 allowed scored against the plain fp32
    peak could show MFU over 100%. The ladder reads its TF32 peak under the flag that the row runs with."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert peak_kind("fp32", True, cuda) == "tf32"
    assert peak_kind("fp32", False, cuda) == "fp32"
    assert peak_kind("bf16", True, cuda) == "bf16"  # autocast matmuls are bf16 whatever TF32 says
    assert peak_kind("fp32", True, cpu) == "fp32"  # TF32 is an NVIDIA format: no such peak on CPU
    for tf32, kind in ((True, "tf32"), (False, "fp32")):
        with tf32_matmuls(tf32):
            assert cuda_matmul_kind("no") == kind
    h100 = "NVIDIA H100 80GB HBM3"
    assert datasheet_peak(h100, "tf32")[0] > 7 * datasheet_peak(h100, "fp32")[0]


def test_rung_11_compiles_per_block_where_its_launch_yaml_does(fresh_accelerate_state):
    """The GPU YAMLs compile per block (dynamo_use_regional_compilation): rung 11, train_accel.py's step under the
    launch YAML, compiles each Block as the training run does, not the whole model."""
    launch = launch_config(REPO / "accelerate_configs" / "cpu_eager.yaml")
    launch["dynamo_config"] = {"dynamo_backend": "EAGER", "dynamo_use_regional_compilation": True}
    trainer = full_recipe_trainer(get_preset("tiny-cpu"), torch.device("cpu"), 2, launch, None)
    [step_trainer] = [c.cell_contents for c in trainer.step.__closure__ if isinstance(c.cell_contents, StepTrainer)]
    assert all(isinstance(block, OptimizedModule) for block in step_trainer.model.transformer.h)
