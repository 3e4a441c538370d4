"""The fused loss's softmax on the CPU as one C kernel per chunk (modeling/cpu_softmax.c), built when first needed.

Inductor writes the chunk's softmax as three passes over its (rows x 50,304) logits with Sleef's exp, into a new
gradient tensor: 22 ms a 1,024-row bf16 chunk on an AMX Xeon, a quarter of `make train`'s step there. The kernel
takes each row through its passes while the row is in the core's cache, with a cheaper exp (within 1.5 ulp of
fp32's), and writes the gradient over the logits in place (BENCHMARKS.md, "The loss's softmax as a C kernel").

Built with gcc (`-march=native`: the machine it runs on, held to AVX2 where ATen is, as under
ATEN_CPU_CAPABILITY=avx2) the first time a process needs it on a machine, and kept in the cache folder
(modeling.disk.cache_dir, `kernels/`) under a name that hashes the source, gcc's flags and binary and the CPU's
model and flags: the next process on this machine loads it (2 ms, where a build takes ~0.3 s of CPU and ~0.45 s,
in each process and rank that trains), and no build reaches a CPU, or a home folder shared by other CPUs, it was
not made for. A copy that does not load is built again; a cache that takes no write leaves each process building its
own. It runs on torch's own OpenMP threads (the libgomp torch loaded), so it needs Linux, gcc and a torch built with
GNU OpenMP; elsewhere, or if the build fails, `built()` is False and the fused loss keeps its torch form (the same
values, to rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

import torch
from torch import Tensor

from modeling.device import X86, cpu_fields
from modeling.disk import atomic_write_bytes, cache_dir

SOURCE = Path(__file__).with_suffix(".c")
# -fno-trapping-math: without it gcc leaves the exp loop scalar for AVX2 (its selects; AVX-512 masks them anyway)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
FLAGS += ["-shared", "-fPIC"]


def isa_flags(capability: str) -> list[str]:
    """gcc's flags beyond FLAGS for the vector ISA ATen computes with in this process (capability:
    torch.backends.cpu.get_cpu_capability()): none, the machine's own, except AVX2 on a CPU with AVX-512, where ATen
    was told to run its AVX2 kernels (ATEN_CPU_CAPABILITY=avx2, as the suite emulates an AVX2-only CPU such as a
    Zen 3): the kernel is then the one gcc builds on such a CPU."""
    return ["-mno-avx512f"] if capability == "AVX2" and X86 else []


def _gnu_openmp_loaded() -> bool:
    """Whether this process has loaded GNU OpenMP as libgomp.so.1, the name the kernel links against, as torch's CPU
    wheels for Linux bring it: the kernel's parallel loop then runs on torch's thread pool. A wheel whose libgomp is
    renamed (libgomp-<hash>.so.1, as auditwheel renames it) would have the kernel start a second pool, competing
    with torch's for the cores: no kernel there."""
    try:
        return any(line.endswith("/libgomp.so.1") for line in Path("/proc/self/maps").read_text().splitlines())
    except OSError:
        return False


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernel library for this process's ISA, built on the first call."""
    return build(isa_flags(torch.backends.cpu.get_cpu_capability()))


def build(extra_flags: list[str]) -> ctypes.CDLL | None:
    """The kernel built with FLAGS + extra_flags and loaded, or None where it cannot run here (not Linux, no gcc, no
    libgomp, a failed build)."""
    gcc = shutil.which("gcc")
    if not sys.platform.startswith("linux") or gcc is None or not _gnu_openmp_loaded():
        return None
    command = [gcc, *FLAGS, *extra_flags, str(SOURCE)]
    try:
        kept = cache_dir() / "kernels" / f"cpu_softmax-{_build_key(command)}.so"
    except (RuntimeError, OSError):  # no home folder (a container's user without one): built, not kept
        kept = None
    if kept is not None:
        with suppress(OSError, AttributeError):  # none kept yet, or a copy that does not load (damaged)
            return _loaded(kept)
    with tempfile.TemporaryDirectory(prefix="bookgpt-kernel-") as folder:
        library = Path(folder) / "cpu_softmax.so"
        try:
            finished = subprocess.run([*command, "-o", str(library)], capture_output=True, timeout=120)
            if finished.returncode != 0:
                return None
            loaded = _loaded(library)
        except (OSError, AttributeError, subprocess.TimeoutExpired):
            return None
        if kept is not None:
            with suppress(OSError):  # a read-only or full cache: the next process builds its own again
                atomic_write_bytes(kept, library.read_bytes())  # whole, for the processes (ranks) loading it at once
        return loaded


def _loaded(library: Path) -> ctypes.CDLL:
    """The kernel library at `library`, loaded; OSError or AttributeError where it is no such library."""
    loaded = ctypes.CDLL(str(library))
    loaded.softmax_grad_bf16, loaded.softmax_grad_fp32  # noqa: B018 (both entry points there)
    return loaded


def _build_key(command: list[str]) -> str:
    """What the build's output depends on, hashed: the source, gcc's flags, gcc's binary (a new gcc: new code) and
    the CPU that -march=native reads (its vendor, family, model, name and flags, from /proc/cpuinfo's first CPU)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    gcc = os.stat(os.path.realpath(command[0]))
    fields = cpu_fields()
    cpu = [fields.get(name) for name in ("vendor_id", "cpu family", "model", "model name", "flags")]
    digest.update(json.dumps([command[1:-1], gcc.st_size, gcc.st_mtime_ns, cpu]).encode())
    return digest.hexdigest()[:16]


def built() -> bool:
    """Whether the kernel is built and loaded in this process (built on the first call); a constant to torch.compile."""
    return _library() is not None


# What @torch.compiler.assume_constant_result sets (as modeling.fused_ce.cuda_memory_bytes): dynamo calls it while
# tracing and keeps the answer, rather than tracing into a build.
built._dynamo_marked_constant = True  # type: ignore[attr-defined]


def takes(logits: Tensor) -> bool:
    """Whether softmax_grad_ computes this chunk's softmax: bf16 or fp32 CPU logits, where the kernel is built."""
    return logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and built()


@torch.library.custom_op("bookgpt::softmax_grad_", mutates_args=("logits",))
def softmax_grad_(logits: Tensor, target: Tensor, scale: Tensor, write_grad: bool) -> Tensor:
    """For logits (rows, V) and target, scale (rows, 1): each row's loss -log softmax(logits)[target] in fp32,
    returned as (rows, 1); with write_grad, the logits overwritten by (softmax - onehot(target)) * scale in their
    dtype. An op of its own: torch.compile calls it as it is, and the logits it overwrites are the chunk's only
    (rows, V) tensor."""
    library = _library()
    assert library is not None and logits.is_contiguous(), "softmax_grad_ without its kernel (see takes())"
    rows, vocab = logits.shape
    target = target.to(torch.int64).contiguous()
    scale = scale.to(torch.float32).contiguous()
    loss = torch.empty((rows, 1), dtype=torch.float32)
    run = library.softmax_grad_bf16 if logits.dtype == torch.bfloat16 else library.softmax_grad_fp32
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in (logits, target, scale, loss)]
    if run(*pointers, ctypes.c_int64(rows), ctypes.c_int64(vocab), ctypes.c_int(write_grad)):
        raise MemoryError(f"the loss's softmax kernel could not allocate {vocab * 4} bytes a thread")
    return loss


@softmax_grad_.register_fake
def _(logits: Tensor, target: Tensor, scale: Tensor, write_grad: bool) -> Tensor:
    return logits.new_empty((logits.shape[0], 1), dtype=torch.float32)
