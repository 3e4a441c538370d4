"""TrainConfig: precedence defaults < YAML < flags, and one clear error per bad input."""

import pytest

from training.config import ConfigError, TrainConfig, grad_accum_steps, load_yaml, parse_config


def test_precedence_defaults_then_yaml_then_flags(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("micro_batch_size: 4\nlr: 1\npreset: tiny-cpu\n")
    cfg, print_only = parse_config(["--config", str(run_config), "--micro-batch-size", "2"])
    assert not print_only
    assert cfg.micro_batch_size == 2  # flag beats file
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # file beats default, int accepted for float
    assert cfg.preset == "tiny-cpu"
    assert cfg.weight_decay == TrainConfig().weight_decay  # untouched default


def test_flags_accept_both_spellings_and_optional_none():
    cfg, _ = parse_config(["--max_tokens", "5000", "--peak-tflops", "none", "--export-hf", "false"])
    assert cfg.max_tokens == 5000 and cfg.peak_tflops is None and cfg.export_hf is False


def test_token_budget_sets_steps():
    assert TrainConfig(total_batch_tokens=1000, max_tokens=2500).total_steps() == 3
    assert TrainConfig(max_steps=7).total_steps() == 7


def test_unknown_yaml_key_names_it_and_suggests(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("micro_bach_size: 4\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'micro_bach_size'.*did you mean 'micro_batch_size'"):
        load_yaml(run_config)


def test_unknown_flag_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"'warmup-step'.*did you mean 'warmup_steps'"):
        parse_config(["--warmup-step", "3"])


def test_malformed_yaml_says_where(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("lr: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_yaml(run_config)


def test_wrong_type_in_yaml(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("micro_batch_size: four\n")
    with pytest.raises(ConfigError, match="micro_batch_size must be int"):
        load_yaml(run_config)


def test_bad_values_rejected():
    with pytest.raises(ConfigError, match="micro_batch_size must be > 0"):
        TrainConfig(micro_batch_size=0)
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        TrainConfig(min_lr_ratio=2.0)


def test_grad_accum_from_token_budget():
    assert grad_accum_steps(524_288, 16, 1024, 4) == 8
    with pytest.raises(ConfigError, match=r"not a multiple of .* 16 × 1024 × 3 = 49152"):
        grad_accum_steps(524_288, 16, 1024, 3)


def test_every_run_config_in_repo_loads():
    from pathlib import Path

    paths = sorted(Path(__file__).parents[1].joinpath("configs").glob("*.yaml"))
    assert paths, "configs/ holds the run configs"
    for path in paths:
        TrainConfig(**load_yaml(path))
