"""DDP + torch.compile, the path of every multi-GPU YAML (per block) and of `accelerate config`'s (the whole model),
on 2 real gloo processes: accumulation must keep its no_sync (one gradient all-reduce per bucket per optimizer
step), and the losses must be the 1-process run's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit import ACCELERATE_LAUNCH, QUIET, REPO, WarmLaunches, run

pytestmark = pytest.mark.slow

PROBE = Path(__file__).with_name("ddp_sync_probe.py")
# AdamW: in bf16 Muon's Newton-Schulz would amplify the two runs' summation-order differences past the tolerance.
TINY = ["--preset", "tiny-cpu", "--max-steps", "4", "--total-batch-tokens", "1024", "--micro-batch-size", "4",
        "--warmup-steps", "2", "--lr", "3e-3", "--eval-interval", "0", "--checkpoint-interval", "0",
        "--optimizer", "adamw"]  # fmt: skip


def native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


@pytest.fixture(scope="module")
def warm_probe() -> Iterator[WarmLaunches]:
    """The server the probe's ranks run in (testkit.WarmLaunches): each a copy of a process that has imported torch,
    dynamo and the run's modules and picked inductor's ISA, not a fresh interpreter (the file's 6 ranks: ~5 s of CPU
    each)."""
    with WarmLaunches(PROBE, compile_ready=True) as warm:
        yield warm


def probe(warm: WarmLaunches, config: str, data_dir: Path, out_dir: Path, *launch_args: str) -> dict:
    cmd = [*ACCELERATE_LAUNCH, "-q", "--config_file", str(REPO / "accelerate_configs" / config), *launch_args,
           str(PROBE), *TINY, *QUIET, "--data-dir", str(data_dir), "--out-dir", str(out_dir)]  # fmt: skip
    ranks = 2 if config == "cpu_ddp2.yaml" else 1
    with warm.forking(1 + ranks):  # the launcher and its ranks ran warm
        result = run(cmd, warm=warm)
    # compiling DDP's forward, dynamo warned on every rank that it ignores DDP's profiler label
    assert "will be ignored" not in result.stderr, result.stderr[-2000:]
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))


@pytest.mark.parametrize(
    "precision",
    ["no", pytest.param("bf16", marks=pytest.mark.skipif(not native_bf16(), reason="no native bf16 on this CPU"))],
)
def test_compiled_ddp_accumulates_without_all_reduce_and_matches_one_process(
    prepared_books, tmp_path, warm_probe, precision
):
    """cpu_ddp2.yaml compiled (mb 4 × accumulation 2 × 2 ranks) == 1 eager process (mb 4 × accumulation 4); every
    gradient all-reduce comes at the step's last micro-batch: the same number each step, none while accumulating.

    Both compile with aot_eager: dynamo's graphs and AOTAutograd's backward, whose gradient hooks are what no_sync
    governs, as under inductor, without inductor's C++ builds (a cold compile cache: fp32 76 -> 46 s of CPU, bf16
    51 -> 16 s of the test on a Zen 4); the GPU YAMLs' kernels are Triton's, not these. fp32 (the only case on
    CPUs without native bf16) compiles per block, as the multi-GPU YAMLs do (the prepared model a shallow copy of
    the DDP wrapper, its blocks compiled); bf16 compiles the whole model (`accelerate config`'s default): the graph
    split at DDP's buckets."""
    mp = ["--mixed_precision", precision]
    per_block = [] if precision == "bf16" else ["--dynamo_use_regional_compilation"]
    compiled = ["--dynamo_backend", "aot_eager", *per_block, *mp]
    ddp = probe(warm_probe, "cpu_ddp2.yaml", prepared_books, tmp_path / "ddp", *compiled)
    one = probe(warm_probe, "cpu_eager.yaml", prepared_books, tmp_path / "one", *mp)
    assert ddp["ddp_modules"] == 1 and ddp["graphs"] >= 1 and one["graphs"] == 0
    steps = ddp["steps"]
    assert [s["while_accumulating"] for s in steps] == [0] * 4, steps  # accelerator.no_sync held
    # one all-reduce per bucket per step; DDP rebuilds its buckets after the first step, so count from the second
    assert steps[0]["all_reduces"] >= 1 and len({s["all_reduces"] for s in steps[1:]}) == 1, steps
    tolerance = 1e-5 if precision == "no" else 2e-2  # summation order; bf16 rounds per rank's micro-batch
    assert ddp["losses"] == pytest.approx(one["losses"], abs=tolerance)
