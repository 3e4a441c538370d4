"""One run per run folder: an OS file lock held by the main process for the life of the run.

The OS drops the lock when the holding process exits by any path (kill -9 included), so there is nothing stale to
clean up; filelock makes it portable (flock on Unix, msvcrt on Windows). Only global rank 0 takes it, so ranks on
other nodes sharing the folder never contend. `.run.lock.json` names the holder for the message a second launch gets.
"""

from __future__ import annotations

import json
import os
import socket
import time
from contextlib import suppress
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_NAME = ".run.lock"
HOLDER_NAME = ".run.lock.json"


class RunFolderInUse(RuntimeError):
    """Another live run holds this run folder."""


def lock_run_folder(run_dir: Path) -> FileLock | None:
    """Lock run_dir for this process's lifetime (keep the returned lock referenced); None on ranks other than 0."""
    if int(os.environ.get("RANK", "0")) != 0:  # set by torchrun for every rank on every node; absent single-process
        return None
    lock = FileLock(run_dir / LOCK_NAME)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RunFolderInUse(
            f"out_dir {run_dir} is in use by another run ({_holder(run_dir)}); wait for it to end or stop it, or "
            "choose another --out-dir (the lock frees itself when that run exits, even if killed)"
        ) from None
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (run_dir / HOLDER_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": since}))
    return lock


def run_in_progress(run_dir: Path) -> str | None:
    """Who holds run_dir's lock (host, pid, start time) while a run trains there; None where none does. A probe: the
    lock is released at once, and a folder without a lock file (or one this process cannot open) gets none."""
    if not (run_dir / LOCK_NAME).is_file():
        return None
    lock = FileLock(run_dir / LOCK_NAME)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return _holder(run_dir)
    except OSError:  # a read-only copy of the run: no run writes there
        return None
    lock.release()
    return None


def _holder(run_dir: Path) -> str:
    try:
        holder = json.loads((run_dir / HOLDER_NAME).read_text())
        return f"host {holder['host']}, pid {holder['pid']}, since {holder['since']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"


def drop_if_unused(run_dir: Path, lock: FileLock | None) -> None:
    """After a start-up that stopped before writing anything: remove run_dir where it holds nothing but this lock's
    files (a folder this launch made, or one empty before it or left by launches that never started: no file of a
    run is in it), so that `ls runs/` lists no run that never was. Removed while still locked, so a launch waiting
    for the folder finds it in use or new, never half gone; a folder holding anything else keeps all of it, and the
    lock too."""
    if lock is None or {p.name for p in run_dir.iterdir()} - {LOCK_NAME, HOLDER_NAME}:
        return
    with suppress(OSError):  # a file another rank just wrote, a mount point: the folder stays as it is
        (run_dir / HOLDER_NAME).unlink(missing_ok=True)
        (run_dir / LOCK_NAME).unlink()
        run_dir.rmdir()
    lock.release()
