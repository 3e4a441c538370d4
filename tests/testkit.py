"""What the tests share besides fixtures: the repo's paths, the one way to launch train_accel.py, a checked run.

Importable from any test folder (`pythonpath = ["tests"]` in pyproject); fixtures live in conftest.py.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO

import pytest
import torch
import yaml
from safetensors.torch import save_model
from warm_exec import ask
from warm_launch import COMPILE_READY, package_of

from modeling.config import GPTConfig, get_preset
from modeling.gpt import GPT
from training.config import TrainConfig, config_to_yaml

REPO = Path(__file__).resolve().parents[1]
TRAIN_ACCEL = REPO / "train_accel.py"
# The product's layers, lowest first: a module imports only from its own layer or lower (test_layers.py).
LAYERS = {"modeling": 0, "data_prep": 1, "evals": 2, "training": 3, "bench": 4, "train_accel": 4}


def product_modules() -> list[Path]:
    """train_accel.py and every module of the product's packages: what the code-health tests read (not tests/)."""
    return [TRAIN_ACCEL] + [p for layer in LAYERS for p in sorted((REPO / layer).rglob("*.py"))]


# `accelerate launch` run as its module: the same launch_command as the `accelerate` CLI, which first imports every
# other subcommand (transformers among them: 1.4 s a launch, ~40 launches in the suite). `make train` keeps the CLI.
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]
TRAINING_LAUNCH = [sys.executable, "-m", "training.launch"]  # accelerate's launch without its tracebacks
# Why a test that reads books is skipped where `datasets` is missing: the GPU images the first-light script runs the
# unit tests on (scripts/gpu_first_light.sh, step cpu) have none; the project's install always has it
NO_DATASETS = "the books are read through the datasets pipeline, and this environment has no datasets package"

# For tests that count page faults, in 4 KB pages: torch's big CPU blocks otherwise ask for 2 MB pages
# (modeling.malloc), one fault for 512 of them, which would hide a step that maps its buffers afresh.
SMALL_PAGES = {"THP_MEM_ALLOC_ENABLE": "0"}

# Quiet, fast launches: no MFU matmul probe, no samples, no loader workers, no export unless a test asks for one
# (a test's own flags come later on the command line, and the last one wins).
QUIET = ["--peak-tflops", "1", "--sample-interval", "0", "--num-workers", "0", "--export-hf", "false"]


def train_cmd(
    accelerate_config: str | None, run_dir: Path, data_dir: Path, *args: str, launch_args: Sequence[str] = ()
) -> list[str]:
    """train_accel.py on the tiny-cpu preset with QUIET flags, through the real `accelerate launch` with
    accelerate_configs/<accelerate_config>, or run directly as one process when that is None."""
    launcher = [sys.executable]
    if accelerate_config:
        config = REPO / "accelerate_configs" / accelerate_config
        launcher = [*ACCELERATE_LAUNCH, "--config_file", str(config), *launch_args]
    return [*launcher, str(TRAIN_ACCEL), "--preset", "tiny-cpu", *QUIET,
            "--data-dir", str(data_dir), "--out-dir", str(run_dir), *args]  # fmt: skip


def through_training_launch(cmd: list[str]) -> list[str]:
    """An `accelerate launch` command (train_cmd's) run by `python -m training.launch`, which takes the same
    arguments: accelerate's launch without its tracebacks, as the README's cluster commands launch."""
    assert cmd[: len(ACCELERATE_LAUNCH)] == ACCELERATE_LAUNCH, cmd
    return [*TRAINING_LAUNCH, *cmd[len(ACCELERATE_LAUNCH) :]]


def fsdp_yaml(folder: Path, **answers: object) -> Path:
    """accelerate_configs/cpu_fsdp2.yaml with some fsdp_config answers changed (None: left out), as `accelerate
    config` may write them, saved in `folder`."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "cpu_fsdp2.yaml").read_text())
    for key, value in answers.items():
        if value is None:
            del config["fsdp_config"][key]
        else:
            config["fsdp_config"][key] = value
    path = folder / "my_fsdp.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(
    cmd: list[str],
    expect_rc: int = 0,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    warm: WarmLaunches | None = None,
    output: IO[bytes] | None = None,
) -> subprocess.CompletedProcess:
    """Run `cmd` from the repo root to completion; assert its exit status, showing the command and its output.
    `python train_accel.py ...` runs in a warm copy (WarmLaunches), and so do an `accelerate launch` and its ranks.
    warm: the server of another script (default WARM, train_accel.py's), or of a package's `python -m PACKAGE`.
    output: one file for the command's stdout and stderr both, as a job's log takes them (the result's are empty)."""
    server = warm or WARM
    if cmd[:3] in (ACCELERATE_LAUNCH, TRAINING_LAUNCH):
        env = server.for_ranks(env or os.environ)
    package = [sys.executable, "-m", package_of(server.script)]
    launched = cmd[:2] == [sys.executable, str(server.script)] or cmd[:3] in (ACCELERATE_LAUNCH, package)
    result = server.run(cmd, env or os.environ, timeout, output) if launched else None
    if result is None:
        into = {"capture_output": True} if output is None else {"stdout": output, "stderr": subprocess.STDOUT}
        result = subprocess.run(cmd, cwd=REPO, env=env, text=True, timeout=timeout, **into)
        result.stdout, result.stderr = result.stdout or "", result.stderr or ""
    assert result.returncode == expect_rc, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


class WarmLaunches:
    """train_accel.py's launches to completion, each in a fork of a server that has done its imports (warm_launch.py):
    the same code, arguments, environment and working folder as `python train_accel.py ...`, its own process, exit
    status and output, without the ~3-7 s a fresh interpreter spends importing torch, accelerate and dynamo. An
    `accelerate launch` run to completion likewise, and the runs it starts: torchrun's ranks and its one-process
    launcher's run start warm_exec.py (PYTHON_EXEC), which asks the server and passes the signals it gets on to the
    copy (tests/e2e/test_resume.py's signal and kill tests start their runs so). Fresh interpreters: runs that need
    what a copy lacks (an ignored signal inherited, a PID namespace), the other entry points (python -m
    training.launch's ranks run warm) and whatever the server finds its imports could tell apart (another
    environment)."""

    def __init__(
        self,
        script: Path = TRAIN_ACCEL,
        env: Mapping[str, str] | None = None,
        modules: Sequence[str] = (),
        compile_ready: bool = False,
    ) -> None:
        """script: what the server imports and runs (another test script's launches, or a package's __main__.py for
        `python -m PACKAGE`'s; `accelerate launch` too); env:
        the environment its launches have (default: this process's), which the server's imports must see; modules:
        also served as `python -m MODULE` run from the repo, in copies of the same server (script's imports);
        compile_ready: the server picks inductor's CPU vector ISA once, not each compiling copy (warm_launch.py's
        set_up_cpu_compiles)."""
        self.script, self.env = script, env
        self.options = [*([COMPILE_READY] if compile_ready else []), *modules]
        self.lock = threading.Lock()
        self.folder: Path | None = None

    def start(self) -> None:
        with self.lock:
            if self.folder is not None:
                return
            # the server's own output (one line per request), shown if it ends; the folder goes when the test
            # process exits
            self.folder_handle = tempfile.TemporaryDirectory(prefix="warm_launch-")
            folder = Path(self.folder_handle.name)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(str(folder / "socket"))
            listener.listen(16)
            self.control, theirs = socket.socketpair()
            self.python = folder / "python"  # PYTHON_EXEC for the ranks
            client = REPO / "tests" / "warm_exec.py"
            self.python.write_text(f"#!/bin/sh\nexec '{sys.executable}' -S '{client}' \"$@\"\n")
            self.python.chmod(0o755)
            self.log = folder / "warm_launch.log"
            fds = [listener.fileno(), theirs.fileno()]
            server = [sys.executable, str(REPO / "tests" / "warm_launch.py"), str(self.script), *map(str, fds),
                      *self.options]  # fmt: skip
            # os.environ, not the C library's environment, which GNU readline's start in pytest gave COLUMNS and LINES
            env = dict(os.environ if self.env is None else self.env)
            with self.log.open("a") as log:
                subprocess.Popen(server, cwd=REPO, env=env, pass_fds=fds, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=log)  # fmt: skip
            listener.close()  # the server's alone: a connection to a server that has ended is refused
            theirs.close()
            self.folder = folder

    def forks(self) -> list[str]:
        """The server log's line for each copy it has made, `forked PID: ARGS`, oldest first."""
        self.start()
        return [line for line in self.log.read_text().splitlines() if line.startswith("forked ")]

    def forked(self) -> int:
        """Copies the server has made."""
        return len(self.forks())

    @contextmanager
    def forking(self, copies: int) -> Iterator[None]:
        """A block whose launches the server answers with exactly `copies` copies (no fresh interpreter among them,
        nothing else served meanwhile), checked as the block ends without an error."""
        before = self.forked()
        yield
        made = self.forked() - before
        assert made == copies, f"{made} warm copies, not {copies}:\n{self.log.read_text()[-3000:]}"

    def last_forked(self) -> int:
        """The pid of the copy the server made last."""
        return int(self.forks()[-1].split()[1].rstrip(":"))

    def for_ranks(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of an `accelerate launch` whose ranks are to run warm."""
        self.start()
        return {**env, "PYTHON_EXEC": str(self.python), "WARM_LAUNCH_SOCKET": str(self.folder / "socket")}

    def run(
        self,
        cmd: list[str],
        env: Mapping[str, str],
        timeout: float,
        output: IO[bytes] | None = None,
        cwd: Path = REPO,
    ) -> subprocess.CompletedProcess | None:
        """The finished launch, or None where it must start fresh (the server's imports saw another environment).
        output: one file for the copy's stdout and stderr both (the result's are then empty); cwd: its working
        folder (a machine's own, tests/e2e/test_sharded.py's two-machine launches)."""
        self.start()
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock,
            open(os.devnull) as stdin,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
        ):
            stdio = [stdin.fileno(), *([out.fileno(), err.fileno()] if output is None else [output.fileno()] * 2)]
            answer = ask(sock, str(self.folder / "socket"), cmd[1:], str(cwd), env, stdio)
            if not answer:
                raise self.ended()
            if answer == b"fresh":
                return None
            pid = int(answer)
            sock.settimeout(timeout)
            try:
                status = sock.recv(64)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            if not status:
                raise self.ended()
            return subprocess.CompletedProcess(cmd, int(status), as_text(out), as_text(err))

    def ended(self) -> RuntimeError:
        return RuntimeError(f"the warm launch server ended:\n{self.log.read_text()[-5000:]}")

    def __enter__(self) -> WarmLaunches:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the server (closing CONTROL_FD) and remove its folder; WARM's lasts as long as the test process. A
        `with WarmLaunches(...) as warm:` block stops its server at the end."""
        with self.lock:
            if self.folder is not None:
                self.control.close()
                self.folder_handle.cleanup()
                self.folder = None


def as_text(output: IO[bytes]) -> str:
    """A process's output file as subprocess.run(text=True) decodes it (universal newlines)."""
    output.seek(0)
    return output.read().decode().replace("\r\n", "\n").replace("\r", "\n")


# compile-ready: the ISA pick every compiling run makes first is made once, in the server (~1.2-1.8 s of CPU a copy)
WARM = WarmLaunches(compile_ready=True)


def launch(accelerate_config: str | None, run_dir: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """Train to completion (exit status 0) as train_cmd builds the command; the finished process."""
    return run(train_cmd(accelerate_config, run_dir, data_dir, *args))


def make_train_recipe(args: str = "", yaml: str | None = None) -> str:
    """The shell command `make train ARGS="args"` runs (it picks the YAML first), with this venv; flags appended to
    it win. yaml: launch accelerate_configs/<yaml> instead of the YAML it picks (e.g. an eager one, for a test about
    something other than the compile)."""
    venv = Path(sys.executable).parent.parent
    # Under `make test` this make is a sub-make, which prints "make[1]: Entering directory" unless told not to.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    make = ["make", "-n", "--no-print-directory", "-o", "install", "train", f"VENV={venv}", f"ARGS={args}"]
    recipe = subprocess.run(make, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()
    return recipe if yaml is None else launching(yaml, recipe)


def launching(yaml: str, recipe: str) -> str:
    """`make train`'s recipe (as make prints it, or the Makefile's text) set to launch accelerate_configs/<yaml>
    without picking one: training.pick_cpu_config's matmul probe (~4 s of CPU) left out, the rest as it is."""
    pick = re.compile(r"yaml=\$\$?\([^\n]*? -m training\.pick_cpu_config\)")
    assert len(pick.findall(recipe)) == 1, recipe
    return pick.sub(lambda _: f"yaml={shlex.quote(str(REPO / 'accelerate_configs' / yaml))}", recipe)


def run_in_terminal(
    cmd: list[str], columns: int, timeout: float = 300, interrupt: Callable[[], bool] | None = None
) -> tuple[int, str]:
    """Run `cmd` with a terminal of `columns` columns as its stdin, stdout and stderr, as a user's shell runs it;
    (exit status, what it drew on the terminal). interrupt: once it holds, Ctrl-C, which a terminal sends to its
    foreground job's whole process group as SIGINT."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=child, stdout=child, stderr=child, start_new_session=True)
    os.close(child)
    screen, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([main], [], [], 1)[0]:
                try:
                    chunk = os.read(main, 1 << 16)
                except OSError:  # EIO: every process holding the terminal has closed it
                    break
                if not chunk:
                    break
                screen += chunk
            if interrupt is not None and interrupt():
                os.killpg(proc.pid, signal.SIGINT)
                interrupt = None
        else:
            proc.kill()
            raise subprocess.TimeoutExpired(cmd, timeout, screen)
        return proc.wait(timeout=60), screen.decode(errors="replace")
    finally:
        os.close(main)
        with suppress(ProcessLookupError):  # an orphaned process stays in the group
            os.killpg(proc.pid, signal.SIGKILL)


def rendered(screen: str, columns: int) -> list[str]:
    """The lines a terminal of `columns` columns shows for `screen` (run_in_terminal's): carriage returns move to the
    line's start, a line longer than the terminal wraps. Enough for tqdm's bars and printed lines."""
    lines: list[list[str]] = [[]]
    col = 0  # the cursor: on the last line, which it only leaves downwards
    for ch in screen:
        if ch == "\r":
            col = 0
            continue
        if ch == "\n" or col == columns:
            lines.append([])
            col = 0
            if ch == "\n":
                continue
        line = lines[-1]
        if col < len(line):
            line[col] = ch
        else:
            line.append(ch)
        col += 1
    return ["".join(line).rstrip() for line in lines]


def _unshare_pid_permitted() -> bool:
    try:
        unshare = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
        return unshare.returncode == 0
    except OSError:  # no unshare (macOS)
        return False


# A command as PID 1 of a new PID namespace, as in a container: `unshare --pid` (root, or user namespaces allowed)
NEEDS_UNSHARE_PID = pytest.mark.skipif(not _unshare_pid_permitted(), reason="needs `unshare --pid --fork`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def whoami(
    name: str = "you",
    role: str = "write",
    orgs: Mapping[str, str] | Sequence[str] = (),
    scoped: Mapping[str, Sequence[str]] | None = None,
) -> dict:
    """The Hub's /api/whoami-v2 answer for a user's access token (as huggingface.co gives it, trimmed): `orgs` the
    user's organizations (names, or name -> the user's role in it, default write); `scoped` makes it a fine-grained
    token, with the permissions it holds per user, organization or repository ("you/x") name."""
    org_roles = orgs if isinstance(orgs, Mapping) else dict.fromkeys(orgs, "write")
    access: dict = {"displayName": "ci", "role": role}
    if scoped is not None:
        kind = {name: "user", **{org: "org" for org in org_roles}}
        access["role"] = "fineGrained"
        access["fineGrained"] = {
            "canReadGatedRepos": True, "global": ["discussion.write", "post.write"],
            "scoped": [
                {"entity": {"_id": str(i), "type": kind.get(e, "model"), "name": e}, "permissions": list(permissions)}
                for i, (e, permissions) in enumerate(scoped.items())
            ],
        }  # fmt: skip
    return {
        "type": "user", "name": name,
        "orgs": [{"type": "org", "name": org, "roleInOrg": r} for org, r in org_roles.items()],
        "auth": {"type": "access_token", "accessToken": access},
    }  # fmt: skip


@contextmanager
def hub_endpoint(status: int = 200, answer: dict | None = None) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A local HTTP server standing in for huggingface.co's whoami (HF_ENDPOINT, or huggingface_hub's
    constants.ENDPOINT in-process), answering `status` and `answer` (default: whoami()): its URL, and the headers of
    each whoami request it gets."""
    body = json.dumps(answer if answer is not None else whoami()).encode()
    requests: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/api/whoami-v2"  # anything else huggingface_hub asks for is not found
            if found:
                requests.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(status if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # no request lines on the test's stderr
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


# The in-process compiled model tests (tests/modeling: compiled == eager, a recompile served from the cache,
# activation checkpointing compiled) compile this model on this batch: the first two one inductor graph, so on an
# empty compile cache the second is served the first one's C++ kernels (~23 builds, 17-40 s) instead of building its
# own. 80 x 16 = 1,280 rows: two loss chunks (CHUNK_ROWS 1,024 + a ragged 256); a small head keeps the eager twin cheap.
COMPILED_TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=512)


def compiled_tiny_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(idx, targets) for COMPILED_TINY, three targets ignored."""
    shape = (80, COMPILED_TINY.block_size)
    idx = torch.randint(0, COMPILED_TINY.vocab_size, shape, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, COMPILED_TINY.vocab_size, shape, generator=torch.Generator().manual_seed(1))
    targets[0, :3] = -100
    return idx, targets


# Eval run folders (tests/evals, tests/e2e): tiny-cpu at the block_size that new_run's config.yaml gives it.
TINY_MODEL = dataclasses.replace(get_preset("tiny-cpu"), block_size=32)


def distinct_gpt(config: GPTConfig) -> GPT:
    """A GPT of this shape in eval mode whose LayerNorms and biases are non-trivial, so a mis-mapped one would show
    in a conversion test."""
    torch.manual_seed(0)
    gpt = GPT(config).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return gpt


def write_checkpoint(model: torch.nn.Module, folder: Path) -> None:
    """model.safetensors as accelerator.save_state writes it: the tied head/embedding stored once."""
    folder.mkdir(parents=True)
    save_model(model, str(folder / "model.safetensors"))


def new_run(root: Path, preset: str = "tiny-cpu") -> Path:
    """A run folder holding only the config.yaml of a block_size-32 run of `preset`."""
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config_to_yaml(TrainConfig(preset=preset, block_size=32, out_dir=str(run))))
    return run


# A local copy of the Hub dataset emozilla/pg19 (PG-19 as parquet): its file layout and exact schema, 8 small books.
PG19_FILES = {
    "train-00000-of-00002-2b13c68dbeba63b5.parquet": [1342, 11, 1661],
    "train-00001-of-00002-54b567998cd5eb4b.parquet": [98, 2701],
    "validation-00000-of-00001-1ea3d3e1c7d9a28c.parquet": [84],
    "test-00000-of-00001-29a571947c0b5ccc.parquet": [74, 345],
}


def pg19_book(number: int) -> str:
    lines = [f"CHAPTER {i}.\r\n\r\nBook {number}, line {i}: “ünïcödé”, tabs\tand   runs of spaces." for i in range(40)]
    return "\n".join(lines) + "\n\n\n\n\nThe End.\n"


def write_pg19_copy(root: Path) -> Path:
    """root/data/{split}-NNNNN-of-NNNNN-{hash}.parquet as the Hub repository lays them out (its train has 23
    files), columns short_book_title, publication_date (int32), url, text; several row groups a file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [("short_book_title", pa.string()), ("publication_date", pa.int32()), ("url", pa.string()),
         ("text", pa.string())]
    )  # fmt: skip
    (root / "data").mkdir(parents=True)
    for name, numbers in PG19_FILES.items():
        columns = {
            "short_book_title": [f"Title of {n}" for n in numbers],
            "publication_date": [1800 + n % 100 for n in numbers],
            "url": [f"http://www.gutenberg.org/ebooks/{n}" for n in numbers],
            "text": [pg19_book(n) for n in numbers],
        }
        pq.write_table(pa.table(columns, schema=schema), root / "data" / name, row_group_size=2)
    return root


def fill_disk(disk: Path, leave: int = 0) -> Path:
    """Fill the filesystem of `disk` with one file until about `leave` bytes are free (it counts whole pages), or
    until it is full; returns the file (unlink it to make room again)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        left = shutil.disk_usage(disk).free - leave
        while left > 0:
            left -= os.write(fd, b"\0" * min(left, 1 << 20))
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return filler


# in the name of each of inductor's ISA probe functions (torch._inductor.cpu_vec_isa: "__avx512_chk_kernel", ...)
PROBE_MARK = "_chk_kernel"


def copy_isa_probes(base: Path, to: Path) -> None:
    """Copy inductor's ISA probe programs from the compile cache folder `base` into `to`. Inductor builds them in the
    folder it compiles in, once per folder (~10 C++ builds, 10-20 s on 2 cores): a process compiling in `to` then
    builds none. Only they are copied (each `*_chk_kernel` source and the library built from it): `base` is the
    user's torch.compile cache, which may hold anything else they compiled, besides this project's ISA subfolders."""
    to.mkdir(parents=True, exist_ok=True)  # made even where `base` has no probes (one that never compiled)
    for source in base.glob("*/*.cpp"):
        if PROBE_MARK in source.read_text(errors="replace"):
            (to / source.parent.name).mkdir(parents=True, exist_ok=True)
            for built in source.parent.glob(f"{source.stem}.*"):
                shutil.copy2(built, to / source.parent.name / built.name)
