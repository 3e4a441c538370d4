"""training.compile_cache: a graph compiled for one CPU vector ISA is never served to a process compiling for others."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from testkit import run
from training.compile_cache import PREFIX, set_up_compile_cache

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


PROBE = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    if sys.argv[1] == "isolate":
        from training.compile_cache import set_up_compile_cache
        set_up_compile_cache(torch.device('cpu'))
    f = lambda x: torch.nn.functional.gelu(x * 2 + 1).sum(-1)
    x = torch.randn(37, 40)  # ragged against every vector width
    torch.testing.assert_close(torch.compile(f)(x), f(x))
    print(json.dumps(counters["inductor"]))
""")


def compile_probe(cache: Path, isolate: bool, env: dict[str, str] | None = None) -> dict[str, int]:
    """Compile a small function in a fresh process on the cache folder `cache`; inductor's cache counters."""
    inherited = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env = {**inherited, "TORCHINDUCTOR_CACHE_DIR": str(cache), **(env or {})}
    cmd = [sys.executable, "-c", PROBE, "isolate" if isolate else "shared"]
    return json.loads(run(cmd, env=env).stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_graph_compiled_for_another_isa_is_compiled_anew(tmp_path):
    """With the subfolders, a process vectorizing for this CPU is not served the scalar build: it compiles its own,
    and a third process finds it, even one that inherited the scalar subfolder as a child does, which builds
    nothing there (inductor's ISA probe programs stay in the base folder). Without them (the scalar build's folder
    as the one cache) inductor serves the scalar build to the vectorizing process (torch 2.13): the cache key misses
    the ISA."""
    compile_probe(tmp_path, isolate=True, env=SCALAR)
    (scalar,) = tmp_path.glob(PREFIX + "*")  # the scalar build's subfolder
    second = compile_probe(tmp_path, isolate=True)
    assert second.get("fxgraph_cache_hit", 0) == 0 and second["fxgraph_cache_miss"] == 1
    scalar_files = sorted(scalar.rglob("*"))
    assert compile_probe(scalar, isolate=True)["fxgraph_cache_hit"] == 1
    assert sorted(scalar.rglob("*")) == scalar_files

    served = compile_probe(scalar, isolate=False).get("fxgraph_cache_hit", 0)
    assert served == 1, "torch keys its compile cache on the vector ISA now: training.compile_cache can go"
