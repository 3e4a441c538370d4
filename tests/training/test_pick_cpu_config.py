"""`make train`'s precision: the CPU launch YAML picked from measured fp32 and bf16 matmul speeds."""

import os
import sys

import pytest

from modeling.device import X86
from testkit import REPO, run
from training import pick_cpu_config
from training.metrics import CPU_YAML
from training.pick_cpu_config import choose, main


def test_bf16_only_where_its_matmuls_are_clearly_faster():
    # an AMX or Zen 4/5 core: bf16 2-4x fp32
    mixed_precision, why = choose({"bf16": 0.9, "no": 0.21})
    assert mixed_precision == "bf16" and why.startswith("this CPU multiplies bf16 matrices 4.3x faster than fp32")
    # 1.3x (FASTER_BY) is clearly faster; below it a shared machine's noise could decide, and fp32 stays
    assert choose({"bf16": 0.13, "no": 0.1})[0] == "bf16"
    mixed_precision, why = choose({"bf16": 0.129, "no": 0.1})
    assert mixed_precision == "no" and "not clearly faster than fp32 here (1.29x, 1.3x needed" in why
    # an AVX-512-bf16 Xeon without AMX: bf16 at half the fp32 speed
    mixed_precision, why = choose({"bf16": 0.16, "no": 0.30})
    assert mixed_precision == "no" and "(0.53x, 1.3x needed: bf16 160 GFLOP/s, fp32 300 GFLOP/s)" in why
    # an AVX-512 Xeon without its bf16 instructions (Cascade Lake): emulated, 4.6x slower, said as such
    mixed_precision, why = choose({"bf16": 0.050, "no": 0.231})
    assert mixed_precision == "no" and why.startswith("this CPU has no native bf16 matmuls: bf16 runs 5x slower")
    # an AVX2-only core (Zen 3, most laptops): no native bf16, 30-300x slower
    mixed_precision, why = choose({"bf16": 0.0011, "no": 0.15})
    assert mixed_precision == "no" and why.startswith("this CPU has no native bf16 matmuls: bf16 runs 136x slower")


def test_prints_the_yaml_it_picks_here_and_one_line_why(capsys):
    main([])
    out, err = capsys.readouterr()
    path = out.strip()
    assert out == path + "\n" and path in CPU_YAML.values() and (REPO / path).is_file()
    name = "bf16" if path == CPU_YAML["bf16"] else "fp32"
    assert err.startswith(f"precision: {name} ({path}): ") and err.count("\n") == 1


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="AVX2 emulation: x86 only")
def test_a_cpu_without_native_bf16_gets_fp32():
    """AVX2-only emulated on any x86 CPU: oneDNN and ATen kept to AVX2, where bf16 matmuls are 30-300x slower."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    result = run([sys.executable, "-m", "training.pick_cpu_config"], env=env)
    assert result.stdout == "accelerate_configs/cpu.yaml\n"
    assert result.stderr.startswith("precision: fp32 (accelerate_configs/cpu.yaml): this CPU has no native bf16")


def test_an_argument_is_argparses_error_before_the_timing(capsys, monkeypatch):
    """It took no options and ignored any (`--help` timed the matmuls and printed a YAML path)."""
    monkeypatch.setattr(pick_cpu_config, "cpu_matmul_speeds", None)  # never reached
    with pytest.raises(SystemExit) as exc:
        main(["--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "python -m training.pick_cpu_config: error: unrecognized arguments: --bogus"
