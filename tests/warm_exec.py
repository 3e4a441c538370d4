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

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    args = sys.argv[1:]  # the interpreter's: -u SCRIPT ARGS
    pending: list[int] = []  # signals that came before the copy's pid
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    for signum in FORWARDED:
        signal.signal(signum, lambda signum, frame: pending.append(signum))
    try:
        sock.connect(os.environ["WARM_LAUNCH_SOCKET"])
        request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(sock, [request], [0, 1, 2])
        answer = sock.recv(64)
    except OSError:
        answer = b""
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
