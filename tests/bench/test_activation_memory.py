"""python -m bench.activation_memory: its table's header names the CPU as the other benchmarks do, and a shape it
cannot build is argparse's one line naming the flag, before any child process runs."""

from __future__ import annotations

import pytest

from bench.activation_memory import main
from modeling.device import cpu_model


def test_the_table_names_the_cpu_by_its_model(capsys):
    """The header read 'x86_64' (platform.processor()), where the other benchmarks name the CPU's model."""
    main(["--layers", "1", "--width", "32", "--context", "16", "--micro-batch-size", "1"])
    out = capsys.readouterr().out
    assert out.startswith("L1 C32 T16 micro-batch 1, fp32, torch ") and f", CPU: {cpu_model()}\n" in out
    assert "| plain |" in out and "| checkpointed |" in out


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--layers", "0", "must be at least 1, got 0"),
        ("--micro-batch-size", "0", "must be at least 1, got 0"),
        ("--width", "65", "must be a multiple of 4 (the heads), got 65"),
    ],
)
def test_a_shape_it_cannot_build_is_argparses_line(capsys, flag: str, value: str, why: str):
    """--layers 0 and --width 65 were GPTConfig's ValueError traceback, --micro-batch-size 0 a child's."""
    with pytest.raises(SystemExit) as exc:
        main([flag, value])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: argument {flag}: {why}")
