"""Keep the memory a CPU step frees, instead of handing it back to the kernel and faulting it in again.

glibc serves every allocation above its mmap threshold (32 MB at most) with a fresh mmap and unmaps it on free. A
CPU training step allocates and frees the same big buffers every time (the fused loss's (chunk, vocab) logits and
its bf16 head-grad products, the 50,304 x 256 gradients): small-cpu B8 page-faults ~88,000 times a step in bf16,
~58,000 in fp32, 130-280 ms of kernel time a step on one core (BENCHMARKS.md, "Profile (Zen bf16)"). With mmap off
and no trimming, freed blocks stay in the process and the next step reuses them: the process holds its peak, as it
would in the middle of a step anyway. Scoring is the same: each eval batch's logits, (batch, length, 50,304), are
such a buffer (`python -m evals` on HellaSwag and LAMBADA: 1.74M page faults against 0.19M, BENCHMARKS.md,
"Evaluation speed").
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only for the hint: data preparation imports modeling without torch
    import torch

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4

# Transparent huge pages for torch's big CPU blocks: with THP_MEM_ALLOC_ENABLE set, torch's CPU allocator advises
# the kernel to back each block of 2 MB or more with 2 MB pages (madvise), so that a step's big buffers (a loss
# chunk's 103 MB of logits, the 51 MB gradients) take 1/512 of the TLB entries and misses: the rung-11 step 3-9%
# faster on an AMX Xeon, 5-7% at `make train`'s width (BENCHMARKS.md, "Huge pages"). torch reads the variable once,
# at its first CPU allocation, so it is set on import: modeling/__init__.py imports this module before anything
# allocates. A default only: a user's THP_MEM_ALLOC_ENABLE=0 wins; where the kernel's THP is "never" the advice does
# nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def keep_freed_memory(device: torch.device) -> None:
    """Before a process computes on the CPU: glibc's malloc keeps freed memory for reuse (no mmap per big block, no
    trimming). No-op off the CPU, without glibc (macOS, Windows, musl), and where the user tunes glibc's malloc
    through the environment (MALLOC_*_ or GLIBC_TUNABLES): theirs wins."""
    tuned = any(name.startswith("MALLOC_") or name == "GLIBC_TUNABLES" for name in os.environ)
    if device.type != "cpu" or platform.libc_ver()[0] != "glibc" or tuned:
        return
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
