"""python -m bench.activation_memory: its table's header names the CPU as the other benchmarks do (its bad input:
tests/bench/test_cli_errors.py)."""

from __future__ import annotations

from bench.activation_memory import main
from modeling.device import cpu_model


def test_the_table_names_the_cpu_by_its_model(capsys):
    """The header read 'x86_64' (platform.processor()), where the other benchmarks name the CPU's model."""
    main(["--layers", "1", "--width", "32", "--context", "16", "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert out.startswith("L1 C32 T16 micro-batch 1, fp32, torch ") and f", CPU: {cpu_model()}\n" in out
    assert "| plain |" in out and "| checkpointed |" in out
