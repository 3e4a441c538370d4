"""micro_batch_size auto (training.micro_batch): parsed from YAML and flags, the divisibility choice, the estimate
against the H100's measured peaks, and the CPU path through the run's own setup()."""

from __future__ import annotations

import pytest

from modeling.config import get_preset
from training.config import ConfigError, TrainConfig, load_yaml, parse_config
from training.loop import setup
from training.memory_table import GIB
from training.micro_batch import CPU_DEFAULT, estimated_peak_bytes, largest_micro_batch, process_state_bytes


def test_auto_parses_from_yaml_and_flags_and_anything_else_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("micro_batch_size: auto\n")
    assert TrainConfig(**load_yaml(path)).micro_batch_size == "auto"
    assert parse_config(["--config", str(path)])[0].micro_batch_size == "auto"
    assert parse_config(["--micro-batch-size", "auto"])[0].micro_batch_size == "auto"
    assert parse_config(["--micro-batch-size", "32"])[0].micro_batch_size == 32
    path.write_text("micro_batch_size: big\n")
    with pytest.raises(ConfigError, match="micro_batch_size must be a whole number or auto, got 'big'"):
        load_yaml(path)
    path.write_text("micro_batch_size: 2.5\n")
    with pytest.raises(ConfigError, match="micro_batch_size must be a whole number or auto, got 2.5"):
        load_yaml(path)
    with pytest.raises(ConfigError, match="micro_batch_size must be a whole number >= 1 or auto, got 'Auto'"):
        TrainConfig(micro_batch_size="Auto")
    with pytest.raises(ConfigError, match="micro_batch_size must be >= 1 or auto, got 0"):
        TrainConfig(micro_batch_size=0)


@pytest.mark.parametrize(
    "sequences, cap, fits_up_to, want",
    [
        (128, 64, 1024, 64),  # gpt2-124m's 131,072 tokens at T 1024 on 1 GPU: the cap
        (16, 64, 1024, 16),  # the same on 8 GPUs: all of a process's sequences
        (96, 64, 1024, 32),  # 64 does not divide 96
        (12, 8, 1024, 4),  # the CPU default, 8, does not divide 12
        (7, 64, 1024, 1),  # odd: one sequence at a time
        (128, 64, 40, 32),  # 64 would not fit
        (128, 64, 0, 1),  # nothing fits: 1, the caller's out-of-memory slicing is the last resort
    ],
)
def test_largest_power_of_two_that_divides_and_fits(sequences, cap, fits_up_to, want):
    assert largest_micro_batch(sequences, cap, lambda size: size <= fits_up_to) == want


@pytest.mark.parametrize("micro_batch, measured_gib", [(16, 9.92), (32, 18.15)])
def test_the_estimate_covers_the_h100s_measured_peak_with_little_to_spare(micro_batch, measured_gib):
    """gpt2-124m, one process, bf16, compiled (the full logits): the ladder's rung 11 peaks on the H100."""
    config = get_preset("gpt2-124m")
    states = process_state_bytes(config, "DDP", 1, muon=False)  # the ladder's AdamW
    estimate = estimated_peak_bytes(config, micro_batch, states, False, True) / GIB
    assert measured_gib <= estimate <= 1.1 * measured_gib, estimate


def test_auto_on_the_cpu_is_the_cpu_default_that_divides_the_step(prepared_books, tmp_path, capsys):
    """tiny-cpu at 12 sequences a step: 8 does not divide them, 4 does (3 accumulation); said in one line. (And
    fp8_head, asked for, stays off on the CPU with one line saying so.)"""
    assert CPU_DEFAULT == 8
    cfg = TrainConfig(
        preset="tiny-cpu", data_dir=str(prepared_books), out_dir=str(tmp_path / "run"), micro_batch_size="auto",
        total_batch_tokens=12 * 64, max_steps=2, peak_tflops=1.0, export_hf=False, fp8_head=True,
    )  # fmt: skip
    run = setup(cfg)
    out = capsys.readouterr().out
    assert "note: fp8_head is off on cpu: FP8 matmuls need a CUDA GPU of compute capability 8.9" in out
    assert not run.accelerator.unwrap_model(run.model).fp8_head
    assert (run.cfg.micro_batch_size, run.grad_accum, run.train_loader.micro_batch_size) == (4, 3, 4)
    assert "micro-batch: auto -> 4 (the CPU default on cpu, not probed; accumulation 3)" in out
    assert "micro_batch_size: 4\n" in (tmp_path / "run" / "config.yaml").read_text()
