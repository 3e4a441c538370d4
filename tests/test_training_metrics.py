"""metrics.jsonl tracker, resumed-run de-duplication, loss plot, peak-FLOPs lookup."""

import json

import torch

from training.metrics import JSONLTracker, memory_stats, peak_tflops, plot_losses, read_metrics


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


def test_memory_stats_on_cpu_reports_rss():
    stats = memory_stats(torch.device("cpu"))
    assert 0.01 < stats["mem_rss_peak_gib"] < 64
