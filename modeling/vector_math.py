"""Warm up MKL's vector math before the first step, so that two runs of the same step agree bit for bit.

On x86 CPUs torch hands exp, log, tanh, sqrt and erf over whole tensors to MKL's vector math library (VML). Its
first call in a process is not reproducible: while VML sets itself up, a thread of that call can run a less
accurate variant over its share of the tensor (seen: ~1,800 ulps, 2e-4 relative, in half of an exp over the
logits). Whether it happens depends on timing: up to 1 fresh process in 4 with torch's libraries out of the page
cache. The first training step then differs between two fresh processes, a resumed run from a straight one
(BENCHMARKS.md, "First call of MKL's vector math"). One discarded call of each on every thread first removes that.
"""

from __future__ import annotations

import torch

GRAIN = 32_768  # torch's parallel_for grain (at::internal::GRAIN_SIZE): elements per thread at the least


def warm_up_vector_math(device: torch.device) -> None:
    """Call each VML function a GPT step uses once on all of torch's threads, before a process computes on `device`;
    no-op off the CPU or where torch has no MKL."""
    if device.type != "cpu" or not torch.backends.mkl.is_available():
        return
    x = torch.ones(GRAIN * torch.get_num_threads())
    for op in (torch.exp, torch.log, torch.tanh, torch.sqrt, torch.erf):
        op(x)
