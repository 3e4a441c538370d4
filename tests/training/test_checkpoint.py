"""Run-folder checks that every rank does at once."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from training.checkpoint import ensure_writable

pytestmark = pytest.mark.slow  # spawns worker processes


def probe_together(run_dir: Path, barrier: Any, seconds: float) -> None:
    barrier.wait()  # every worker has started (imports take seconds on a busy machine), so the probes overlap
    stop = time.time() + seconds
    while time.time() < stop:
        ensure_writable(run_dir)


def test_ranks_probing_one_run_folder_at_once_do_not_trip_over_each_other(tmp_path):
    """All DDP ranks call ensure_writable on the same --out-dir at start-up: a shared probe file name let one rank
    delete the file another was about to delete ('not writable (No such file or directory)')."""
    run_dir = tmp_path / "run"
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(3) as pool:
        pool.starmap(probe_together, [(run_dir, manager.Barrier(3), 1.0)] * 3)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # no probe left behind
