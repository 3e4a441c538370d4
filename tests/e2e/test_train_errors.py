"""Bad input to train_accel.py: one clear error (what and how to fix), exit 1, nothing on disk damaged."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from data_prep.tokenizer import gpt2_vocab_and_merges
from modeling.config import PADDED_VOCAB_SIZE, REAL_VOCAB_SIZE
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from modeling.runs import read_metrics
from testkit import REPO, TINY_MODEL, TRAIN_ACCEL, WarmLaunches, hub_endpoint, make_train_recipe, run, train_cmd
from training.checkpoint import list_checkpoints, write_manifest

pytestmark = pytest.mark.slow


def snapshot(*folders: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for folder in folders
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".run.lock")  # the run folder's lock, taken by every launch
    }


@pytest.fixture
def workspace(prepared_books, tmp_path):
    """A private copy of the prepared data and a run folder that already holds an earlier run's files."""
    data = tmp_path / "data"
    shutil.copytree(prepared_books, data)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000002" / "model.safetensors").write_bytes(b"earlier run")
    (run_dir / "metrics.jsonl").write_text('{"step": 2, "train_loss": 9.0}\n')
    return data, run_dir


def fails(run_dir: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """A launch that must stop before touching anything; --resume never (a case's own --resume comes later and
    wins) would set the earlier run aside, so the snapshot proves the checks come first."""
    cmd = train_cmd(None, run_dir, data_dir, "--resume", "never", *args)
    result = run(cmd, expect_rc=1, timeout=300, env=env)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr


def corrupt_shard(data: Path) -> None:
    shard = sorted(data.glob("train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])


def other_vocab_manifest(data: Path) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = 100_277  # e.g. cl100k counts
    (data / "manifest.json").write_text(json.dumps(manifest))


def other_tokenizer_manifest(data: Path) -> None:
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"].update(name="cl100k_base", sha256="0" * 64)
    (data / "manifest.json").write_text(json.dumps(manifest))


def export_cut_short(data: Path) -> None:
    """An export beside the data whose weights file stops part-way (a copy that was cut off)."""
    weights = export_hf(GPT(TINY_MODEL), data.parent / "cut_export", gpt2_vocab_and_merges()) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])


def export_of_32_positions(data: Path) -> None:
    """An export beside the data of a model trained at a context of 32 tokens."""
    export_hf(GPT(TINY_MODEL), data.parent / "export_32", gpt2_vocab_and_merges())


# Each case is a launch of its own. What the config itself rejects (a key, a value out of range: parse_config raises
# before anything is read or written) is one path, walked here by the malformed YAML; tests/training/test_config.py
# checks each such message.
CASES = {
    "malformed_yaml": (None, ["--config", "{tmp}/bad.yaml"], r"not valid YAML at line 3"),
    "missing_data_dir": (
        None,
        ["--data-dir", "{tmp}/nowhere"],
        r"no prepared dataset in .*/nowhere: no such folder \(check --data-dir\).*\n  python -m data_prep.prepare "
        r"--source files:PATH/TO/BOOKS --out",
    ),
    "truncated_shard": (corrupt_shard, [], r"shard .*train_000.bin is .* bytes .*truncated or altered"),
    "vocab_mismatch": (other_vocab_manifest, [], r"100277-id vocabulary but the tiny-cpu model has 50304"),
    "other_tokenizer": (other_tokenizer_manifest, [], r"tokenized with 'cl100k_base'"),
    "block_size_over_init_from": (
        export_of_32_positions,
        ["--init-from", "{tmp}/export_32", "--block-size", "64"],
        r"block_size=64 exceeds .*/export_32's 32 positions, the context its weights were trained at: give "
        r"--block-size 32 or less",
    ),
    "unwritable_out_dir": (None, ["--out-dir", "{tmp}/bad.yaml/run"], r"out_dir .* is not writable"),
    "out_dir_a_file": (None, ["--out-dir", "{tmp}/bad.yaml"], r"out_dir .*bad.yaml is a file; choose another"),
    "init_from_missing": (None, ["--init-from", "{tmp}/no/export"], r"init_from .*/no/export: no such folder"),
    "init_from_not_gpt2": (None, ["--init-from", "{tmp}/llama"], r"not a GPT-2 model \(model_type 'llama'\)"),
    # another tokenizer's GPT-2: transformers' two warnings (bos/eos id 50256 outside its vocabulary) came first
    "init_from_other_vocab": (
        None,
        ["--init-from", "{tmp}/gpt2_32k"],
        r"vocab_size 32000 is not the GPT-2 tokenizer's 50257 ids .*; give a GPT-2 of that tokenizer",
    ),
    "init_from_bad_config": (
        None,
        ["--init-from", "{tmp}/gpt2_typo"],
        r"init_from .*/gpt2_typo: its config.json does not load \(\w+: .*'n_layer'.*\); give a transformers GPT-2",
    ),
    "init_from_cut_short": (
        export_cut_short,
        ["--init-from", "{tmp}/cut_export"],
        r"init_from .*/cut_export: its weights do not load \(SafetensorError: .*\); export the run again",
    ),
    "only_damaged_checkpoints": (
        None,
        ["--resume", "auto"],
        r"out_dir .* has no intact checkpoint \(.*step-00000002 is damaged "
        r"\(model.safetensors does not load \(SafetensorError: .*\)\); restore one, or start afresh with --resume",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_gives_one_clear_error_and_damages_nothing(workspace, tmp_path, case):
    data, run_dir = workspace
    (tmp_path / "bad.yaml").write_text("preset: tiny-cpu\nlr: [1e-3, \n")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (tmp_path / "gpt2_typo").mkdir()
    (tmp_path / "gpt2_typo" / "config.json").write_text('{"model_type": "gpt2", "n_layer": "x"}')
    (tmp_path / "gpt2_32k").mkdir()
    (tmp_path / "gpt2_32k" / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 32000}')
    damage, args, message = CASES[case]
    if damage:
        damage(data)
    before = snapshot(data, run_dir)
    args = [a.format(tmp=tmp_path) for a in args]
    stderr = fails(run_dir, data, *args)
    assert stderr.startswith("error: ")
    assert re.search(message, stderr), stderr
    assert snapshot(data, run_dir) == before


def test_a_hub_token_the_push_would_fail_with_stops_the_run_before_training(workspace, tmp_path):
    """--push-to-hub with a token the Hub refuses (expired, revoked): the Hub is asked at start-up (here a local
    stand-in for it, HF_ENDPOINT), and the run stops then with one line, not after training at the push."""
    data, run_dir = workspace
    before = snapshot(data, run_dir)
    with hub_endpoint(status=401) as (endpoint, asked):
        env = {**os.environ, "HF_TOKEN": "hf_expired", "HF_ENDPOINT": endpoint}
        stderr = fails(run_dir, data, "--export-hf", "true", "--push-to-hub", "you/tiny-books", env=env)
    assert [r["authorization"] for r in asked] == ["Bearer hf_expired"]
    assert stderr.startswith("error: the Hub refused the Hugging Face token in HF_TOKEN for --push-to-hub "), stderr
    assert stderr.count("\n") == 1 and stderr.endswith("`hf auth login` or set HF_TOKEN\n"), stderr
    assert snapshot(data, run_dir) == before


def test_a_hub_id_out_of_reach_stops_at_once_with_one_line(workspace, tmp_path):
    """--init-from gpt2 where the Hub cannot be reached (here its address, HF_ENDPOINT, a port nobody listens on) and
    gpt2 is not in the cache (an empty HF_HOME): huggingface_hub retried for ~30 s, eleven lines of warnings above
    our error. Now one request, and the error is the one line."""
    data, run_dir = workspace
    with socket.socket() as closed:  # bound, never listening: a connection to it is refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf_home")}
        started = time.monotonic()
        stderr = fails(run_dir, data, "--init-from", "gpt2", env=env)
    assert time.monotonic() - started < 20
    assert stderr.startswith(f"error: init_from gpt2: cannot reach {endpoint} (") and stderr.count("\n") == 1, stderr
    assert stderr.endswith("(hf download gpt2 --local-dir DIR) and give --init-from DIR\n"), stderr


def test_make_train_ends_with_our_line_not_the_launchers_traceback(tmp_path):
    """The launch `make train` runs, given bad input: our `error:` line is the only thing on stderr after the
    precision line (accelerate's `-q`; the threads named, or accelerate warns on a machine of several cores, in a
    shell without OMP_NUM_THREADS, that it picked them), and every launch under scripts/ passes -q too."""
    recipe = make_train_recipe(args=f"--out-dir {shlex.quote(str(tmp_path / 'run'))} --lr -1")  # make train ARGS=
    assert "accelerate launch -q" in recipe, recipe
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # a user's shell; conftest sets it
    result = run(["bash", "-c", recipe], expect_rc=1, timeout=300, env=env)
    precision, error = result.stderr.strip().splitlines()  # the precision make train picked (its first line)
    assert precision.startswith("precision: ") and error == "error: lr must be > 0, got -1.0", result.stderr[-3000:]
    launches = r"^\s*(?:accelerate launch|python -m training.launch) [^\n]*"  # the latter: multi-node SLURM
    for script in (REPO / "scripts").glob("*.sh"):
        for launch in re.findall(launches, script.read_text(), re.M):
            words = launch.split()
            assert words[2 if words[0] == "accelerate" else 3] == "-q", f"{script.name}: {launch}"


def test_a_compiling_launch_on_a_machine_without_a_cpp_compiler_stops_at_start_up(workspace):
    """cpu.yaml compiles with inductor, which builds C++ kernels: without a compiler (CXX names none) the run stops
    before anything is written, with one line, not inductor's traceback at the first step."""
    data, run_dir = workspace
    before = snapshot(data, run_dir)
    env = {**os.environ, "CXX": "/nowhere/g++"}
    cmd = train_cmd("cpu.yaml", run_dir, data, "--resume", "never", launch_args=["-q"])
    # the launcher and the run in copies of a server whose imports saw this CXX (inductor reads it as it loads):
    # testkit.WARM's would start two fresh interpreters for it
    with WarmLaunches(env=env) as warm:
        result = run(cmd, expect_rc=1, timeout=300, env=env, warm=warm)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: torch.compile builds C++ kernels on the CPU, and this machine has no working C++ "
                           "compiler (/nowhere/g++): install one"), result.stderr[-3000:]  # fmt: skip
    assert snapshot(data, run_dir) == before


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("nowhere.yaml", r"error: accelerate launch: The passed configuration file `.*nowhere.yaml` does not exist"),
        # accelerate refuses it where neither Transformer Engine nor torchao is installed, the run where one is
        ("fp8.yaml", r"error: .*(FP8 is not available on this machine|mixed_precision: fp8)"),
        # tracebacks before: PyYAML's, and accelerate's loader's on a list
        ("broken.yaml", r"error: accelerate launch: the launch YAML .*broken.yaml cannot be read \(ParserError: "),
        ("list.yaml", r"error: accelerate launch: the launch YAML .*list.yaml cannot be read \(AttributeError: "),
    ],
)
def test_what_accelerate_refuses_before_the_run_is_one_line_from_the_launcher(tmp_path, yaml, message):
    """`python -m training.launch` (the cluster scripts' launcher): what accelerate's launcher itself refuses, before
    any process of the run starts, is its message as one `error:` line, not its traceback."""
    (tmp_path / "fp8.yaml").write_text(
        "distributed_type: 'NO'\nmixed_precision: fp8\nuse_cpu: true\nnum_processes: 1\n"
    )
    (tmp_path / "broken.yaml").write_text("compute_environment: [\n")
    (tmp_path / "list.yaml").write_text("- distributed_type: 'NO'\n")
    cmd = [sys.executable, "-m", "training.launch", "-q", "--config_file", str(tmp_path / yaml), str(TRAIN_ACCEL)]
    result = run(cmd, expect_rc=1)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert re.match(message, result.stderr.strip().splitlines()[-1]), result.stderr[-3000:]


# accelerate config's multi-CPU answer for 2 processes on this machine, as it writes it
MULTI_CPU_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


@pytest.mark.parametrize(
    ("yaml", "launch_args"),
    [("multi_cpu.yaml", []), ("cpu.yaml", ["--num_processes", "2"])],
    ids=["accelerate config's multi-CPU answer", "--num_processes 2 over a one-process YAML"],
)
def test_a_launch_of_several_processes_that_starts_one_stops_at_start_up(prepared_books, tmp_path, yaml, launch_args):
    """accelerate's one-process launcher starts a MULTI_CPU (or NO) YAML as one process whatever its num_processes
    says (several only through mpirun): the run trained alone, its first line saying `1 process(es)` and nothing of
    the 2 asked for. It stops before anything is written, with one line saying what starts the processes asked for."""
    (tmp_path / "multi_cpu.yaml").write_text(MULTI_CPU_YAML)
    run_dir = tmp_path / "run"
    cmd = train_cmd(str(tmp_path / yaml) if yaml == "multi_cpu.yaml" else yaml, run_dir, prepared_books,
                    "--max-steps", "1", "--eval-interval", "0", "--micro-batch-size", "4", "--total-batch-tokens",
                    "256", launch_args=["-q", *launch_args])  # fmt: skip
    failed = run(cmd, expect_rc=1, timeout=300)
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.splitlines()[-1].startswith(
        "error: the launch asks for several processes (num_processes or num_machines above 1: accelerate set "
        "MASTER_ADDR for them), but accelerate launch started one"
    ), failed.stderr[-3000:]
    assert "cpu_ddp2.yaml --num_processes N" in failed.stderr.splitlines()[-1]
    assert not run_dir.exists()


def test_a_one_process_launch_in_a_job_that_exports_master_addr_trains(prepared_books, tmp_path):
    """A one-replica Kubernetes PyTorchJob gives its one process MASTER_ADDR, MASTER_PORT, WORLD_SIZE 1 and RANK 0 (an
    sbatch script may export the first two): a one-process launch there is not the launch above, whose MASTER_ADDR
    accelerate set, and trains. Its launcher starts fresh, not as a warm copy: the run compares its MASTER_ADDR with
    the environment the launcher started with."""
    run_dir = tmp_path / "run"
    cmd = train_cmd("cpu_eager.yaml", run_dir, prepared_books, "--max-steps", "1", "--eval-interval", "0",
                    "--micro-batch-size", "4", "--total-batch-tokens", "256", launch_args=["-q"])  # fmt: skip
    job = {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "23456", "WORLD_SIZE": "1", "RANK": "0"}
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, **job}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [c.name for c in list_checkpoints(run_dir)] == ["step-00000001"]


def test_the_first_rank_to_fail_prints_the_line_when_torchrun_stops_rank_0_first(tmp_path):
    """Every rank reaches the same bad input, but torchrun stops the rest, rank 0 too, as soon as one fails (an
    8-GPU YAML on a 1-GPU machine: rank 4 was first there): the first rank to report prints the line, once."""
    script = tmp_path / "bad_input.py"
    script.write_text(
        "import os, sys, time\n"
        "from modeling.runtime import report_error\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(120)  # stopped by torchrun once rank 1 has failed\n"
        "report_error('error: the same bad input on every rank')\n"
        "sys.exit(1)\n"
    )
    yaml = str(REPO / "accelerate_configs" / "cpu_ddp2.yaml")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file", yaml, str(script)]
    result = run(cmd, expect_rc=1, timeout=100, env=os.environ | {"PYTHONPATH": str(REPO)})
    assert result.stderr.splitlines().count("error: the same bad input on every rank") == 1, result.stderr[-3000:]


def test_a_run_killed_by_a_signal_is_one_line_from_the_launcher(tmp_path):
    """The kernel's out-of-memory killer ends a run with SIGKILL, so the run prints nothing: `python -m
    training.launch` (one process) says how it ended, last, with the shell's status for it."""
    script = tmp_path / "killed.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    yaml = str(REPO / "accelerate_configs" / "cpu_eager.yaml")
    result = run([sys.executable, "-m", "training.launch", "-q", "--config_file", yaml, str(script)], expect_rc=137)
    assert (
        result.stderr.splitlines()[-1]
        == "error: the run ended with signal SIGKILL; its output above says how far it got"
    )


def test_a_folder_where_the_run_writes_a_file_stops_it_at_start_up(prepared_books, tmp_path):
    """A folder named samples.txt in the run folder: found when the first sample is written, it stopped the run after
    its training; the start-up names it in one line before any step, and the same command then trains."""
    run_dir = tmp_path / "run"
    (run_dir / "samples.txt").mkdir(parents=True)
    args = ["--max-steps", "2", "--checkpoint-interval", "0", "--sample-interval", "2", "--eval-interval", "0",
            "--micro-batch-size", "4", "--total-batch-tokens", "256"]  # fmt: skip
    cmd = train_cmd(None, run_dir, prepared_books, *args)
    failed = run(cmd, expect_rc=1, timeout=300)
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert failed.stderr.splitlines()[-1] == (
        f"error: {run_dir / 'samples.txt'} is a folder where this run writes a file: move it aside, then run the same "
        "command again"
    )
    metrics = run_dir / "metrics.jsonl"  # no step trained: at most the launch's own rows
    assert list_checkpoints(run_dir) == []
    assert not metrics.exists() or not any("train_loss" in r for r in read_metrics(metrics))
    (run_dir / "samples.txt").rmdir()
    done = run(cmd)
    assert "--- step 2 ---" in (run_dir / "samples.txt").read_text() and (run_dir / "loss.png").is_file(), done.stdout


def test_a_run_started_from_a_folder_with_its_vocab_padded_stops_its_resume_in_one_line(workspace, tmp_path):
    """Runs started with --init-from before it kept the folder's 50,257 ids saved 50,304 vocab rows; resumed now, the
    checkpoint no longer fits the model: one line that says how to go on from its weights, not a traceback."""
    data, run_dir = workspace
    folder = export_hf(GPT(TINY_MODEL), tmp_path / "folder", gpt2_vocab_and_merges())
    args = ["--init-from", str(folder), "--max-steps", "2", "--checkpoint-interval", "2", "--eval-interval", "0",
            "--micro-batch-size", "4", "--total-batch-tokens", "128"]  # fmt: skip
    run(train_cmd(None, run_dir, data, "--resume", "never", *args), timeout=300)
    checkpoint = list_checkpoints(run_dir)[-1]
    weights = load_file(checkpoint / "model.safetensors")  # as such a run saved it: the tied matrix padded
    key = next(k for k in weights if k.endswith("wte.weight"))
    padding = weights[key].new_zeros(PADDED_VOCAB_SIZE - REAL_VOCAB_SIZE, TINY_MODEL.n_embd)
    weights[key] = torch.cat([weights[key], padding])
    save_file(weights, checkpoint / "model.safetensors")
    write_manifest(checkpoint)
    result = run(train_cmd(None, run_dir, data, *args, "--max-steps", "4"), expect_rc=1, timeout=300)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: .*step-00000002: its weights do not fit this run's model \(.*50304.*\).*python -m "
                    r"training\.export", last), last  # fmt: skip
