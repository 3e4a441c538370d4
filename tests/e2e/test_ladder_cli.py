"""`python -m bench.ladder` end to end at a tiny size: every rung reported (a number or n/a), results written."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest

from bench.rungs import RUNGS
from modeling.config import REAL_VOCAB_SIZE
from testkit import run

pytestmark = pytest.mark.slow


def test_ladder_smoke_reports_every_rung(prepared_books, tmp_path):
    """The CLI end to end at tiny-cpu, micro-batch 1 (rungs 5-11 autocast to bf16, whose matmuls crawl on an
    AVX2-only CPU: micro-batch 2 made those rows' head matmuls twice as long, ~6 s more CPU): 1 warm-up + 1 timed
    step per row, no batch search (its cap is 1x), so only rungs 8, 9 and 11 compile, with dynamo's eager backend:
    the CLI is what this tests, and inductor's C++ builds of three graphs cost 2 minutes of CPU on a machine
    without a compile cache (CI's; inductor's numerics: tests/modeling, the compiled train step:
    tests/e2e/test_train.py). Peer dir absent: skipped with a message."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "bench.ladder", "--preset", "tiny-cpu", "--device", "cpu", "--micro-batch-size", "1",
        "--warmup", "1", "--steps", "1", "--max-batch-factor", "1", "--peak-tflops", "1", "--dynamo-backend", "eager",
        "--data-dir", str(prepared_books), "--out", str(out), "--peer-dir", str(tmp_path / "no-peer"),
    ]  # fmt: skip
    result = run(cmd)
    assert "peer: skipped (no train_gpt2.py in" in result.stdout

    # The table is printed, then where its files went: one row per rung, each with a tok/s number or n/a.
    table = result.stdout[result.stdout.index("| rung | change |") :]
    rows = {
        line.split("|")[1].strip(): line.split("|")[3].strip() for line in table.splitlines()[2:] if line[:1] == "|"
    }
    assert sorted(rows, key=int) == [str(r.index) for r in RUNGS]
    for rung, tok_s in rows.items():
        assert tok_s == "n/a" or re.fullmatch(r"[\d,]+", tok_s), (rung, tok_s)
    assert {rung for rung, tok_s in rows.items() if tok_s == "n/a"} == {"2", "4", "12"}  # TF32, pinning, DDP

    report = json.loads((out / "ladder.json").read_text())
    assert report["command"].startswith("python -m bench.ladder --preset tiny-cpu")
    assert {"device", "cpu_model", "threads", "torch", "accelerate"} <= report.keys()
    measured = [r for r in report["rows"] if r["status"] == "ok"]
    assert all(r["tok_s"] > 0 and r["step_ms"] > 0 and r["model_tflops"] > 0 and r["mfu"] > 0 for r in measured)
    assert report["measured_bf16_tflops"] is None  # the GPU-only probe behind the >= 55% MFU target
    # all rows train from init
    assert all(math.isclose(r["first_loss"], math.log(REAL_VOCAB_SIZE), abs_tol=0.5) for r in measured)
    assert all(r["compile_s"] is not None for r in measured if int(r["label"]) >= 8)
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "ladder.md").read_text().startswith("| rung | change |")


def test_without_a_cpp_compiler_the_rows_inductor_compiles_are_na_and_the_rest_measured(prepared_books, tmp_path):
    """CXX naming no compiler (a container without build tools): the rows inductor would compile on the CPU (rung 8,
    and rung 11 under cpu.yaml) say why they are not measured, instead of inductor's traceback ending the ladder and
    the rows measured before it; the report is written."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "bench.ladder", "--preset", "tiny-cpu", "--device", "cpu", "--micro-batch-size", "2",
        "--warmup", "1", "--steps", "1", "--rungs", "0,8,11", "--peak-tflops", "1",
        "--data-dir", str(prepared_books), "--out", str(out), "--peer-dir", str(tmp_path / "no-peer"),
    ]  # fmt: skip
    run(cmd, env={**os.environ, "CXX": "/nowhere/g++"})
    rows = {r["label"]: r for r in json.loads((out / "ladder.json").read_text())["rows"]}
    assert rows["0"]["status"] == "ok" and rows["0"]["tok_s"] > 0
    for label in ("8", "11"):
        assert rows[label]["status"] == "n/a", rows[label]
        assert rows[label]["reason"].startswith(
            "torch.compile builds C++ kernels on the CPU, and this machine has no working C++ compiler "
            "(/nowhere/g++): install one"
        )
