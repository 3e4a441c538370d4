"""The torch.compile cache, set up before a process's first compile: one folder per CPU vector ISA, and whole
graphs cached, our autograd.Functions in them.

Inductor's FX graph cache keys a compiled graph on the graph, its inputs and inductor's config, but not on the
vector ISA its C++ kernels were generated for (AVX-512, AVX2 or none: picked from the CPU's flags and
ATEN_CPU_CAPABILITY). A process that picks AVX-512 and finds a graph generated under AVX2 rebuilds its 8-lane
loops with 16-lane vectors, which write past their buffers: heap corruption, then a crash or wrong numbers
(torch 2.13; BENCHMARKS.md, "Compile cache"). It happens on one machine (ATEN_CPU_CAPABILITY=avx2 is how AVX2-only
CPUs are emulated) and across machines sharing a cache folder (a home directory on NFS). A subfolder per ISA makes
every hit one this process may run.

AOTAutograd's cache (the traced forward and backward graphs, partitioned) takes no graph holding a custom
autograd.Function unless told to (torch 2.13: autograd_cache_allow_custom_autograd_functions, off while PyTorch
tests it, pytorch#149751: the Function's traced forward and backward are part of the graph, and so of the key). The
fused loss is one (modeling.fused_ce: the loss on the CPU, and wherever the logits are too large to hold), and the FP8
head another, so such launches traced and partitioned their graphs again although inductor's kernels were cached:
2.5 s of a 5.7 s recompile at tiny-cpu on a Cascade Lake (BENCHMARKS.md, "Compile cache"). Allowed, a launch on a
warm cache is served its graphs whole and computes what a fresh compile does: the same loss bit for bit, and the
same gradients up to the order threads add into the embedding's, as between any two compiles
(tests/modeling/test_gpt.py).

Only CPU compiles generate C++ kernels. On a GPU the cache stays where it is: picking the ISA builds and loads ten
probe programs on a machine that has not done so before, 42 s of a fresh H100 machine's start-up (2026-11-26), for
kernels that are Triton's.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from modeling.disk import DiskFull, disk_full_line, is_disk_full
from training.config import ConfigError

PREFIX = "isa-"
EAGER_YAML = "accelerate_configs/cpu_eager.yaml"  # the CPU launch YAML that compiles nothing
# A compile that met a full disk wrote nothing of the run's; the cache can move to another disk
FULL_TODO = (
    "free space on {mount} (or point TORCHINDUCTOR_CACHE_DIR at a folder on a disk with room: torch.compile's cache, "
    "tens of MB on a CPU) and run the same command again"
)
FULL_KEPT = "the run's folder is untouched"


def set_up_compile_cache(device: torch.device) -> Path | None:
    """Let AOTAutograd cache graphs with custom autograd.Functions; for compiles on the CPU, point
    TORCHINDUCTOR_CACHE_DIR (the user's or torch's default) at its subfolder for the ISA this process compiles for,
    and return it; elsewhere, and where no C++ compiler works (dynamo's eager backends build no kernels; an inductor
    launch stops first: check_build_tools), leave it as it is and return None. Call before the first compile.
    Idempotent; a child process that inherits the variable but compiles for another ISA moves to the sibling
    subfolder. Also installs inductor's pass for the tied embedding's gradient (modeling.inductor_passes), on any
    device."""
    import torch._functorch.config

    # imported here, for a compile: an eager process is spared inductor's and torch._dynamo's imports (1.1 s)
    from modeling import inductor_passes

    inductor_passes.install()
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    if device.type != "cpu" or cpp_compiler() is None:  # no compiler: no C++ kernels to keep apart
        return None
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    current = Path(cache_dir())
    base = current.parent if current.name.startswith(PREFIX) else current
    # Picking builds inductor's ISA probe programs in the cache folder of the moment, once per folder (~9 s of C++
    # builds on a 2-core Cascade Lake): in the base, for every ISA, also where a child inherited its parent's subfolder.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base)
    with compile_disk_full_reported():
        isa = pick_vec_isa()
    folder = base / (PREFIX + re.sub(r"\W+", "_", str(isa)).lower())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def cpp_compiler() -> str | None:
    """The C++ compiler inductor builds its CPU kernels with (CXX, else g++), or None where it does not run: a
    container or laptop without build tools, where a compile on the CPU fails with inductor's traceback. Asked as
    inductor asks (`CXX --version`; torch 2.13's cpp_builder.cpp_compiler_search), without importing inductor and
    torch._dynamo (1.3 s), which processes that do not compile are spared. Asked once per name, as inductor caches
    its search: a compiling launch asks three times (the check, the cache's set-up, the precision hint)."""
    cxx = os.environ.get("CXX", "g++")
    return cxx if _runs(cxx) else None


@functools.cache
def _runs(cxx: str) -> bool:
    try:
        subprocess.run([cxx, "--version"], capture_output=True, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def no_cpp_compiler() -> str:
    """What is missing and how to install it, for the lines that say a CPU compile is not possible here."""
    return (
        f"torch.compile builds C++ kernels on the CPU, and this machine has no working C++ compiler "
        f"({os.environ.get('CXX', 'g++')}): install one (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++; "
        "conda: conda install -c conda-forge gxx)"
    )


def c_compiler() -> str | None:
    """The C compiler Triton builds its CUDA driver module and each kernel's launcher with (CC, else gcc, else clang
    on the PATH: triton 3.6's runtime.build), or None where it does not run: a CUDA runtime image without build
    tools, where a GPU compile failed at the first step with Triton's "Failed to find C compiler" in inductor's
    traceback."""
    cc = os.environ.get("CC")
    if cc is None:
        cc = shutil.which("gcc") or shutil.which("clang")
    return cc if cc is not None and _runs(cc) else None


def python_headers() -> Path:
    """Python.h where Triton's builds include it from (a system Python without its -dev package has none)."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme  # Debian's own scheme, as Triton maps it
    return Path(sysconfig.get_paths(scheme=scheme)["include"]) / "Python.h"


def missing_build_tools(device: torch.device) -> str | None:
    """What torch.compile's inductor lacks here to build kernels for `device`, and how to install it; None where
    nothing is missing. On the CPU a C++ compiler; on CUDA (and ROCm) a C compiler and Python's headers, with which
    Triton builds its launchers."""
    if device.type == "cpu":
        return None if cpp_compiler() else no_cpp_compiler()
    if device.type != "cuda":
        return None
    missing = [] if c_compiler() else [f"no working C compiler ({os.environ.get('CC', 'gcc or clang')})"]
    if not python_headers().is_file():
        missing.append(f"no Python headers ({python_headers()})")
    if not missing:
        return None
    return (
        f"torch.compile's GPU kernels are Triton's, which builds their launchers with a C compiler against Python's "
        f"headers, and this machine has {' and '.join(missing)}: install them (Debian/Ubuntu: apt install gcc "
        "python3-dev; Fedora: dnf install gcc python3-devel; conda: conda install -c conda-forge gcc)"
    )


def check_build_tools(device: torch.device) -> None:
    """ConfigError where an inductor compile for `device` could not build its kernels (missing_build_tools): at
    start-up, not with inductor's traceback at the first step."""
    missing = missing_build_tools(device)
    if missing is not None:
        eager = EAGER_YAML if device.type == "cpu" else "--dynamo_backend no after `accelerate launch`"
        raise ConfigError(f"{missing}, or launch with {eager} (no compile: slower steps)")


@contextmanager
def compile_disk_full_reported() -> Iterator[None]:
    """Turn a full disk met while torch.compile writes its cache (generated code, C++ kernels and their precompiled
    headers, the ISA probes) inside the block into DiskFull, naming the cache folder and TORCHINDUCTOR_CACHE_DIR,
    which moves it. Inductor wraps the OSError (InductorError) or quotes it (g++'s output, its compile workers'
    errors): is_disk_full reads both."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as err:
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # TORCHINDUCTOR_CACHE_DIR, else inductor's own

        folder = cache_dir()
        if not is_disk_full(err, folder):
            raise
        raise DiskFull(disk_full_line(folder, FULL_KEPT, FULL_TODO)) from err
