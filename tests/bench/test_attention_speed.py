"""bench.attention_speed: both attention forms timed at the model's layout, eager and compiled, each held against
fp64, and the report written as it is printed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.attention_speed import FORMS, MODES, main


def test_every_form_is_timed_alone_and_in_the_step(prepared_books: Path, tmp_path: Path, capsys):
    """One round at tiny-cpu's shape in bf16 (cpu_bf16.yaml's precision): a row per form and mode, flash the unit of
    the ratios, the whole matmuls within flash's error against fp64 (the CPU attention's contract,
    tests/modeling/test_cpu_attention.py); then rung 11's step with each form in a process of its own (the form
    forced there; eager to keep it short), which build the same model and batch: their first losses agree to bf16's
    rounding. The tables printed are the ones saved."""
    main(["--preset", "tiny-cpu", "--micro-batch-size", "2", "--rounds", "1", "--warmup", "1", "--steps", "2",
          "--step-rounds", "1", "--step-steps", "1", "--dynamo-backend", "eager", "--data-dir", str(prepared_books),
          "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "attention_speed.json").read_text())
    rows = report["rows"]
    assert [(r["form"], r["mode"]) for r in rows] == [(form, mode) for mode in MODES for form in FORMS]
    for r in rows:
        flash = next(f for f in rows if f["form"] == "flash" and f["mode"] == r["mode"])
        assert r["seq_len"] == 64 and r["model_takes"] == "whole matmuls"  # tiny-cpu's block_size, under MAX_T
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0
        assert r["vs_flash_min"] == r["vs_flash_max"] == r["total_ms"] / flash["total_ms"]
        assert 0 < r["out_error"] <= 1.1 * flash["out_error"] and 0 < r["grad_error"] <= 1.1 * flash["grad_error"]
        assert r["out_error"] < 1e-2  # bf16 inputs: a few ulps of bf16, not a wrong function
    (step,) = report["steps"]
    assert step["seq_len"] == 64 and step["ratio"] == step["whole_ms"] / step["flash_ms"]
    assert step["whole_first_loss"] == pytest.approx(step["flash_first_loss"], abs=2e-3)  # unseeded inits: ~0.03 apart
    assert step["whole_first_loss"] == pytest.approx(math.log(50_257), abs=0.5)  # an untrained model's loss
    table = (tmp_path / "attention_speed.md").read_text()
    assert "| T | step round | whole matmuls ms | flash ms |" in table
    assert capsys.readouterr().out.endswith(table)
    assert (tmp_path / "attention_speed.png").read_bytes().startswith(b"\x89PNG")
