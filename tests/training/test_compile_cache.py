"""training.compile_cache: a graph compiled for one CPU vector ISA is never served to a process compiling for others;
a machine without a C++ compiler is told so before a CPU compile, and may still run dynamo's other backends; one
without the C compiler or Python headers Triton builds with, before a GPU compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from testkit import REPO, copy_isa_probes, run
from training.compile_cache import (
    PREFIX,
    c_compiler,
    check_build_tools,
    cpp_compiler,
    missing_build_tools,
    set_up_compile_cache,
)
from training.config import ConfigError
from training.metrics import cpu_precision_hint
from training.pick_cpu_config import main as pick_cpu_config

# ATEN_CPU_CAPABILITY=default: no vector ISA (scalar kernels) on every CPU, so another ISA than the native one even
# on an AVX2-only machine.
SCALAR = {"ATEN_CPU_CAPABILITY": "default"}
CPU = torch.device("cpu")


def test_one_subfolder_per_isa_under_the_users_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    native = set_up_compile_cache(CPU)
    assert native.parent == tmp_path and native.name.startswith(PREFIX)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(native)
    assert set_up_compile_cache(CPU) == native  # idempotent: train_accel.py's processes inherit the variable

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", SCALAR["ATEN_CPU_CAPABILITY"])
    scalar = set_up_compile_cache(CPU)  # a child with another ISA moves to the sibling, not below
    assert scalar.parent == tmp_path and scalar != native
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert set_up_compile_cache(CPU) == native


def test_a_gpu_process_keeps_the_cache_and_picks_no_isa(tmp_path, monkeypatch):
    """Picking the ISA builds probe programs (42 s on a fresh H100 machine) for C++ kernels a GPU run never makes."""
    import torch._inductor.cpu_vec_isa

    def pick_vec_isa():
        raise AssertionError("the ISA was picked for a GPU process")

    monkeypatch.setattr(torch._inductor.cpu_vec_isa, "pick_vec_isa", pick_vec_isa)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert set_up_compile_cache(torch.device("cuda")) is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


# A fresh process: imports the entry points a user starts, then sets up a GPU compile (no C++, no ISA to pick)
FIRST_COMPILE = textwrap.dedent("""
    import sys, torch
    import train_accel, evals.__main__, evals.generate, bench.ladder
    print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
    from training.compile_cache import set_up_compile_cache
    set_up_compile_cache(torch.device("cuda"))
    print(type(torch._inductor.config.post_grad_custom_post_pass).__name__)
""")


def test_inductor_is_imported_for_a_compile_and_brings_the_tied_gradient_pass():
    """Training, evals and the benchmarks import neither inductor nor torch._dynamo at start-up, which a launch that
    stops on bad input would pay for (1.1 s of its 2.9); the compile's set-up installs inductor's pass for the tied
    embedding's gradient, on a GPU too."""
    out = subprocess.run([sys.executable, "-c", FIRST_COMPILE], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "TiedGradientSum"], out.stdout + out.stderr[-2000:]


def test_without_a_cpp_compiler_a_cpu_compile_is_one_line_and_the_cache_is_left_alone(tmp_path, monkeypatch, capsys):
    """CXX naming no compiler, as a container without build tools has none. cpp_compiler asks as inductor does,
    without importing it: both name this machine's compiler, and neither finds one where CXX names none (inductor
    reads CXX at import, hence its config patched here too). Picking the ISA would build probes with it."""
    import torch._inductor.config
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    assert cpp_compiler() == get_cpp_compiler()  # this machine's, for the kernels every other compiling test builds
    monkeypatch.setenv("CXX", "/nowhere/g++")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert cpp_compiler() is None
    with torch._inductor.config.patch({"cpp.cxx": (None, "/nowhere/g++")}), pytest.raises(InvalidCxxCompiler):
        get_cpp_compiler()
    with pytest.raises(ConfigError) as err:
        check_build_tools(CPU)
    assert str(err.value) == (
        "torch.compile builds C++ kernels on the CPU, and this machine has no working C++ compiler (/nowhere/g++): "
        "install one (Debian/Ubuntu: apt install g++; Fedora: dnf install gcc-c++; conda: conda install -c "
        "conda-forge gxx), or launch with accelerate_configs/cpu_eager.yaml (no compile: slower steps)"
    )
    # dynamo's eager and aot_eager backends build nothing: the ISA is not picked, the cache folder stays the user's
    assert set_up_compile_cache(CPU) is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    # make train launches the YAML that does not compile, and says why
    pick_cpu_config([])
    out, err = capsys.readouterr()
    assert out == "accelerate_configs/cpu_eager.yaml\n"
    assert err.startswith("precision: fp32, no compile (accelerate_configs/cpu_eager.yaml): torch.compile builds C++")
    assert cpu_precision_hint("no") is None  # the launch's hint names no YAML that compiles either


def test_without_a_c_compiler_or_python_headers_a_gpu_compile_is_one_line(tmp_path, monkeypatch):
    """Triton builds its CUDA driver module and each kernel's launcher with CC, else gcc, else clang on the PATH
    (checked against triton 3.6's runtime.build on this machine: it builds where c_compiler finds one, and fails
    where it does not: CC naming none or empty, a PATH without either), including Python.h. A CUDA runtime image
    lacks both; the GPU launch's inductor compile stops at start-up, naming what is missing and the launch that
    does not compile. The CPU's C++ compiler is not asked for."""
    cuda = torch.device("cuda")
    assert c_compiler() is not None and missing_build_tools(cuda) is None  # this machine has build tools
    monkeypatch.setenv("CXX", "/nowhere/g++")
    assert missing_build_tools(cuda) is None
    monkeypatch.setenv("CC", "/nowhere/cc")
    with pytest.raises(ConfigError) as err:
        check_build_tools(cuda)
    assert str(err.value) == (
        "torch.compile's GPU kernels are Triton's, which builds their launchers with a C compiler against Python's "
        "headers, and this machine has no working C compiler (/nowhere/cc): install them (Debian/Ubuntu: apt "
        "install gcc python3-dev; Fedora: dnf install gcc python3-devel; conda: conda install -c conda-forge gcc), "
        "or launch with --dynamo_backend no after `accelerate launch` (no compile: slower steps)"
    )
    monkeypatch.setenv("CC", "")  # Triton runs an empty CC, which fails
    assert c_compiler() is None
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    assert c_compiler() is None
    monkeypatch.setattr("training.compile_cache.python_headers", lambda: tmp_path / "Python.h")  # no -dev package
    assert missing_build_tools(cuda).startswith(
        "torch.compile's GPU kernels are Triton's, which builds their launchers with a C compiler against Python's "
        f"headers, and this machine has no working C compiler (gcc or clang) and no Python headers ({tmp_path}/"
        "Python.h): install them"
    )
    assert missing_build_tools(torch.device("mps")) is None  # no compile there (training.distributed)


PROBE = textwrap.dedent("""
    import json, os, sys, torch
    from pathlib import Path
    from torch._dynamo.utils import counters
    from training.compile_cache import set_up_compile_cache
    f = lambda x: torch.nn.functional.gelu(x * 2 + 1).sum(-1)
    x = torch.randn(37, 40)  # ragged against every vector width
    inherited = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    for folder in sys.argv[1:]:
        if folder == "isolate":
            set_up_compile_cache(torch.device("cpu"))
        else:  # the inherited folder as the one cache, the rest of the set-up done (its graph pass is in the key)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = inherited
        torch._dynamo.reset()
        counters.clear()
        torch.testing.assert_close(torch.compile(f)(x), f(x))
        files = sorted(str(p) for p in Path(inherited).rglob("*"))  # what the inherited folder holds after it
        print(json.dumps({"counters": counters["inductor"], "inherited_files": files}))
""")


def compile_probe(cache: Path, *folders: str, env: dict[str, str] | None = None) -> list[dict]:
    """Compile a small function in a fresh process that inherits the cache folder `cache`, once per entry of
    `folders`: in the set-up's subfolder ("isolate") or in `cache` itself ("inherited"); after each compile,
    inductor's cache counters and the files in `cache`."""
    inherited = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env = {**inherited, "TORCHINDUCTOR_CACHE_DIR": str(cache), **(env or {})}
    cmd = [sys.executable, "-c", PROBE, *folders]
    return [json.loads(line) for line in run(cmd, env=env).stdout.splitlines()[-len(folders) :]]


@pytest.mark.slow
def test_a_graph_compiled_for_another_isa_is_compiled_anew(tmp_path):
    """With the subfolders, a process vectorizing for this CPU is not served the scalar build: it compiles its own,
    and a third process finds it, even one that inherited the scalar subfolder as a child does, which builds
    nothing there (inductor's ISA probe programs stay in the base folder). Without them (the scalar build's folder
    as the one cache) inductor serves the scalar build to the vectorizing process (torch 2.13): the cache key misses
    the ISA."""
    # the probe programs conftest's set-up built, so that the first process does not build them again (~7 s of C++)
    copy_isa_probes(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent, tmp_path)
    compile_probe(tmp_path, "isolate", env=SCALAR)
    (scalar,) = tmp_path.glob(PREFIX + "*")  # the scalar build's subfolder
    (second,) = compile_probe(tmp_path, "isolate")
    assert second["counters"].get("fxgraph_cache_hit", 0) == 0 and second["counters"]["fxgraph_cache_miss"] == 1
    scalar_files = sorted(str(p) for p in scalar.rglob("*"))
    # the third process, which then compiles once more without the set-up's subfolder (a fourth process's imports
    # spared: its ISA was picked, so no probe programs are built in the scalar folder either)
    found, served = compile_probe(scalar, "isolate", "inherited")
    assert found["counters"]["fxgraph_cache_hit"] == 1
    assert found["inherited_files"] == scalar_files
    served_hits = served["counters"].get("fxgraph_cache_hit", 0)
    assert served_hits == 1, "torch keys its compile cache on the vector ISA now: training.compile_cache can go"
