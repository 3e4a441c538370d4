"""Out of memory mid-run, for real: train_accel.py in a process whose address space is capped (RLIMIT_AS) between
what micro-batch 128 and micro-batch 256 need, so the first step's allocation fails at 256 and the step is retried
at 128 with twice the accumulation. The run must equal one started at micro-batch 128, and so must its resume."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from testkit import run, train_cmd
from training.checkpoint import checkpoint_dir
from training.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the address space peak from /proc"),
]

# train_accel.py run as __main__ under an address-space cap (0: none); prints the peak it mapped.
LIMITED = textwrap.dedent("""
    import resource, runpy, sys
    limit = int(sys.argv[1])
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.argv = sys.argv[2:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        peak = next(line for line in open("/proc/self/status") if line.startswith("VmPeak:"))
        print(f"address space peak: {int(peak.split()[1]) * 1024}", file=sys.stderr)
""")
# 16,384 tokens a step; micro-batch 256 x 64 tokens (16,384 rows, over MAX_CHUNKS x CHUNK_ROWS) makes the fused
# loss's logits chunks twice those of 128 (2,048 rows instead of 1,024: ~200 MB more for the logits, as much for
# their gradient). n_embd 16, a quarter of tiny-cpu's: the logits as large, the head's matmuls a quarter (the three
# runs' CPU time ~40% less). Measured: micro-batch 256 peaks 416 MB above 128 (459 MB at n_embd 64; Zen 4,
# 2026-12-06); the cap sits half way.
HEADROOM = 200 * 2**20
ARGS = ["--n-embd", "16", "--total-batch-tokens", "16384", "--max-steps", "2", "--lr", "3e-3", "--warmup-steps", "1",
        "--log-interval", "1", "--eval-interval", "0", "--checkpoint-interval", "1"]  # fmt: skip


# glibc maps every allocation over 64 KiB on its own and unmaps it when freed, so the failed attempt's memory
# leaves the address space (by default its heap could keep it), and one arena for all threads (a new thread's
# arena reserves 64 MiB of address space whenever it first allocates).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}
# Slices of 128 rows summed as halves of micro-batch 256 are micro-batches of 128: the same sums, bit for bit, in
# practice; if the cap was tight enough to halve again (64), the order of the sums differs in the last bits.
TOL = dict(rel=0, abs=2e-6)


def train(run_dir: Path, data_dir: Path, micro_batch: int, limit: int = 0, *args: str) -> tuple[str, int]:
    """(stdout, address space peak) of a capped run to completion."""
    cmd = train_cmd(None, run_dir, data_dir, "--micro-batch-size", str(micro_batch), *ARGS, *args)
    result = run([sys.executable, "-c", LIMITED, str(limit), *cmd[1:]], env={**os.environ, **MALLOC})
    return result.stdout, int(re.search(r"address space peak: (\d+)", result.stderr).group(1))


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train_loss" in r}


def test_out_of_memory_retries_at_half_the_micro_batch_with_the_same_losses(prepared_books, tmp_path):
    _, fits = train(tmp_path / "mb128", prepared_books, 128)
    out, _ = train(tmp_path / "capped", prepared_books, 256, fits + HEADROOM)
    assert "step 1: out of memory at micro-batch 256; retrying at 128 × 2 accumulation (the same 16,384 tokens" in out
    want = losses(tmp_path / "mb128")
    assert losses(tmp_path / "capped") == pytest.approx(want, **TOL)

    # Resumed at step 1 in a fresh capped process: it runs out of memory again, halves again, and continues on the
    # same data position (the loader still counts micro-batches of 256).
    resume = ["--resume", str(checkpoint_dir(tmp_path / "capped", 1))]
    out, _ = train(tmp_path / "resumed", prepared_books, 256, fits + HEADROOM, *resume)
    assert "step 2: out of memory at micro-batch 256; retrying at 128 × 2 accumulation" in out
    # (step 1's row is the capped run's, carried over with the resume from its folder)
    assert losses(tmp_path / "resumed") == pytest.approx({1: want[1], 2: want[2]}, **TOL)
