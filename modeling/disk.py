"""Writes that may meet a full disk: prepared shards, checkpoints, exports, metrics, samples and plots all stop
with one error, DiskFull, whose text is the one line to show:

    disk full while writing <path>: free space on <mount> and run the same command again; <what was kept>

It lives in modeling, the lowest layer, because data preparation, training and exports all write; so does the
cache folder, where data preparation keeps the tokenizer and books, the evals their data and the model its CPU kernel.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How the libraries that do not raise OSError word it: Python's and the C library's text, and safetensors' Rust
# error kind. torch's own writer says only "file write failed": is_disk_full's `need` covers it.
_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "StorageFull")


def cache_dir() -> Path:
    """`$BOOKGPT_CACHE`, else `$XDG_CACHE_HOME/bookgpt`, else `~/.cache/bookgpt` (not created)."""
    if os.environ.get("BOOKGPT_CACHE"):
        return Path(os.environ["BOOKGPT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "bookgpt"


class DiskFull(RuntimeError):
    """A write failed because its filesystem is full; what is already written is complete and kept."""


def _existing(path: str | Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def mount_of(path: str | Path) -> Path:
    """The mount point of the filesystem `path` is (or would be) on."""
    path = _existing(path)
    while not os.path.ismount(path):
        path = path.parent
    return path


def unwritable_folder(path: str | Path) -> Path | None:
    """The folder that keeps `path` (a file or folder to be created, or replaced by a rename) from being written: the
    nearest existing one above it, where a file cannot be made (a read-only disk, another user's folder); None where
    it can. For checks before the work whose result goes there. A real file, gone at once, as the run folder is
    probed (training.checkpoint.ensure_writable): os.access would trust permission bits an NFS server overrides."""
    folder = _existing(Path(path).absolute().parent)
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError:
        return folder


def umask_modes(folder: str | Path) -> None:
    """Give each .safetensors file under `folder` the mode a new file gets from this process's umask (0644 under
    umask 022). safetensors 0.8 writes through a temporary file, created 0600, and renames it into place, so the
    weights of a checkpoint or export were their writer's alone: unreadable to the group of a shared run folder, or
    to the account a server or a container reads them as (safetensors issue #782). POSIX only."""
    if os.name != "posix":
        return
    mode = 0o666 & ~_umask()
    for path in Path(folder).rglob("*.safetensors"):
        path.chmod(mode)


def _umask() -> int:
    """This process's umask: Linux's /proc says it; elsewhere it is set and put back (a file another thread makes in
    between would get 0666)."""
    with suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def cannot_write(path: str | Path) -> str | None:
    """Why `path` cannot be written (unwritable_folder's folder: "F is a file" where a file stands in the way, else
    "F is not writable by this user"), or None where it can."""
    folder = unwritable_folder(path)
    if folder is None:
        return None
    return f"{folder} is a file" if folder.is_file() else f"{folder} is not writable by this user"


def is_disk_full(err: BaseException, path: str | Path, need: int = 0) -> bool:
    """Whether `err`, raised while writing `path`, is a full disk: ENOSPC (or a full quota) in it or in what caused
    it, as an OSError or in the text of another library's error, or fewer than `need` bytes now free there."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS or any(t in str(seen) for t in _FULL_TEXTS):
            return True
        seen = seen.__cause__ or seen.__context__
    return need > 0 and shutil.disk_usage(_existing(path)).free < need


RERUN = "free space on {mount} and run the same command again"


def disk_full_line(path: str | Path, kept: str, todo: str = RERUN) -> str:
    """The one line (without `error: `): what could not be written, what to do (`{mount}` in it: the mount point of
    `path`) and what was kept."""
    return f"disk full while writing {path}: {todo.format(mount=mount_of(path))}; {kept}"


@contextmanager
def disk_full_reported(path: str | Path, kept: str | Callable[[], str]) -> Iterator[None]:
    """Turn a full disk met inside the block while writing `path` into DiskFull (see disk_full_line); `kept` may be
    a function, called only then (what was kept is often known only after the failure)."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as err:
        if not is_disk_full(err, path):
            raise
        raise DiskFull(disk_full_line(path, kept() if callable(kept) else kept)) from err


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temp file + rename so readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cached files are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_bytes(path: str | Path, data: bytes) -> None:
    """Append `data` to `path` whole or not at all: a write the disk cannot take is cut off again, so the file only
    ever holds complete records (JSON rows, samples). Raises the OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def swap_in(tmp: Path, final: Path) -> None:
    """Rename the complete folder tmp to final (checkpoints, exports). A folder already at final (a step saved
    again, a new export) is renamed to FINAL.old first and removed after, so a complete copy exists at every
    instant. A FINAL.old beside a final folder is what a swap killed while removing it left, and goes first; one
    without (a file at final, say) is not ours to delete: the rename onto it fails."""
    stale = final.with_name(final.name + ".old")
    if final.is_dir() and stale.is_dir():  # else every later swap of final would fail on it
        shutil.rmtree(stale)
    if final.exists():
        final.rename(stale)
    tmp.rename(final)
    shutil.rmtree(stale, ignore_errors=True)
