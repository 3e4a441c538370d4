"""metrics.jsonl tracker, resumed-run de-duplication, loss plot, peak-FLOPs lookup."""

import json

import torch

from training.metrics import (
    JSONLTracker,
    cpu_precision_hint,
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
    assert measured > 0.001 and source == "measured fp32 matmul"


def test_precision_advice_names_the_faster_cpu_yaml_only_when_clearly_faster():
    # this project's Xeon (AVX-512 bf16, no AMX): bf16 runs at half the fp32 speed
    hint = precision_advice("bf16", {"bf16": 0.16, "no": 0.30})
    assert hint is not None and "accelerate_configs/cpu.yaml" in hint and "1.9x" in hint
    # an AMX or Zen 4 core: bf16 ~4x fp32, so the fp32 cpu.yaml is the slow choice
    hint = precision_advice("no", {"bf16": 0.9, "no": 0.21})
    assert hint is not None and "accelerate_configs/cpu_bf16.yaml" in hint and "4.3x" in hint
    # within measurement noise, or already the faster one: say nothing
    assert precision_advice("no", {"bf16": 0.35, "no": 0.30}) is None
    assert precision_advice("no", {"bf16": 0.16, "no": 0.30}) is None
    assert precision_advice("bf16", {"bf16": 0.9, "no": 0.21}) is None


def test_cpu_precision_hint_measures_the_other_dtype_here():
    assert cpu_precision_hint("fp16", 1.0) is None  # no CPU YAML to suggest
    # measured against an absurdly slow "current" figure, the other dtype is always clearly faster
    assert "accelerate_configs/cpu_bf16.yaml" in cpu_precision_hint("no", 1e-6)
    assert "accelerate_configs/cpu.yaml" in cpu_precision_hint("bf16", 1e-6)


def test_memory_stats_on_cpu_reports_rss():
    stats = memory_stats(torch.device("cpu"))
    assert 0.01 < stats["mem_rss_peak_gib"] < 64
