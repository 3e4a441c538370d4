"""`python -m training.pick_cpu_config`: the CPU launch YAML whose precision trains faster on this machine.

Prints the YAML's path on stdout, for `accelerate launch --config_file` (`make train` uses it this way), and one
line on stderr saying which precision and why. It times fp32 and bf16 matmuls as the start-up hint does (~1 s):
bf16 (cpu_bf16.yaml) where bf16 is clearly faster (AMX, Zen 4/5), fp32 (cpu.yaml) elsewhere, including CPUs
without native bf16 (AVX2-only, where bf16 is 30-300x slower; AVX-512 without its bf16 instructions, ~5x). Both
compile; where no C++ compiler works (a container without build tools), fp32 without compile (cpu_eager.yaml). The
YAML stays the one place precision is set.
"""

from __future__ import annotations

import argparse
import sys

from modeling.cpu_linear import NO_NATIVE_BF16, cpu_matmul_speeds
from training.compile_cache import EAGER_YAML, cpp_compiler, no_cpp_compiler
from training.metrics import CPU_YAML, FASTER_BY, dtype_name


def choose(tflops: dict[str, float]) -> tuple[str, str]:
    """(the mixed_precision value to launch with, why) from matmul TFLOP/s by mixed_precision ('no', 'bf16').
    fp32 unless bf16 is clearly faster: within the noise of a shared machine the exact one wins."""
    ratio = tflops["bf16"] / tflops["no"]
    speeds = f"bf16 {tflops['bf16'] * 1e3:.3g} GFLOP/s, fp32 {tflops['no'] * 1e3:.3g} GFLOP/s"
    if ratio >= FASTER_BY:
        return "bf16", f"this CPU multiplies bf16 matrices {ratio:.1f}x faster than fp32 ({speeds})"
    if ratio <= 1 / NO_NATIVE_BF16:
        return "no", f"this CPU has no native bf16 matmuls: bf16 runs {1 / ratio:.0f}x slower than fp32 ({speeds})"
    return "no", f"bf16 matmuls are not clearly faster than fp32 here ({ratio:.2f}x, {FASTER_BY}x needed: {speeds})"


def pick(tflops: dict[str, float]) -> tuple[str, str]:
    """(the CPU YAML of the faster precision, one line saying which and why) from matmul TFLOP/s as choose takes."""
    mixed_precision, why = choose(tflops)
    return CPU_YAML[mixed_precision], f"precision: {dtype_name(mixed_precision)} ({CPU_YAML[mixed_precision]}): {why}"


def main(argv: list[str] | None = None) -> None:
    # no options: --help says what it does, and anything else is argparse's one line (it was timed and ignored)
    argparse.ArgumentParser(
        prog="python -m training.pick_cpu_config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    if cpp_compiler() is None:
        yaml, line = EAGER_YAML, f"precision: fp32, no compile ({EAGER_YAML}): {no_cpp_compiler()} for faster steps"
    else:
        yaml, line = pick(cpu_matmul_speeds())
    print(line, file=sys.stderr)
    print(yaml)


if __name__ == "__main__":
    main()
