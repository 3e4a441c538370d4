"""`python warm_launch.py SCRIPT FD`: import what SCRIPT imports, then fork a copy of this process to run SCRIPT as
`python SCRIPT ARGS` would, once per request; testkit.run's launches of train_accel.py without its ~7 s of imports.

Each copy starts from the same state, the imports done and nothing run, so a launch sees what a fresh process sees
by the time its script's first line after the imports runs. Requests come over the socket FD (a SOCK_SEQPACKET
pair with the test process): a JSON {"args", "cwd", "env"} with the copy's stdin, stdout and stderr as
passed fds; each is answered with the copy's pid, then its exit status as subprocess gives it (-N: killed by
signal N). The server ends when the test process closes its end.
"""

from __future__ import annotations

import ast
import gc
import importlib
import json
import os
import runpy
import socket
import sys
from pathlib import Path

# Imported by the script on its way rather than at its top: the optimizer's first parameter group imports dynamo
# (2.7 s), the end of a run plots loss.png.
LATER_IMPORTS = ("torch._dynamo", "matplotlib.pyplot")


def import_what_it_imports(script: Path) -> None:
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            importlib.import_module(node.module)
    for name in LATER_IMPORTS:
        importlib.import_module(name)


def serve(sock: socket.socket) -> dict:
    """Answer requests until the socket closes (then exit); returns a request in the copy made for it, its stdio
    already on the request's files."""
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        if not message:
            sys.exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            return json.loads(message)
        for fd in fds:
            os.close(fd)
        sock.send(str(pid).encode())
        _, status = os.waitpid(pid, 0)
        sock.send(str(os.waitstatus_to_exitcode(status)).encode())


if __name__ == "__main__":
    script = Path(sys.argv[1]).resolve()
    sys.path[0] = str(script.parent)  # as `python SCRIPT` has it, not this file's folder
    import_what_it_imports(script)
    gc.freeze()  # the imports' objects are never collected: a copy's collections (its exit's too) skip them, 1.5 s
    request = serve(socket.socket(fileno=int(sys.argv[2])))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(script), *request["args"]]
    runpy.run_path(str(script), run_name="__main__")
