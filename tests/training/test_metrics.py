"""metrics.jsonl tracker, resumed-run de-duplication, loss plot, peak-FLOPs lookup."""

import json
import os
import sys
import time

import pytest
import torch
import yaml

from modeling.cpu_linear import cpu_matmul_speeds
from modeling.device import X86
from testkit import REPO, run
from training.config import ConfigError, TrainConfig
from training.loop import setup
from training.metrics import (
    CPU_DDP_YAML,
    PEAK_TFLOPS,
    JSONLTracker,
    check_trackers,
    cpu_matmul_tflops_at_once,
    cpu_precision_hint,
    cuda_matmul_kind,
    datasheet_peak,
    gpu_precision_hint,
    gpu_product,
    measure_matmul_tflops,
    memory_stats,
    peak_tflops,
    plot_losses,
    precision_advice,
    read_metrics,
)


def test_jsonl_tracker_appends_and_later_rows_win(tmp_path):
    tracker = JSONLTracker(tmp_path)
    tracker.log({"train_loss": 5.0}, step=1)
    tracker.log({"train_loss": 4.0}, step=2)
    tracker.log({"val_loss": 4.5}, step=2)
    tracker.log({"train_loss": 3.9}, step=2)  # a resumed run re-logging step 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "train_loss": 5.0}
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("train_loss") for r in rows if "train_loss" in r] == [5.0, 3.9]
    assert [r["val_loss"] for r in rows if "val_loss" in r] == [4.5]


def test_plot_writes_png(tmp_path):
    tracker = JSONLTracker(tmp_path)
    for step in range(1, 6):
        tracker.log({"train_loss": 6.0 - step}, step=step)
    tracker.log({"val_loss": 2.0}, step=5)
    out = plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_flops_override_and_cpu_measurement():
    assert peak_tflops(torch.device("cpu"), "bf16", override=123.0) == (123.0, "config")
    measured, source = peak_tflops(torch.device("cpu"), "no")
    assert measured > 0.001 and source == f"measured fp32 matmul (1 thread × {torch.get_num_threads()})"


def test_precision_advice_names_the_faster_cpu_yaml_only_when_clearly_faster():
    # this project's Xeon (AVX-512 bf16, no AMX): bf16 runs at half the fp32 speed
    hint = precision_advice("bf16", {"bf16": 0.16, "no": 0.30})
    assert hint.startswith("hint:") and "1.9x" in hint
    assert "(accelerate_configs/cpu.yaml for one process, accelerate_configs/cpu_ddp2.yaml for two)" in hint
    # an AMX or Zen 4 core: bf16 ~4x fp32, so the fp32 cpu.yaml is the slow choice
    hint = precision_advice("no", {"bf16": 0.9, "no": 0.21})
    assert hint.startswith("hint:") and "accelerate_configs/cpu_bf16.yaml" in hint and "4.3x" in hint
    # the setting named, whichever YAML launched: the user's own, or a two-process one (no bf16 one ships)
    assert "mixed_precision: 'bf16' in the launch YAML (accelerate_configs/cpu_bf16.yaml for one process)" in hint
    # and the flag, which a launch that gave --mixed_precision no needs: it overrides the YAML
    assert "(accelerate_configs/cpu_bf16.yaml for one process), or pass --mixed_precision bf16 to accelerate " in hint
    # an AVX2-only core (Zen 3, most laptops): no native bf16, 30-300x slower; one line that says so
    warning = precision_advice("bf16", {"bf16": 0.0011, "no": 0.15})
    assert warning.startswith("warning: this CPU has no native bf16 matmuls: bf16 runs 136x slower than fp32")
    assert warning.endswith(
        "set mixed_precision: 'no' (fp32) in the launch YAML instead (accelerate_configs/cpu.yaml for one process, "
        "accelerate_configs/cpu_ddp2.yaml for two), or pass --mixed_precision no to accelerate launch (a "
        "--mixed_precision given there overrides the YAML's)"
    )
    assert "\n" not in warning
    # the two-process YAML named is fp32, and compiles nothing: it runs wherever the one-process one does
    ddp = yaml.safe_load((REPO / CPU_DDP_YAML).read_text())
    assert (ddp["mixed_precision"], ddp["num_processes"], "dynamo_config" in ddp) == ("no", 2, False)
    # an AVX-512 Xeon without its bf16 instructions (Cascade Lake): emulated too, 4.6x slower
    warning = precision_advice("bf16", {"bf16": 0.050, "no": 0.231})
    assert warning.startswith("warning: this CPU has no native bf16 matmuls: bf16 runs 5x slower than fp32")
    # within measurement noise, or already the faster one: say nothing
    assert precision_advice("no", {"bf16": 0.35, "no": 0.30}) is None
    assert precision_advice("no", {"bf16": 0.16, "no": 0.30}) is None
    assert precision_advice("bf16", {"bf16": 0.9, "no": 0.21}) is None
    assert precision_advice("no", {"bf16": 0.0011, "no": 0.15}) is None


def test_cpu_precision_hint_measures_both_dtypes_here():
    assert cpu_precision_hint("fp16") is None  # no CPU YAML to suggest
    speeds = cpu_matmul_speeds(seconds=0.2)
    assert speeds.keys() == {"no", "bf16"} and min(speeds.values()) > 0
    hints = {mp: cpu_precision_hint(mp) for mp in ("no", "bf16")}
    assert sum(hint is not None for hint in hints.values()) <= 1  # one of the two is the faster, never both


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="AVX2 emulation: x86 only")
def test_bf16_without_a_cpp_compiler_on_a_cpu_without_native_bf16_is_told_the_eager_fp32_yaml():
    """A bf16 launch where no C++ compiler works runs eagerly (a compiling one stops at start-up): on an AVX2-only
    CPU (emulated on any x86 one) its steps crawl, so it is warned, naming the YAML that runs there. It was told
    nothing, as both YAMLs the hint knew compile."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "CXX": "/nowhere/g++"}
    code = "from training.metrics import cpu_precision_hint as h; print(h('bf16')); print(h('no'))"
    bf16, fp32 = run([sys.executable, "-c", code], env=env).stdout.splitlines()
    assert bf16.startswith("warning: this CPU has no native bf16 matmuls: bf16 runs ")
    assert bf16.endswith(
        "set mixed_precision: 'no' (fp32) in the launch YAML instead (accelerate_configs/cpu_eager.yaml"
        " for one process, accelerate_configs/cpu_ddp2.yaml for two), or pass --mixed_precision no to accelerate"
        " launch (a --mixed_precision given there overrides the YAML's)"
    )
    assert fp32 == "None"  # no bf16 YAML runs without a compiler


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_cpu_peak_and_hint_are_bounded_whatever_the_dtype_costs_here(mixed_precision):
    """The start-up probe (peak of the launch dtype, then the other one for the hint) stays near its ~1 s budget
    even for a dtype without native kernels: bf16 on an AVX2-only CPU, where one 2048^2 matmul takes a minute.
    The bound leaves room for a shared machine."""
    start = time.perf_counter()
    peak, _ = peak_tflops(torch.device("cpu"), mixed_precision)
    cpu_precision_hint(mixed_precision)
    assert peak > 0 and time.perf_counter() - start < 5.0


def test_matmul_probe_keeps_a_budget_far_below_one_slow_matmul():
    start = time.perf_counter()
    tflops = measure_matmul_tflops(torch.device("cpu"), torch.bfloat16, seconds=0.2)
    assert tflops > 0 and time.perf_counter() - start < 2.0


def test_matmuls_at_once_leave_torchs_threads_as_they_were():
    """Each thread of the probe sets its own thread count to one (a new thread's OpenMP team is OMP_NUM_THREADS);
    torch's count is the caller's again afterwards, whatever it was, also when it fails."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        one, together = cpu_matmul_tflops_at_once(torch.float32, 2, n=64, seconds=0.1)
        assert one > 0 and together > 0 and torch.get_num_threads() == 3
        # operands it cannot make (randn of integers) fail in the caller, before any thread starts: nothing hangs
        with pytest.raises(NotImplementedError):
            cpu_matmul_tflops_at_once(torch.int64, 2, n=8, seconds=0.1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("name", "product"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA A10G", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_gpu_product_is_the_exact_one_or_none_for_a_measured_peak(name, product):
    assert gpu_product(name) == product


def test_datasheet_peak_names_the_product_and_the_dtype_it_judges_against():
    assert datasheet_peak("NVIDIA H100 NVL", "bf16") == (835.5, "datasheet H100 NVL dense bf16")
    assert datasheet_peak("NVIDIA L4", "tf32") == (60.0, "datasheet L4 dense tf32 (fp32 matmuls run as TF32)")
    assert datasheet_peak("NVIDIA A100-PCIE-40GB", "fp32") == (19.5, "datasheet A100 dense fp32")
    assert datasheet_peak("NVIDIA GeForce RTX 4090", "bf16") is None  # peak_tflops measures it instead


def test_cuda_fp32_runs_are_judged_as_tf32_only_while_tf32_is_on():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert (cuda_matmul_kind("no"), cuda_matmul_kind("bf16"), cuda_matmul_kind("fp16")) == ("fp32", "bf16", "bf16")
        torch.set_float32_matmul_precision("high")  # what allow_tf32 = True sets
        assert cuda_matmul_kind("no") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_peak_table_variants_differ_where_the_datasheets_do():
    assert PEAK_TFLOPS["L4"]["bf16"] < PEAK_TFLOPS["L40S"]["bf16"] / 2
    assert PEAK_TFLOPS["H100 PCIe"]["bf16"] < PEAK_TFLOPS["H100 NVL"]["bf16"] < PEAK_TFLOPS["H100 SXM"]["bf16"]
    for peaks in PEAK_TFLOPS.values():  # TF32 tensor cores at half the bf16 rate; plain fp32 never above TF32
        assert peaks["tf32"] == pytest.approx(peaks["bf16"] / 2, rel=0.02) and peaks["fp32"] <= peaks["tf32"]


def test_memory_stats_on_cpu_reports_rss():
    stats = memory_stats(torch.device("cpu"))
    assert 0.01 < stats["mem_rss_peak_gib"] < 64


@pytest.mark.parametrize(
    ("precision", "bf16_supported", "warns"),
    [("bf16", False, True), ("bf16", True, False), ("fp16", False, False), ("no", False, False)],
)
def test_gpu_precision_hint_names_the_fp16_yaml_on_a_gpu_without_bf16(precision, bf16_supported, warns):
    hint = gpu_precision_hint(precision, bf16_supported, "Tesla V100-SXM2-16GB")
    assert (hint is not None) == warns
    if warns:
        assert hint.startswith("warning: this GPU (Tesla V100-SXM2-16GB) has no native bf16")
        assert "accelerate_configs/1xgpu_fp16.yaml" in hint and (REPO / "accelerate_configs/1xgpu_fp16.yaml").exists()


def test_a_tracker_unknown_or_not_installed_stops_the_run_before_anything_is_written(tmp_path):
    """accelerate drops such a tracker with a log line that is not shown, and the run would log to metrics.jsonl
    alone: one ConfigError instead, naming the package to install or the trackers there are, before the run folder
    is made."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    missing = [t.value for t in LoggerType if t.value != "all" and t not in get_available_trackers()]
    if not missing:
        pytest.skip("every tracker accelerate knows is installed here")
    run_dir, name = tmp_path / "run", missing[0]
    with pytest.raises(ConfigError, match=rf"--trackers {name}: {name} is not installed here: `pip install "):
        setup(TrainConfig(out_dir=str(run_dir), trackers=f"all, {name}"))
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match=r"--trackers tensorbaord: accelerate has no such tracker; it has all, "):
        check_trackers(["tensorbaord"])
    check_trackers(["all"])  # every tracker installed here, none if none is
