"""The one device rule (modeling.device): CUDA, else MPS for a single process, else the CPU."""

import pytest

from modeling.device import needs_cpu


@pytest.mark.parametrize(
    ("cuda", "mps", "processes", "cpu"),
    [
        (True, False, 1, False),  # a GPU box: accelerate picks CUDA
        (True, False, 8, False),
        (False, True, 1, False),  # a Mac, one process: the Apple GPU
        (False, True, 2, True),  # a Mac, 2 processes: MPS has no collectives, so gloo on the CPU
        (False, False, 1, True),  # a CPU-only machine
        (False, False, 2, True),
    ],
)
def test_needs_cpu(cuda, mps, processes, cpu):
    assert needs_cpu(cuda=cuda, mps=mps, num_processes=processes) is cpu
