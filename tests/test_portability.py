"""Windows: every project module imports, and peak memory is reported, without the POSIX-only standard modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testkit import REPO
from training.metrics import rss_bytes

# Imported in a fresh interpreter in which the project's own code cannot import POSIX-only modules (third-party
# packages still can: on Windows they ship their own fallbacks). Modules are found by walking the packages.
PROBE = r"""
import builtins, pkgutil, importlib, sys
POSIX_ONLY = {"fcntl", "resource", "termios", "pwd", "grp", "posix", "tty", "pty"}
PROJECT = {"modeling", "data_prep", "evals", "training", "bench", "train_accel"}
real_import = builtins.__import__

def guarded(name, globals=None, locals=None, fromlist=(), level=0):
    importer = ((globals or {}).get("__name__") or "").split(".")[0]
    if level == 0 and name.split(".")[0] in POSIX_ONLY and importer in PROJECT:
        raise ModuleNotFoundError(f"No module named {name!r} (hidden: POSIX-only)", name=name)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = guarded
names = ["train_accel"]
for package in sorted(PROJECT - {"train_accel"}):
    names.append(package)
    names += [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")]
for name in names:
    importlib.import_module(name)
from training.metrics import memory_stats, peak_rss_bytes
import torch
memory_stats(torch.device("cpu"))  # the psutil path where `resource` is missing
print(len(names), "modules")
"""


@pytest.mark.slow
def test_every_module_imports_without_posix_only_modules():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-2]) > 30


def test_the_hidden_import_would_be_caught():
    """The probe's guard works: a project module importing fcntl at the top would fail it."""
    code = PROBE.split("builtins.__import__ = guarded")[0] + (
        "builtins.__import__ = guarded\nexec(compile('import fcntl', 'x', 'exec'), {'__name__': 'data_prep.prepare'})\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "hidden: POSIX-only" in result.stderr


@pytest.mark.parametrize(
    ("platform", "expected"), [("linux", 2048 * 1024), ("darwin", 2048), ("freebsd14", 2048 * 1024)]
)
def test_peak_rss_unit_per_platform(platform, expected):
    """ru_maxrss is KiB on Linux and the BSDs, bytes on macOS (reported 1024x too high there before)."""
    assert rss_bytes(2048, platform) == expected
