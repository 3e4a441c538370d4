"""modeling.malloc: after keep_freed_memory a process reuses the big blocks a step frees instead of faulting in
fresh ones every step; torch's big CPU blocks ask for huge pages in every process that computes."""

from __future__ import annotations

import ast
import os
import platform
import statistics
import sys
import textwrap
from pathlib import Path

import pytest

from testkit import SMALL_PAGES, run

PROBE = textwrap.dedent("""
    import resource, sys, torch
    from modeling.fused_ce import fused_linear_cross_entropy
    from modeling.malloc import keep_freed_memory
    if sys.argv[1] == "keep":
        keep_freed_memory(torch.device("cpu"))
    h = torch.randn(1024, 16, requires_grad=True)
    w = torch.randn(50304, 16, requires_grad=True)
    targets = torch.randint(0, 50304, (1024,))
    def faults_of_a_step():  # the fused loss's (chunk, vocab) buffers, allocated and freed as in training
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fused_linear_cross_entropy(h, w, targets).backward()
        h.grad = w.grad = None
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print([faults_of_a_step() for _ in range(int(sys.argv[2]))])
""")


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_step_reuses_the_memory_the_last_one_freed():
    """By default every step maps its big buffers afresh (~50,000 page faults a step here); kept, the typical step
    after the second faults (next to) nothing. The second step still grows the heap by one buffer (every run here),
    and glibc's placement now and then grows it by one more on a later step, more often in some processes than in
    others (the heap's place among the process's mappings: 0-2 of 8 later steps in ten runs on a Zen 4, 3 of 8 once
    in CI): the median later step faults nothing, over 18 of them."""
    env = {**os.environ, **SMALL_PAGES}
    default = ast.literal_eval(run([sys.executable, "-c", PROBE, "default", "4"], env=env).stdout.strip())
    keep = ast.literal_eval(run([sys.executable, "-c", PROBE, "keep", "20"], env=env).stdout.strip())
    assert min(default[1:]) > 20_000
    assert statistics.median(keep[2:]) < 100, keep


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_users_own_malloc_tuning_wins():
    """With MALLOC_* set in the environment keep_freed_memory changes nothing: the user's threshold applies."""
    env = {**os.environ, **SMALL_PAGES, "MALLOC_MMAP_THRESHOLD_": "65536"}
    faults = ast.literal_eval(run([sys.executable, "-c", PROBE, "keep", "4"], env=env).stdout.strip())
    assert min(faults[1:]) > 20_000


HUGE_PAGES = textwrap.dedent("""
    import importlib, sys
    importlib.import_module(sys.argv[1])  # an entry point's imports, as when it runs
    import torch
    block = torch.ones(8 << 20, dtype=torch.uint8)  # a big CPU block, allocated after them
    inside = False
    for line in open("/proc/self/smaps"):  # the VmFlags of the mapping that holds it: hg = madvise(MADV_HUGEPAGE)
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            low, high = (int(x, 16) for x in first.split("-"))
            inside = low <= block.data_ptr() < high
        elif inside and line.startswith("VmFlags:"):
            print("hg" in line.split())
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no transparent huge pages")
@pytest.mark.parametrize(
    ("entry", "setting"),
    [("train_accel", None), ("bench.ladder", None), ("evals.__main__", None), ("train_accel", "0")],
    ids=["train_accel", "bench.ladder", "evals", "train_accel-user_off"],
)
def test_big_cpu_blocks_ask_for_huge_pages_unless_the_user_says_no(entry, setting):
    """torch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation: the entry points' imports set it before that
    (modeling.malloc, imported first by modeling), and a user's 0 stays 0."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if setting is not None:
        env["THP_MEM_ALLOC_ENABLE"] = setting
    out = run([sys.executable, "-c", HUGE_PAGES, entry], env=env).stdout.split()
    assert out == (["True"] if setting is None else ["False"]), out
