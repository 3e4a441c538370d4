"""`python warm_launch.py SCRIPT LISTENER_FD CONTROL_FD`: import what SCRIPT imports, then fork a copy of this process
to run SCRIPT as `python [-u] SCRIPT ARGS` would, once per request: testkit.run's launches of train_accel.py and of
`accelerate launch` (as `python -m accelerate.commands.launch`), and the runs that launcher starts (torchrun's ranks
and its one-process launcher's run start warm_exec.py, which asks here), without the ~2-7 s a fresh interpreter spends
importing torch, accelerate and dynamo. SCRIPT may be a package's __main__.py (evals/__main__.py): the server then
runs `python [-u] -m PACKAGE ARGS` (`python -m evals`) from the folder holding the package. MODULE... after CONTROL_FD:
each also served, as `python [-u] -m MODULE ARGS` (`python -m bench.ladder`) run from SCRIPT's folder, whose imports
are most of a module's own (torch, accelerate, dynamo). With --compile-ready first among them, the server also sets up
the CPU compile cache as a compiling run does first (set_up_cpu_compiles).

Each copy starts from the same state, the imports done and nothing run, so a launch sees what a fresh process sees
by the time its script's first line after the imports runs. A request is a connection to the listening socket
(AF_UNIX, SOCK_SEQPACKET): a JSON {"args", "cwd", "env"} (args: the interpreter's, flags first) with the copy's
stdin, stdout and stderr as passed fds. One the imports could tell apart (another script or module, a flag other
than -u, an environment that differs in a variable a launcher does not set, a client pinned to other CPUs: taskset) is
answered "fresh": its client starts a fresh interpreter. Otherwise a keeper process forks the copy, answers its pid,
passes on each signal number the client sends, kills the copy when the client goes away (killed, as torchrun's own
death would leave it), and answers the copy's exit status as subprocess gives it (-N: killed by signal N). The server
ends when testkit closes CONTROL_FD.
"""

from __future__ import annotations

import ast
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

# Imported by the script on its way rather than at its top: the optimizer's first parameter group imports dynamo
# (2.7 s), the end of a run plots loss.png.
LATER_IMPORTS = ("torch._dynamo", "matplotlib.pyplot")
# Variables a process sets for itself once, not a test: pytest's own (the phase it is in, the test running),
# DS_ACCELERATOR (set by modeling.device.quiet_deepspeed before DeepSpeed loads) and PYTORCH_NVML_BASED_CUDA_CHECK
# (DeepSpeed's import sets it); so are a library's private ones (inductor's _TORCHINDUCTOR_*, for its compile workers,
# set by the first compile). conftest's environment_kept lets them change; the server need not have seen them, since
# its imports read none of them and each copy takes its request's whole environment.
PROCESS_SET_UP = {"PYTEST_CURRENT_TEST", "DS_ACCELERATOR", "PYTORCH_NVML_BASED_CUDA_CHECK"}
# What `accelerate launch` and torchrun give each rank, read when the run sets up, not by the imports; the two that
# route ranks here; and PWD, which the ranks' /bin/sh wrapper (PYTHON_EXEC) sets to their working folder, the
# request's cwd, which the copy moves to.
LAUNCHER_SET = {
    "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK",
    "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "WORLD_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC",
    "WARM_LAUNCH_SOCKET", "PWD",
}  # fmt: skip
# Read by NCCL when a run starts its process group, never by the imports (gloo reads none): the first-light script's
# nccl step sets NCCL_DEBUG for its launches
AT_PROCESS_GROUP = {"NCCL_DEBUG"}
# torch's log settings, read by its import (torch._logging._init_logs), which a copy calls again where the request's
# differ (as torch's own tests do): the first-light script's train step sets TORCH_LOGS=recompiles,graph_breaks
LOGS = "TORCH_LOGS"
# torchrun's OMP_NUM_THREADS=1 for 2+ ranks where it is unset (a pytest run without workers): read when OpenMP loads,
# with the imports, but a copy sets it as it would have been (torch.set_num_threads: OpenMP's and MKL's)
THREADS = "OMP_NUM_THREADS"
BEFORE_THE_IMPORTS = dict(os.environ)  # what the server's imports saw
# The launcher testkit.run starts, run as `python -m MODULE` (not training.launch: it quiets libtorch's C++ logs before
# torch loads, which a copy cannot)
MODULES = ("accelerate.commands.launch",)
LAUNCHER_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_")
COMPILE_READY = "--compile-ready"  # the option, first after CONTROL_FD, for set_up_cpu_compiles before serving


def set_up_cpu_compiles() -> None:
    """What a run compiling on the CPU does first (training.compile_cache.set_up_compile_cache), done once here
    rather than in each copy: inductor picks its vector ISA once per process, loading each ISA's probe library in a
    fresh interpreter of its own (~1.4 s of CPU a compiling process). The same pick, from the same environment (a
    request with another is answered fresh); its TORCHINDUCTOR_CACHE_DIR is the request's again in the copy."""
    import torch

    from training.compile_cache import set_up_compile_cache

    set_up_compile_cache(torch.device("cpu"))


def set_up_by_the_process(name: str) -> bool:
    return name in PROCESS_SET_UP or name.startswith("_")


def package_of(script: Path) -> str | None:
    """The package `python -m` runs where SCRIPT is its __main__.py (evals/__main__.py: evals), else None."""
    return script.parent.name if script.name == "__main__.py" else None


def home(script: Path) -> Path:
    """The folder first on sys.path: the script's, or for `python -m PACKAGE` the working folder, which holds it."""
    return script.parent.parent if package_of(script) else script.parent


def unread_by_the_imports(name: str) -> bool:
    return (
        set_up_by_the_process(name)
        or name in LAUNCHER_SET | AT_PROCESS_GROUP
        or name.startswith(LAUNCHER_PREFIXES)
        or intel_omp(name)
    )


def intel_omp(name: str) -> bool:
    """accelerate's one-process CPU launcher sets Intel OpenMP's KMP_AFFINITY and KMP_BLOCKTIME, which a torch on GNU
    OpenMP (the pip wheels': libgomp, MKL linked to it) never reads."""
    import torch

    return name.startswith("KMP_") and not any((Path(torch.__file__).parent / "lib").glob("libiomp*"))


def adds_only(folder: Path, before: str | None, after: str | None) -> bool:
    """Whether PYTHONPATH `after` is `before` with entries naming `folder` added: the script's home, first on a
    fresh interpreter's sys.path anyway, so every import finds what it found. DeepSpeed's launch puts the working
    folder (the repo) on its ranks' PYTHONPATH, and so do tests that run the project's modules from source."""
    kept = before.split(os.pathsep) if before else []
    entries = after.split(os.pathsep) if after else []
    added = [p for p in entries if p not in kept]
    return [p for p in entries if p in kept] == kept and all(Path(p).resolve() == folder for p in added)


def import_what_it_imports(script: Path) -> None:
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            importlib.import_module(node.module)
    for name in LATER_IMPORTS:
        importlib.import_module(name)


def why_fresh(script: Path, request: dict, modules: Sequence[str] = ()) -> str:
    """What a fresh interpreter would see differently from a copy of this one ('' if nothing). modules: those served
    as `python -m MODULE` besides MODULES and SCRIPT's package."""
    args = request["args"]
    run = args[1:] if args[:1] == ["-u"] else args  # the script or module, its arguments
    if run[:1] == ["-m"]:
        if len(run) < 2 or run[1] not in (*MODULES, package_of(script), *modules):
            return f"another module, {run[1:2]}"
        if (package_of(script) or run[1] in modules) and Path(request["cwd"]).resolve() != home(script):
            return f"another working folder, {request['cwd']}"  # first on a fresh interpreter's sys.path
    elif not run or run[0].startswith("-"):
        return f"interpreter arguments {args[:3]}"
    elif (Path(request["cwd"]) / run[0]).resolve() != script:
        return f"another script, {run[0]}"
    # a client pinned to other CPUs (taskset): a fresh interpreter would run on those, a copy runs on the server's
    if "cpus" in request and set(request["cpus"]) != os.sched_getaffinity(0):
        return f"CPUs {sorted(os.sched_getaffinity(0))} -> {sorted(request['cpus'])}"
    env, before = request["env"], BEFORE_THE_IMPORTS
    changed = sorted(k for k in env.keys() | before.keys() if env.get(k) != before.get(k))
    changed = [
        k
        for k in changed
        if not unread_by_the_imports(k) and not (k == THREADS and env.get(k, "").isdigit()) and k != LOGS
    ]
    if "PYTHONPATH" in changed and adds_only(home(script), before.get("PYTHONPATH"), env.get("PYTHONPATH")):
        changed.remove("PYTHONPATH")
    return ", ".join(f"{k}: {before.get(k)!r} -> {env.get(k)!r}" for k in changed)


def serve(script: Path, listener: socket.socket, control: socket.socket, modules: Sequence[str] = ()) -> dict:
    """Answer requests until CONTROL closes (then exit); returns a request in the copy made for it, its stdio
    already on the request's files. modules: also served as `python -m MODULE` (why_fresh)."""
    while True:
        ready, _, _ = select.select([listener, control], [], [])
        with suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # keepers that are done
                pass
        if control in ready:
            sys.exit(0)
        conn, _ = listener.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            control.close()
            return keep(script, conn, modules)
        conn.close()


def keep(script: Path, conn: socket.socket, modules: Sequence[str]) -> dict:
    """The keeper of one request: returns it in the copy; itself exits when the copy has."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    request["cpus"] = sorted(os.sched_getaffinity(client_pid(conn)))
    reason = why_fresh(script, request, modules)
    if reason:
        log_line(f"fresh: {reason}")
        conn.send(b"fresh")
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    log_line(f"forked {pid}: {' '.join(request['args'])[:200]}")
    conn.send(str(pid).encode())
    copy = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, copy], [], [])
        if copy in ready:
            _, status = os.waitpid(pid, 0)
            with suppress(OSError):  # the client may have gone first
                conn.send(str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)
        message = conn.recv(64)
        os.kill(pid, int(message) if message else signal.SIGKILL)
        if not message:
            select.select([copy], [], [])


def log_line(line: str) -> None:
    """One line of the server's log in one write: the keepers of a launch's ranks write theirs at the same moment,
    and print() under PYTHONUNBUFFERED writes the line and its newline apart (two lines ran together and
    testkit.WarmLaunches.forking counted one copy for two)."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def client_pid(conn: socket.socket) -> int:
    """The pid of the process that connected (SO_PEERCRED: pid, uid, gid)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[0]


def as_python_u() -> None:
    """stdout and stderr as `python -u` makes them: write-through text over unbuffered files."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
                               write_through=True)  # fmt: skip
        setattr(sys, name, new)
        setattr(sys, f"__{name}__", new)


if __name__ == "__main__":
    script = Path(sys.argv[1]).resolve()
    sys.path[0] = str(home(script))  # as `python SCRIPT` (or -m) has it, not this file's folder
    import_what_it_imports(script)
    # what the imports set (dynamo's import sets TORCHINDUCTOR_CACHE_DIR where it is unset), as a fresh process's would
    set_by_the_imports = {k: v for k, v in os.environ.items() if k not in BEFORE_THE_IMPORTS}
    modules = sys.argv[4:]
    if modules[:1] == [COMPILE_READY]:
        modules = modules[1:]
        set_up_cpu_compiles()
    gc.freeze()  # the imports' objects are never collected: a copy's collections (its exit's too) skip them, 1.5 s
    listener = socket.socket(fileno=int(sys.argv[2]))
    request = serve(script, listener, socket.socket(fileno=int(sys.argv[3])), modules)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_the_imports, **request["env"]})
    if THREADS in os.environ and os.environ[THREADS] != BEFORE_THE_IMPORTS.get(THREADS):
        import torch

        torch.set_num_threads(int(os.environ[THREADS]))
    args = request["args"]
    if args[0] == "-u":
        as_python_u()
        args = args[1:]
    if os.environ.get(LOGS) != BEFORE_THE_IMPORTS.get(LOGS):  # its handlers on the copy's stderr, set up above
        import torch._logging

        torch._logging._init_logs()
    if args[0] == "-m":
        # accelerate's one-process launcher starts its run as `sys.executable SCRIPT`: through warm_exec.py too
        sys.executable = os.environ.get("PYTHON_EXEC", sys.executable)
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(str(script), run_name="__main__")
