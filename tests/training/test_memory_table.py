"""The memory table's arithmetic against a hand computation for gpt2-124m on 8 GPUs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from modeling.config import PRESETS, get_preset
from modeling.gpt import GPT
from testkit import REPO
from training.memory_table import GIB, activation_bytes, main, markdown_table, param_counts, state_bytes
from training.optim import build_optimizer

# 124,475,904 = wte 50,304×768 + wpe 1,024×768 + 12 blocks × (12·768² + 13·768) + ln_f 2×768 (head tied to wte)
P = 124_475_904


def test_parameter_count_from_the_preset():
    assert P == 50_304 * 768 + 1_024 * 768 + 12 * (12 * 768**2 + 13 * 768) + 2 * 768
    assert param_counts(get_preset("gpt2-124m"))[0] == P
    # the meta-device count is the real model's
    assert param_counts(get_preset("tiny-cpu"))[0] == GPT(get_preset("tiny-cpu")).num_params()


@pytest.mark.parametrize(
    "engine, weights, grads, optimizer",
    [
        # DDP: fp32 weights 4 B, fp32 grads 4 B, AdamW moments 8 B, all on every GPU
        ("DDP", 497_903_616, 497_903_616, 995_807_232),
        # FSDP2: the same 16 B per parameter, each part split 8 ways
        ("FSDP2", 62_237_952, 62_237_952, 124_475_904),
        # ZeRO-2: bf16 weights 2 B whole; bf16 grads 2 B and fp32 master + moments 12 B split 8 ways
        ("ZeRO-2", 248_951_808, 31_118_976, 186_713_856),
        # ZeRO-3: 2 + 2 + 12 B, all split 8 ways
        ("ZeRO-3", 31_118_976, 31_118_976, 186_713_856),
    ],
)
def test_state_bytes_per_gpu_by_hand(engine, weights, grads, optimizer):
    got = state_bytes(P, engine, gpus=8)
    assert got == {"weights": weights, "grads": grads, "optimizer": optimizer, "total": weights + grads + optimizer}


def test_one_gpu_every_engine_holds_16_bytes_per_parameter():
    for engine in ("DDP", "FSDP2", "ZeRO-2", "ZeRO-3"):
        assert state_bytes(P, engine, gpus=1)["total"] == 16 * P


def test_activations_by_hand():
    # 36 B × T 1,024 × B 16 × C 768 × 12 blocks
    assert activation_bytes(get_preset("gpt2-124m"), micro_batch_size=16) == 5_435_817_984
    # checkpointed: each block's fp32 input (4 B) kept, one block (36 B) recomputed at a time
    tokens_x_channels = 1024 * 16 * 768
    want = 4 * tokens_x_channels * 12 + 36 * tokens_x_channels
    assert activation_bytes(get_preset("gpt2-124m"), micro_batch_size=16, checkpointed=True) == want


@pytest.mark.parametrize("muon", [True, False], ids=["muon", "adamw"])
def test_the_optimizer_state_is_what_the_optimizers_hold_after_a_step(muon):
    """The optimizer column against the optimizer itself (training.optim's, as a run builds it): the bytes of its
    state tensors after a step, Muon's momentum buffers and AdamW's moments (the step counters left out)."""
    config = get_preset("tiny-cpu")
    model = GPT(config)
    optimizer = build_optimizer(model.optimizer_groups(0.1, muon=muon), lr=1e-3, betas=(0.9, 0.95), device_type="cpu")
    _, loss = model(torch.randint(0, 50_257, (2, 16)), torch.randint(0, 50_257, (2, 16)))
    loss.backward()
    optimizer.step()
    held = sum(t.nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim())
    params, muon_count = param_counts(config)
    want = state_bytes(params, "DDP", gpus=1, muon=muon_count if muon else 0)["optimizer"]
    assert held == want
    if muon:  # the blocks' matrices: most of tiny-cpu's parameters, as of GPT-2's
        assert 0 < muon_count < params


def test_muon_is_refused_where_the_engine_shards_the_matrices():
    with pytest.raises(ValueError, match="FSDP2 shards each matrix and Muon needs whole ones"):
        state_bytes(P, "FSDP2", gpus=8, muon=1)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_cli_prints_the_markdown_rows(capsys, optimizer):
    main(["--presets", "gpt2-124m", "--gpus", "8", "--micro-batch-size", "16", "--optimizer", optimizer])
    out = capsys.readouterr().out
    header = "| model | params | engine | weights | grads | optimizer | states total | activations | checkpointed |"
    assert header in out
    # AdamW: 8 B a parameter; Muon: 4 B for the blocks' matrices (12 × 12 · 768²), AdamW's 8 for the rest
    moments = 8 * P if optimizer == "adamw" else 8 * P - 4 * 12 * 12 * 768**2
    ddp_total = (8 * P + moments) / GIB  # 1.855 GiB under AdamW
    assert f"| gpt2-124m | 124.5M | DDP | 0.46 | 0.46 | {moments / GIB:.2f} | {ddp_total:.2f} | 5.1 | 1.0 |" in out
    assert "| gpt2-124m | 124.5M | FSDP2 | 0.06 | 0.06 | 0.12 | 0.23 | 5.1 | 1.0 |" in out  # AdamW either way
    assert "| gpt2-124m | 124.5M | ZeRO-3 | 0.03 | 0.03 | 0.17 | 0.23 | 5.1 | 1.0 |" in out
    assert out.count("| gpt2-124m |") == 4


def test_cli_rejects_unknown_presets(capsys):
    with pytest.raises(SystemExit, match="^error: Unknown model preset 'gpt2-125m'. Did you mean 'gpt2-124m'?"):
        main(["--presets", "gpt2-125m"])


def test_cli_takes_each_preset_once_and_refuses_none(capsys):
    """--presets '' printed a table of no rows; a preset named twice, its rows twice."""
    main(["--presets", "tiny-cpu, tiny-cpu,"])
    assert capsys.readouterr().out.count("| tiny-cpu |") == 4  # one row per engine
    with pytest.raises(SystemExit):
        main(["--presets", ","])
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "python -m training.memory_table: error: --presets names no preset; give a comma list of: gpt2-124m, "
        )
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--gpus", "0"], "argument --gpus: must be at least 1, got 0"),
        (["--micro-batch-size", "-2"], "argument --micro-batch-size: must be at least 1, got -2"),
        (["--gpus", "eight"], "argument --gpus: expected a whole number, got 'eight'"),
    ],
)
def test_cli_bad_counts_are_argparses_line_naming_the_flag(capsys, argv, line):
    """As every entry point's counts (data_prep.at_least); it said '--gpus and --micro-batch-size must be >= 1'
    whichever was wrong."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and err[-1] == f"python -m training.memory_table: error: {line}"


def test_the_docs_table_is_the_command_it_names():
    """docs/distributed.md shows `python -m training.memory_table --optimizer adamw` (its text says so): the same
    rows."""
    table = markdown_table(
        {name: get_preset(name) for name in PRESETS}, gpus=8, micro_batch_size=16, optimizer="adamw"
    ).strip()
    assert table in (REPO / "docs" / "distributed.md").read_text()


def rows(out: str, name: str) -> list[str]:
    """The table's figures for one model, one row per engine (the model's name left out)."""
    return [line.removeprefix(f"| {name} |") for line in out.splitlines() if line.startswith(f"| {name} |")]


def test_a_shape_of_your_own_is_sized_as_train_accel_sets_it(capsys):
    """--n-layer/--n-head/--n-embd/--block-size, as train_accel.py takes them, over its default preset: the figures
    are the module's own for that GPTConfig (the command took --presets only before)."""
    main(["--n-layer", "24", "--n-head", "16", "--n-embd", "1024", "--block-size", "2048", "--micro-batch-size", "16"])
    out = capsys.readouterr().out
    shape = dataclasses.replace(get_preset("gpt2-124m"), n_layer=24, n_head=16, n_embd=1024, block_size=2048)
    name = "gpt2-124m with n_layer 24, n_head 16, n_embd 1024, block_size 2048"
    assert rows(out, name) == rows(markdown_table({name: shape}, gpus=8, micro_batch_size=16), name)
    assert len(rows(out, name)) == 4
    assert "| 355.9M | DDP |" in out and "| 27.0 | 4.1 |" in out  # 36 B × 2,048 × 16 × 1,024 × 24 = 27.0 GiB


def test_a_preset_given_as_flags_is_the_presets_row(capsys):
    main(["--presets", "gpt2-350m", "--gpus", "4"])
    preset = rows(capsys.readouterr().out, "gpt2-350m")
    main(["--presets", "tiny-cpu", "--n-layer", "24", "--n-head", "16", "--n-embd", "1024", "--block-size", "1024"])
    flags = rows(capsys.readouterr().out, "tiny-cpu with n_layer 24, n_head 16, n_embd 1024, block_size 1024")
    assert flags != preset  # 8 GPUs there, 4 here
    main(
        ["--presets", "tiny-cpu", "--n-layer", "24", "--n-head", "16", "--n-embd", "1024", "--block-size", "1024"]
        + ["--gpus", "4"]
    )
    flags = rows(capsys.readouterr().out, "tiny-cpu with n_layer 24, n_head 16, n_embd 1024, block_size 1024")
    assert flags == preset and len(preset) == 4


def test_a_run_configs_shape(tmp_path, capsys):
    """--config reads a run config as training does: its preset with its shape keys, flags over them."""
    path = tmp_path / "run.yaml"
    path.write_text("preset: gpt2-350m\nn_layer: 6\nblock_size: 512\n")
    main(["--config", str(path), "--n-embd", "512", "--n-head", "8"])
    name = "gpt2-350m with n_layer 6, n_head 8, n_embd 512, block_size 512"
    shape = dataclasses.replace(get_preset("gpt2-350m"), n_layer=6, n_head=8, n_embd=512, block_size=512)
    assert rows(capsys.readouterr().out, name) == rows(markdown_table({name: shape}, 8, 16), name)
    main(["--config", str(REPO / "configs" / "gpt2_774m_pg19.yaml")])
    assert len(rows(capsys.readouterr().out, "gpt2-774m")) == 4


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--n-head", "7", "--n-embd", "1000"],
            "error: n_embd 1000 is not divisible by n_head 7: every head takes n_embd / n_head channels; give e.g. "
            "--n-head 8 (heads of 125) or an --n-embd that 7 divides",
        ),
        (["--n-layer", "0"], "error: n_layer must be >= 1 (or null for the default), got 0"),
    ],
)
def test_a_bad_shape_is_trainings_one_line(flags, line):
    """The line train_accel.py ends with for the same flags, last on screen, no traceback."""
    for command in (["-m", "training.memory_table"], ["train_accel.py", "--print-config"]):
        done = subprocess.run([sys.executable, *command, *flags], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 1
        assert done.stderr.strip().splitlines()[-1] == line
        assert "Traceback" not in done.stderr and not done.stdout


def test_a_run_configs_micro_batch_and_optimizer(tmp_path, capsys):
    """A run config sized at the micro-batch and optimizer it trains with (gpt2_1558m_pg19.yaml: 8), the flags over
    them; micro_batch_size auto is decided at start-up from the GPU's free memory, so the table takes its default."""
    main(["--config", str(REPO / "configs" / "gpt2_1558m_pg19.yaml")])
    assert "at micro-batch 8 × full context" in capsys.readouterr().out
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny-cpu\nmicro_batch_size: auto\noptimizer: adamw\n")
    main(["--config", str(path)])
    assert "bf16 mixed precision, AdamW; activations (estimated, the same for every engine) at micro-batch 16 " in (
        capsys.readouterr().out
    )
    main(["--config", str(path), "--micro-batch-size", "4", "--optimizer", "muon"])
    assert (
        "Muon + AdamW under DDP, AdamW sharded; activations (estimated, the same for every engine) at micro-batch 4 "
        in (capsys.readouterr().out)
    )
