"""TrainConfig: the defaults are the recipe, precedence defaults < YAML < flags, renamed keys, and one clear error
per bad input."""

import dataclasses
import re
import subprocess
import sys

import pytest

from testkit import REPO
from training.config import (
    RENAMED,
    ConfigError,
    TrainConfig,
    build_parser,
    config_to_yaml,
    grad_accum_steps,
    load_yaml,
    parse_config,
)


def test_precedence_defaults_then_yaml_then_flags(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("micro_batch_size: 4\nlr: 1\npreset: tiny-cpu\n")
    cfg, print_only = parse_config(["--config", str(run_config), "--micro-batch-size", "2"])
    assert not print_only
    assert cfg.micro_batch_size == 2  # flag beats file
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # file beats default, int accepted for float
    assert cfg.preset == "tiny-cpu"
    assert cfg.weight_decay == TrainConfig().weight_decay  # untouched default


def test_no_argument_gives_the_recipe_and_records_what_was_set_explicitly(tmp_path):
    """The bare command trains GPT-2 124M with Muon + AdamW under wsd; `explicit` holds exactly the keys the YAML
    or the flags gave (an engine that cannot run Muon replaces only a default optimizer)."""
    cfg, print_only = parse_config(["--print-config"])
    assert print_only and cfg == TrainConfig() and cfg.explicit == frozenset()
    assert (cfg.preset, cfg.optimizer, cfg.lr_schedule, cfg.muon_lr, cfg.lr) == ("gpt2-124m", "muon", "wsd", 0.02, 6e-4)
    run_config = tmp_path / "run.yaml"
    run_config.write_text("optimizer: muon\n")
    cfg, _ = parse_config(["--config", str(run_config), "--lr-schedule", "cosine"])
    assert cfg.explicit == {"optimizer", "lr_schedule"}
    cfg, _ = parse_config(["--optimizer", "adamw", "--lr-schedule", "cosine"])  # GPT-2's recipe, one flag away
    assert (cfg.optimizer, cfg.lr_schedule, cfg.explicit) == ("adamw", "cosine", {"optimizer", "lr_schedule"})


@pytest.mark.slow
def test_print_config_shows_the_shape_the_run_takes_and_reads_back_as_the_same_run(tmp_path):
    """--print-config printed n_head: null where the run trains the preset's 2 heads. Each shape field left to the
    preset is shown with the preset's value in a comment, so the printed YAML, given back as --config, is the same
    run (the same model, named as before)."""
    flags = ["--config", "configs/tiny_cpu.yaml", "--n-layer", "3"]
    done = subprocess.run(
        [sys.executable, "train_accel.py", *flags, "--print-config"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:5] == [
        "preset: tiny-cpu",
        "n_layer: 3",
        "n_head: null  # tiny-cpu's: 2",
        "n_embd: null  # tiny-cpu's: 64",
        "block_size: null  # tiny-cpu's: 64",
    ]
    printed = tmp_path / "printed.yaml"
    printed.write_text(done.stdout)
    again, _ = parse_config(["--config", str(printed)])
    cfg, _ = parse_config(flags)
    assert (
        again == cfg and again.model_config() == cfg.model_config() and again.model_name() == "tiny-cpu with n_layer 3"
    )
    init = subprocess.run(
        [sys.executable, "train_accel.py", "--init-from", "gpt2", "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )  # its shape is in its config.json, on the Hub: not looked up to print the config
    assert init.returncode == 0 and "n_embd: null  # init_from's\n" in init.stdout, init.stderr


@pytest.mark.parametrize("old, new", RENAMED.items())
def test_a_renamed_key_still_works_with_one_warning_line(tmp_path, capsys, monkeypatch, old, new):
    monkeypatch.delenv("RANK", raising=False)
    cfg, _ = parse_config([f"--{old.replace('_', '-')}", "7"])
    assert getattr(cfg, new) == 7 and cfg.explicit == {new}
    dashed = f"--{old.replace('_', '-')} is now --{new.replace('_', '-')}"
    assert capsys.readouterr().err == f"warning: {dashed}; the old name still works for now, use the new one\n"
    run_config = tmp_path / "run.yaml"
    run_config.write_text(f"{old}: 9\n")
    assert getattr(TrainConfig(**load_yaml(run_config)), new) == 9
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: '{old}' in {run_config} is now '{new}';")
    monkeypatch.setenv("RANK", "1")  # the other processes of a launch stay silent
    parse_config([f"--{old}", "7"])
    assert capsys.readouterr().err == ""


def test_flags_accept_both_spellings_and_optional_none():
    cfg, _ = parse_config(["--max_tokens", "5000", "--peak-tflops", "none", "--export-hf", "false"])
    assert cfg.max_tokens == 5000 and cfg.peak_tflops is None and cfg.export_hf is False


def test_help_gives_every_fields_default():
    """--help is where a user looks for a flag's default; the flags themselves default to nothing (so that only what
    was given overrides the run-config), so each help line states the field's."""
    options = build_parser().format_help().split("\noptions:\n", 1)[1]
    entries = {e.split()[0]: " ".join(e.split()) for e in options.split("\n  --")}  # argparse wraps the lines
    for f in dataclasses.fields(TrainConfig):
        shown = f.default if f.default != "" else "''"
        assert entries[f.name.replace("_", "-")].endswith(f"(default: {shown})"), entries[f.name.replace("_", "-")]


def test_a_local_init_from_is_kept_absolute(tmp_path, monkeypatch):
    """The run's config.yaml names the folder so that export, evals and resume find it from any working folder."""
    (tmp_path / "base" / "export").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(init_from="base/export").init_from == str(tmp_path / "base" / "export")
    assert TrainConfig(init_from="gpt2").init_from == "gpt2"  # a Hub id stays one


def test_a_max_steps_flag_replaces_the_run_configs_max_tokens(tmp_path):
    """max_tokens decides the length over max_steps; a --max-steps flag on a run config that gives max_tokens (a
    short try of a PG-19 config) trained max_tokens' steps, where every other flag replaces the file's value."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("max_tokens: 20480\ntotal_batch_tokens: 1024\n")
    assert parse_config(["--config", str(run_config)])[0].total_steps() == 20
    cfg, _ = parse_config(["--config", str(run_config), "--max-steps", "3"])
    assert (cfg.total_steps(), cfg.max_tokens, cfg.explicit) == (3, None, {"max_steps", "total_batch_tokens"})
    pg19, _ = parse_config(["--config", str(REPO / "configs" / "gpt2_124m_pg19.yaml"), "--max-steps", "10"])
    assert pg19.total_steps() == 10
    both, _ = parse_config(["--config", str(run_config), "--max-steps", "3", "--max-tokens", "4096"])
    assert both.total_steps() == 4  # both as flags: max_tokens decides, as its help says


def test_a_second_run_config_is_refused_not_silently_taken_instead_of_the_first(tmp_path):
    """`--config a.yaml --config b.yaml` trained b alone (argparse keeps the last), with no word about a."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("lr: 1e-3\n")
    second.write_text("preset: tiny-cpu\n")
    with pytest.raises(ConfigError, match=rf"^--config is given 2 times \({first}, {second}\); a run takes one run"):
        parse_config(["--config", str(first), f"--config={second}"])
    assert parse_config(["--config", str(second)])[0].preset == "tiny-cpu"


def test_a_shape_of_ones_own_over_the_preset_from_the_yaml_or_the_flags(tmp_path):
    """nanoGPT's n_layer / n_head / n_embd as keys and flags, the preset giving what they leave out, and a context
    longer than the preset's for a model trained from scratch (both were refused: unknown key, and block_size over
    the preset's)."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("preset: gpt2-124m\nn_layer: 6\nn_embd: 384\n")
    cfg, _ = parse_config(["--config", str(run_config), "--n-head", "6", "--block-size", "2048"])
    shape = cfg.model_config()
    assert (shape.n_layer, shape.n_head, shape.n_embd, shape.block_size) == (6, 6, 384, 2048)
    assert shape.vocab_size == TrainConfig().model_config().vocab_size  # the rest is the preset's
    assert cfg.model_name() == "gpt2-124m with n_layer 6, n_head 6, n_embd 384"
    cfg, _ = parse_config(["--config", str(run_config)])
    assert cfg.model_config().n_head == 12  # the preset's: 384 / 12 = heads of 32
    assert "n_layer: 6\n" in config_to_yaml(cfg)  # the run's config.yaml: resume, export, evals read it back


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"n_embd": 100}, r"^n_embd 100 is not divisible by n_head 12 \(the gpt2-124m preset's\): .* --n-head 10 "),
        ({"n_head": 7}, r"^n_embd 768 \(the gpt2-124m preset's\) is not divisible by n_head 7: .* --n-head 12 "),
        (
            {"n_embd": 72, "n_head": 2, "fp8_head": True},
            r"^fp8_head needs an n_embd divisible by 16 .*, got 72: give another --n-embd, or --fp8-head false$",
        ),
        (
            {"init_from": "gpt2", "n_layer": 2},
            r"^--n-layer set the shape of a model trained from scratch, and init_from gpt2's shape is its config",
        ),
    ],
)
def test_a_shape_that_cannot_train_is_one_line_before_anything_runs(values: dict, problem: str):
    """At config time (--print-config too), not at the model's build: each names the flags to change. The Hub id is
    refused before it is looked up."""
    with pytest.raises(ConfigError, match=problem):
        TrainConfig(**values)


def test_token_budget_sets_steps():
    assert TrainConfig(total_batch_tokens=1000, max_tokens=2500).total_steps() == 3
    assert TrainConfig(max_steps=7).total_steps() == 7
    # resumed at step 4, whose steps held 4 × 500 tokens, now 1000 a step: the steps that bring them to 2500
    assert TrainConfig(total_batch_tokens=1000, max_tokens=2500).total_steps(step=4, tokens_applied=2000) == 5
    assert TrainConfig(total_batch_tokens=250, max_tokens=2500).total_steps(step=4, tokens_applied=2000) == 6
    assert TrainConfig(total_batch_tokens=1000, max_tokens=2500).total_steps(step=4, tokens_applied=3000) == 4
    assert TrainConfig(max_steps=7).total_steps(step=4, tokens_applied=2000) == 7


def test_unknown_yaml_key_names_it_and_suggests(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("micro_bach_size: 4\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'micro_bach_size'.*did you mean 'micro_batch_size'"):
        load_yaml(run_config)


def test_unknown_flag_names_it_and_suggests_the_flag_to_type():
    """A mistyped flag is answered with the flag as typed on the command line, not the YAML key's spelling."""
    for argv, said in (
        (["--warmup-step", "3"], "'--warmup-step' on the command line; did you mean --warmup-steps?"),
        (["--max-step=30"], "'--max-step' on the command line; did you mean --max-steps?"),
        (["--zzz", "1"], "'--zzz' on the command line; `python train_accel.py --help` lists them"),
    ):
        with pytest.raises(ConfigError) as err:
            parse_config(argv)
        assert str(err.value) == f"unknown flag {said}"


def test_a_run_config_that_is_no_file_says_which(tmp_path):
    with pytest.raises(ConfigError, match=r"^run config .* is a folder; give a YAML file \(configs/ holds examples\)$"):
        load_yaml(tmp_path)
    with pytest.raises(ConfigError, match=r"^run config .*nowhere.yaml does not exist; give a YAML file"):
        load_yaml(tmp_path / "nowhere.yaml")


def test_malformed_yaml_says_where(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("lr: [1, 2\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_yaml(run_config)


def test_a_key_given_twice_is_one_error_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two `lr:` lines without a word: an edit that seemed to change the lr did not."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("lr: 1e-3\nseed: 2\nlr: 2e-3\n")
    with pytest.raises(ConfigError, match=r"at line 3, column 1: key 'lr' is given twice \(lines 1 and 3\); keep one$"):
        load_yaml(run_config)


def test_wrong_type_in_yaml(tmp_path):
    run_config = tmp_path / "run.yaml"
    run_config.write_text("max_steps: four\n")
    with pytest.raises(ConfigError, match="max_steps must be a whole number, got 'four' \\(str\\)"):
        load_yaml(run_config)


def test_a_whole_number_in_e_notation_is_the_number_written(tmp_path, capsys):
    """Token budgets are written 2.5e9: YAML reads it as a string (`max_tokens must be int, got '2.5e9' (str)`),
    2.5e+9 as a float, and the flag was `invalid parse value: '2.5e9'`. A value that is not whole is still refused,
    in words."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("max_tokens: 2.5e9\ntotal_batch_tokens: 5.24288e+5\nmax_steps: 1_000\n")
    assert load_yaml(run_config) == {"max_tokens": 2_500_000_000, "total_batch_tokens": 524_288, "max_steps": 1000}
    run_config.write_text("max_steps: 1.5\n")
    with pytest.raises(ConfigError, match=r"^max_steps must be a whole number, got 1.5 \(float\)$"):
        load_yaml(run_config)
    cfg, _ = parse_config(["--max-tokens", "2.5e9", "--max-steps", "1E3", "--total-batch-tokens", "524_288"])
    assert (cfg.max_tokens, cfg.max_steps, cfg.total_batch_tokens) == (2_500_000_000, 1000, 524_288)
    for flag, value in (("--max-tokens", "2.5e-3"), ("--max-steps", "four")):
        with pytest.raises(SystemExit):
            parse_config([flag, value])
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"expected a whole number, got '{value}'")


def test_a_yaml_list_of_trackers_or_eval_tasks_is_their_comma_list(tmp_path):
    """`trackers: [tensorboard, wandb]` was `trackers must be str, got [...] (list)`; another text field still takes
    one string."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("trackers: [tensorboard, wandb]\neval_tasks:\n  - hellaswag\n  - lambada\n")
    assert load_yaml(run_config) == {"trackers": "tensorboard,wandb", "eval_tasks": "hellaswag,lambada"}
    run_config.write_text("sample_prompt: [ROMEO, JULIET]\n")
    with pytest.raises(ConfigError, match=r"^sample_prompt must be str, got \['ROMEO', 'JULIET'\] \(list\)$"):
        load_yaml(run_config)


def test_a_float_yaml_reads_as_a_string_is_the_float_written(tmp_path):
    """YAML 1.1 reads 3e-4 (no dot) as a string; it was `lr must be float, got '3e-4' (str)`."""
    run_config = tmp_path / "run.yaml"
    run_config.write_text("lr: 3e-4\nmuon_lr: 2E-2\ndecay_fraction: .3\n")
    assert load_yaml(run_config) == {"lr": 3e-4, "muon_lr": 0.02, "decay_fraction": 0.3}
    run_config.write_text("lr: 3e-x\n")
    with pytest.raises(ConfigError, match=r"^lr must be float, got '3e-x' \(str\)$"):
        load_yaml(run_config)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b"1: 2\n", r"the key 1 is not a name \(YAML reads an unquoted number, yes/no, on/off or null as a value\)"),
        (b"yes: 3\n", r"the key True is not a name"),
        (b"null: 3\n", r"the key None is not a name"),
        (b"# caf\xe9 run\nmax_steps: 2\n", r"is not UTF-8 text \(byte 5\); save it as UTF-8$"),
    ],
)
def test_a_yaml_key_that_is_no_name_or_a_file_that_is_no_text_is_one_error(tmp_path, text: bytes, problem: str):
    """Each was a traceback (difflib on an int key; the decoder's UnicodeDecodeError)."""
    run_config = tmp_path / "run.yaml"
    run_config.write_bytes(text)
    with pytest.raises(ConfigError, match=rf"^run config {re.escape(str(run_config))}:? .*{problem}"):
        load_yaml(run_config)


BAD_VALUES = {
    "preset": ("gpt5", r"Unknown model preset 'gpt5'.* Valid presets: gpt2-124m"),
    "out_dir": ("", r"out_dir may not be empty: give a folder, e.g. --out-dir runs/mine"),
    "data_dir": (" ", r"data_dir may not be empty: give a folder, e.g. --data-dir data/mybooks"),
    "micro_batch_size": (0, r"micro_batch_size must be >= 1 or auto, got 0"),
    "keep_checkpoints": (0, r"keep_checkpoints must be >= 1, got 0: the newest checkpoint is the run's resumable"),
    "warmup_steps": (-1, r"warmup_steps must be >= 0"),
    "block_size": (0, r"block_size must be >= 1 \(or null"),
    "n_layer": (0, r"n_layer must be >= 1 \(or null"),
    "n_head": (-2, r"n_head must be >= 1 \(or null"),
    "n_embd": (0, r"n_embd must be >= 1 \(or null"),
    "eval_limit": (0, r"eval_limit must be >= 1 \(or null"),
    "seed": (-1, r"seed must be in \[0, 2\*\*32\)"),
    "lr": (-1.0, r"lr must be > 0, got -1.0"),
    "min_lr_ratio": (2.0, r"min_lr_ratio must be in \[0, 1\]"),
    "weight_decay": (-0.1, r"weight_decay must be >= 0"),
    "beta2": (1.0, r"beta2 must be in \[0, 1\)"),
    "grad_clip": (-1.0, r"grad_clip must be >= 0 \(0 disables"),
    "peak_tflops": (0.0, r"peak_tflops must be > 0 \(or null"),
    "optimizer": ("sgd", r"optimizer must be one of adamw, muon, got 'sgd'"),
    "muon_lr": (0.0, r"muon_lr must be > 0, got 0.0"),
    "muon_momentum": (1.0, r"muon_momentum must be in \[0, 1\)"),
    "lr_schedule": ("linear", r"lr_schedule must be one of cosine, wsd, got 'linear'"),
    "decay_fraction": (1.5, r"decay_fraction must be in \[0, 1\]"),
    "decay_steps": (201, r"decay_steps 201 is more than the run's 200 steps: .*raise --max-steps or lower"),
    "time_budget_minutes": (-5.0, r"time_budget_minutes must be >= 0 \(0: no time budget\)"),
    "resume": ("", r"resume must be auto, never or a checkpoint folder, got ''"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_bad_values_rejected_with_the_rule(name):
    value, message = BAD_VALUES[name]
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{name: value})


@pytest.mark.parametrize("name", ["lr", "muon_lr", "weight_decay", "grad_clip", "peak_tflops", "time_budget_minutes"])
def test_non_finite_floats_rejected(name):
    for value in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=f"{name} must be"):
            TrainConfig(**{name: value})


def test_boundary_values_accepted():
    TrainConfig(keep_checkpoints=1, checkpoint_interval=0, grad_clip=0.0, weight_decay=0.0, seed=0, beta1=0.0)
    TrainConfig(optimizer="muon", muon_momentum=0.0, lr_schedule="wsd", decay_fraction=0.0)
    TrainConfig(decay_fraction=1.0)
    TrainConfig(decay_steps=200)
    TrainConfig(time_budget_minutes=0.5, warmup_steps=3)


def test_a_time_budget_needs_a_warmup_to_time_its_steps_in():
    with pytest.raises(ConfigError, match=r"time_budget_minutes needs warmup_steps >= 3, got 2: the run times"):
        TrainConfig(time_budget_minutes=5, warmup_steps=2)


def test_hub_flags_that_would_push_nothing_or_publicly_stop_before_the_run():
    """--hub-private-repo alone would leave a user sure of a private repository that nothing creates; a push with no
    export would fail only at the end of the run."""
    with pytest.raises(ConfigError, match=r"^--hub-private-repo is for --push-to-hub's repository: give --push-to-hub"):
        parse_config(["--hub-private-repo", "true"])
    with pytest.raises(ConfigError, match=r"^--push-to-hub pushes the run's export: drop --export-hf false$"):
        parse_config(["--push-to-hub", "you/books", "--export-hf", "false"])
    cfg, _ = parse_config(["--push-to-hub", "you/books", "--hub-private-repo", "true"])
    assert cfg.hub_private_repo and cfg.push_to_hub == "you/books"


def test_grad_accum_from_token_budget():
    assert grad_accum_steps(524_288, 16, 1024, 4) == 8
    with pytest.raises(ConfigError, match=r"not a multiple of .* 16 × 1024 × 3 = 49152"):
        grad_accum_steps(524_288, 16, 1024, 3)
    # a micro-batch that divides the step's sequences keeps the batch (the recipe): said first, as a flag
    with pytest.raises(ConfigError) as err:
        grad_accum_steps(1024, 3, 64, 1)  # tiny_cpu.yaml's step: 16 sequences of 64
    assert str(err.value).endswith("= 192; use e.g. --micro-batch-size 2 (the same batch), or --total-batch-tokens 960")


def test_every_run_config_in_repo_loads_and_holds_only_what_differs_from_the_defaults():
    paths = sorted((REPO / "configs").glob("*.yaml"))
    assert paths, "configs/ holds the run configs"
    defaults = dataclasses.asdict(TrainConfig())
    for path in paths:
        values = load_yaml(path)
        TrainConfig(**values)
        assert not {k: v for k, v in values.items() if defaults[k] == v}, f"{path.name} repeats a default"
