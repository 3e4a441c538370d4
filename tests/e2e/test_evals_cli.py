"""`python -m evals` end to end: one process and two (through `accelerate launch`) score a run folder alike."""

import json
import os
import platform
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from data_prep.tokenizer import get_encoding, gpt2_vocab_and_merges
from evals.loading import load_model
from evals.runner import run_task
from modeling.config import GPTConfig
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from testkit import ACCELERATE_LAUNCH, REPO, SMALL_PAGES, TINY_MODEL, WarmLaunches, run
from training.checkpoint import checkpoint_dir

pytestmark = pytest.mark.slow


def cli_env(env: dict[str, str] | None = None) -> dict[str, str]:
    shell = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # as in a user's shell
    return {**shell, "PYTHONPATH": str(REPO), **(env or {})}


def run_cli(
    args: list[str], launcher: list[str], env: dict[str, str] | None = None, warm: WarmLaunches | None = None
) -> subprocess.CompletedProcess:
    return run([*launcher, *args], timeout=300, env=cli_env(env), warm=warm)


@pytest.fixture(scope="module")
def warm_evals() -> Iterator[WarmLaunches]:
    """The server `python -m evals` runs in, and the ranks of its launches (testkit.WarmLaunches): each a copy of a
    process that has imported torch, accelerate and the eval modules, not a fresh interpreter (~4 s of CPU each)."""
    with WarmLaunches(REPO / "evals" / "__main__.py", cli_env()) as warm:
        yield warm


def test_one_and_two_processes_give_identical_results(tiny_run, tmp_path, warm_evals):
    args = ["--run", str(tiny_run), "--tasks", "hellaswag,lambada", "--limit", "12", "--batch-size", "5"]
    launch = [*ACCELERATE_LAUNCH, "--config_file", "accelerate_configs/cpu_ddp2.yaml"]
    with warm_evals.forking(4):  # the run, the launcher, its 2 ranks
        one = run_cli([*args, "--json", str(tmp_path / "one.json")], [sys.executable, "-m", "evals"], warm=warm_evals)
        two = run_cli([*args, "--json", str(tmp_path / "two.json")], [*launch, "-m", "evals"], warm=warm_evals)
    assert "1 process(es)" in one.stdout and "2 process(es)" in two.stdout
    # accelerate imports DeepSpeed where installed, which warned on each rank that it found no GPU
    assert "[WARNING]" not in one.stdout + one.stderr + two.stdout + two.stderr
    assert "| hellaswag | acc_norm |" in one.stdout and "| lambada | ppl |" in one.stdout
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    newest = checkpoint_dir(tiny_run, 2)
    assert one["source"] == two["source"] == f"checkpoint {newest} (model.safetensors)"
    assert one["examples"] == two["examples"] == {"hellaswag": 12, "lambada": 12}
    assert one["predictions"] == two["predictions"]
    assert one["metrics"] == two["metrics"]
    # ... and what the library computes in-process from the same checkpoint.
    model, _ = load_model(tiny_run)
    local = run_task(model, "hellaswag", get_encoding(), limit=12)
    assert local.predictions["pred_norm"].tolist() == one["predictions"]["hellaswag"]["pred_norm"]
    assert local.metrics["hellaswag_acc_norm"] == one["metrics"]["hellaswag_acc_norm"]


# evals' main() as `python -m evals` runs it, twice in one process: the page faults of the second scoring
FAULTS_OF_A_SECOND_SCORING = textwrap.dedent("""
    import resource, sys
    from evals.__main__ import main
    def faults_of_scoring():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        main(sys.argv[1:])
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_scoring()
    print(faults_of_scoring())
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_scoring_reuses_the_memory_each_batch_frees(tiny_run):
    """`python -m evals` sets its process up as training does (modeling.runtime.set_up_compute): freed memory is
    kept, so each batch's logits, (batch, length, 50,304) floats, reuse the last batch's instead of being faulted in
    afresh (HellaSwag and LAMBADA at --limit 300 on a Cascade Lake: 1.74M page faults and 16-18 s without, 0.20M and
    12-14 s with). Scoring again in the same process then faults in fewer pages than one batch's logits fill (here
    21,923 of 50,304; by default 81,750-81,975: each batch's logits mapped afresh)."""
    batch = 32  # 16 HellaSwag examples × 4 endings: 2 batches of 32 sequences
    args = ["--run", str(tiny_run), "--tasks", "hellaswag", "--limit", "16", "--batch-size", str(batch)]
    faults = int(run_cli(args, [sys.executable, "-c", FAULTS_OF_A_SECOND_SCORING], SMALL_PAGES).stdout.split()[-1])
    one_batch_of_logits = batch * TINY_MODEL.block_size * TINY_MODEL.vocab_size * 4 // 4096
    assert faults < one_batch_of_logits, (faults, one_batch_of_logits)


# evals.generate's main() as `python -m evals.generate` runs it, twice in one process: the page faults of the second
# one's generation (its model's loading left out)
FAULTS_OF_A_SECOND_GENERATION = textwrap.dedent("""
    import resource, sys
    import evals.generate as cli
    generate_samples, faults = cli.generate_samples, []
    def counted(*args, **kwargs):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        texts = list(generate_samples(*args, **kwargs))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return iter(texts)
    cli.generate_samples = counted
    cli.main(sys.argv[1:])
    cli.main(sys.argv[1:])
    print(faults[-1])
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_generation_reuses_the_memory_each_token_frees(tmp_path):
    """`python -m evals.generate` sets its process up as training does (modeling.runtime.set_up_compute): each new
    token's forward pass over a long context reuses the buffers the last one freed instead of faulting them in afresh
    (gpt2-124m after 900 tokens on a Cascade Lake, before generation kept its keys and values: 1.37M page faults and
    61-63 s for 40 tokens without, none and 55 s with). Past block_size every token still runs the whole window
    (GPT.generate: the positions shift), so here a 2-layer, 256-wide model of block_size 512 writes 4 tokens after
    1,000: generating again in the same process faults in fewer pages than a tenth of one of its MLP's activations
    (51; 3 here, and 1,540-5,987 in eight runs with the set-up taken out on a Zen 4; 20 tokens, 1.2-1.9 s more of
    its CPU there, faulted 9,121-39,712 so on the Cascade Lake)."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=512)
    export = export_hf(GPT(config), tmp_path / "export", gpt2_vocab_and_merges())
    args = ["--model", str(export), "--prompt", "word " * 1000, "--max-new-tokens", "4", "--temperature", "0"]
    faults = int(run_cli(args, [sys.executable, "-c", FAULTS_OF_A_SECOND_GENERATION], SMALL_PAGES).stdout.split()[-1])
    mlp_activations = config.block_size * 4 * config.n_embd * 4 // 4096  # pages: the window x 4 n_embd fp32
    assert faults < mlp_activations // 10, (faults, mlp_activations)


def test_a_bad_argument_under_two_processes_is_one_line(tmp_path, warm_evals):
    """Both processes of a launch reach the same bad input: the line is printed once, last (not once per process,
    then the launcher's line about rank 0's exit status)."""
    yaml = str(REPO / "accelerate_configs" / "cpu_ddp2.yaml")
    cmd = [sys.executable, "-m", "training.launch", "-q", "--config_file", yaml, "-m", "evals"]
    args = ["--run", str(tmp_path / "nowhere"), "--tasks", "lambada"]
    with warm_evals.forking(2):  # the ranks ran warm
        result = run([*cmd, *args], expect_rc=1, timeout=300, env=cli_env(), warm=warm_evals)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: run folder {tmp_path / 'nowhere'} does not exist"], result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == errors[0]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX2 emulation: x86 only")
def test_bf16_on_a_cpu_without_native_bf16_is_warned_in_one_line(tiny_run):
    """On an AVX2-only CPU (emulated on any x86 one) bf16 matmuls are emulated, and a bf16 eval took 3.4x fp32's
    time without a word: the line training prints in that case, with the flag that evaluates in fp32."""
    avx2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    args = ["--run", str(tiny_run), "--tasks", "lambada", "--limit", "2"]
    bf16 = run_cli([*args, "--mixed-precision", "bf16"], [sys.executable, "-m", "evals"], avx2)
    warned = [line for line in bf16.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: this CPU has no native bf16 matmuls: bf16 runs ")
    assert warned[0].endswith("; evaluate in fp32 with --mixed-precision no"), warned
    assert "| lambada | acc |" in bf16.stdout
    fp32 = run_cli([*args, "--mixed-precision", "no"], [sys.executable, "-m", "evals"], avx2)
    assert "warning:" not in fp32.stderr, fp32.stderr
