"""Run-folder checks that every rank does at once."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from training.checkpoint import ensure_writable


def probe_until(run_dir: Path, start: float, stop: float) -> None:
    time.sleep(max(0.0, start - time.time()))
    while time.time() < stop:
        ensure_writable(run_dir)


def test_ranks_probing_one_run_folder_at_once_do_not_trip_over_each_other(tmp_path):
    """All DDP ranks call ensure_writable on the same --out-dir at start-up: a shared probe file name let one rank
    delete the file another was about to delete ('not writable (No such file or directory)')."""
    run_dir = tmp_path / "run"
    start = time.time() + 3  # past the spawned workers' start-up, so they overlap
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        pool.starmap(probe_until, [(run_dir, start, start + 1.0)] * 3)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []  # no probe left behind
