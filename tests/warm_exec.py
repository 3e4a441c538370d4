"""torchrun's PYTHON_EXEC in the tests (testkit.run's `accelerate launch` commands): run each rank in a copy of the
warm launch server (warm_launch.py) at $WARM_LAUNCH_SOCKET instead of a fresh interpreter, or exec a fresh one where
the server says the copy would differ. Run with `python -S` (no site: a few ms); the standard library only.

It stands where the rank's process would: its stdin, stdout and stderr are the copy's, the signals it gets are passed
on to the copy (and, as the rank would, it gets SIGTERM when torchrun dies), its death kills the copy, and it exits
as the copy did."""

import ctypes
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def ask(sock: socket.socket, path: str, args: list[str], cwd: str, env: Mapping[str, str], stdio: list[int]) -> bytes:
    """Send one request to the server listening at `path` over `sock` (AF_UNIX, SOCK_SEQPACKET): the interpreter's
    `args`, `cwd` and `env`, and the copy's stdin, stdout and stderr. Its first answer: b"fresh", the copy's pid, or
    b"" where the server is gone. Its next (the copy's exit status) comes over `sock` too."""
    try:
        sock.connect(path)
        socket.send_fds(sock, [json.dumps({"args": args, "cwd": cwd, "env": dict(env)}).encode()], stdio)
        return sock.recv(64)
    except OSError:
        return b""


def main() -> None:
    args = sys.argv[1:]  # the interpreter's: -u SCRIPT ARGS
    pending: list[int] = []  # signals that came before the copy's pid
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    for signum in FORWARDED:
        signal.signal(signum, lambda signum, frame: pending.append(signum))
    answer = ask(sock, os.environ["WARM_LAUNCH_SOCKET"], args, os.getcwd(), os.environ, [0, 1, 2])
    if answer in (b"", b"fresh"):
        for signum in FORWARDED:
            signal.signal(signum, signal.SIG_DFL)
        for signum in pending:
            os.kill(os.getpid(), signum)
        os.execv(sys.executable, [sys.executable, *args])
    # torchrun's death: SIGTERM, passed on, as the rank's own training.signals.stop_with_the_launcher would have it
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    for signum in FORWARDED:
        signal.signal(signum, lambda signum, frame: sock.send(str(signum).encode()))
    for signum in pending:
        sock.send(str(signum).encode())
    status = sock.recv(64)
    if not status:
        sys.exit("warm_exec: the warm launch server went away")
    returncode = int(status)
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


if __name__ == "__main__":
    main()
