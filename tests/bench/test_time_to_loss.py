"""`python -m bench.time_to_loss`: the crossing arithmetic, and the CLI end to end at tiny-cpu (two recipes, one
seed, a few steps) leaving a table, curves.json and curves.png whose curves are sane."""

from __future__ import annotations

import io
import json
import math
import sys

import numpy as np
import pytest
from PIL import Image

from bench import time_to_loss
from bench.time_to_loss import Curve, at, crossing, main, parse_recipe, plot, spread, val_targets
from modeling.config import PADDED_VOCAB_SIZE
from testkit import run


def test_crossing_and_budget_interpolate_between_evals():
    tokens, losses = [0, 100, 200, 300], [10.0, 8.0, 6.0, 5.0]
    assert crossing(tokens, losses, 7.0) == 150  # halfway from 8 to 6
    assert crossing(tokens, losses, 8.0) == 100  # reached at an eval
    assert crossing(tokens, [10.0, 6.0, 7.0, 6.0], 6.5) == 87.5  # the first crossing, not a later one
    assert crossing(tokens, losses, 4.0) is None
    assert at(tokens, losses, 250) == 5.5 and at(tokens, losses, 301) is None


def test_spread_says_how_many_seeds_reached_the_target():
    assert spread([1.0, 3.0], ".1f") == "2.0 ± 1.4"
    assert spread([1.0, None], ".1f") == "1.0 ± 0.0 (1/2 seeds)"
    assert spread([None], ".1f") == "not reached"


def test_recipes_are_builtins_or_named_flags():
    assert parse_recipe("today")[1].startswith("--preset small-cpu --optimizer adamw --lr 1e-3")
    assert parse_recipe("default") == ("default", "")
    assert parse_recipe("build-nanogpt") == ("build-nanogpt", None)
    assert parse_recipe("m=--optimizer muon") == ("m", "--optimizer muon")
    with pytest.raises(Exception, match="NAME=FLAGS"):
        parse_recipe("adamw")


def test_target_is_the_given_one_even_zero_else_the_baselines_mean_final_val():
    def curve(recipe: str, final: float) -> Curve:
        return Curve(recipe, 0, [0, 1024], [0.0, 1.0], [10.8, final], [10.8, final + 1], 1024, 0.0)

    curves = [curve("today", 6.0), curve("today", 7.0), curve("muon", 5.0)]
    assert val_targets(curves, "today", None) == {"val_loss": 6.5, "val_loss_opening": 7.5}
    assert val_targets(curves[2:], "today", 0.0) == {"val_loss": 0.0, "val_loss_opening": 0.0}  # not "unset"


@pytest.fixture
def unmeasured(monkeypatch):
    """The CPU's matmul speeds (~1 s of matmuls) are not measured: a flag the CLI rejects is said before it."""

    def measured() -> None:
        raise AssertionError("the CPU's matmuls were measured before the flags were checked")

    monkeypatch.setattr(time_to_loss, "cpu_matmul_speeds", measured)


def test_no_target_and_no_baseline_recipe_is_one_error_before_anything_trains(tmp_path, unmeasured):
    out = tmp_path / "ttl"
    argv = ["--recipe", "adamw=--optimizer adamw", "--seeds", "1", "--set", f"--data-dir {tmp_path}", "--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert str(exc.value.code).startswith("error: no --target and no `today` recipe to take it from; pass --target")
    assert not out.exists()  # checked before the benchmark made its folder and trained


@pytest.mark.parametrize("target", ["-3", "nan", "inf"])
def test_a_target_no_run_can_reach_is_argparses_one_line(tmp_path, capsys, target, unmeasured):
    """A val loss is >= 0: --target -3 trained every recipe for nothing (never reached), as nan and inf would."""
    out = tmp_path / "ttl"
    with pytest.raises(SystemExit) as exc:
        main(["--recipe", "today", "--seeds", "1", "--target", target, "--out", str(out)])
    assert exc.value.code == 2 and not out.exists()
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.endswith(f"error: argument --target: a val loss is a finite number >= 0, got {float(target)}"), last


def test_a_recipe_flag_train_accel_does_not_take_is_one_error_before_anything_trains(tmp_path, unmeasured):
    argv = ["--recipe", "today", "--recipe", "m=--muon-lr -1", "--seeds", "1", "--set", f"--data-dir {tmp_path}"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "ttl")])
    assert exc.value.code == "error: recipe m: muon_lr must be > 0, got -1.0"
    assert not (tmp_path / "ttl").exists()  # no recipe trained, nor was this process set up for it (conftest's guard)


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--set", "'unclosed"], 'error: --set "\'unclosed": no closing quotation'),
        (["--recipe", "m=--lr '3e-3"], "error: recipe m's flags \"--lr '3e-3\": no closing quotation"),
        (["--until-tokens", "0"], "error: argument --until-tokens: must be at least 1, got 0"),
        (["--budget-tokens", "-1"], "error: argument --budget-tokens: must be at least 1, got -1"),
        (["--seeds", "0"], "error: argument --seeds: must be at least 1, got 0"),
    ],
)
def test_bad_flags_are_one_error_before_anything_trains(tmp_path, capsys, flags, line, unmeasured):
    """An unclosed quote was shlex's traceback; --until-tokens 0 trained every recipe, then divided by zero."""
    argv = ["--recipe", "today", "--seeds", "1", "--set", f"--data-dir {tmp_path}", "--out", str(tmp_path / "ttl")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, *flags])
    said = exc.value.code if isinstance(exc.value.code, str) else capsys.readouterr().err.strip().splitlines()[-1]
    assert said.endswith(line), said
    assert not (tmp_path / "ttl").exists()


@pytest.mark.parametrize(
    ("yaml", "line"),
    [
        # accelerate's FileNotFoundError traceback, before
        (None, "no such file; give a launch YAML (accelerate_configs/)"),
        # training's own line, before, naming an `accelerate launch` flag, after an empty report folder was made
        ("distributed_type: 'NO'\nmixed_precision: fp16\nuse_cpu: true\n", "asks for mixed_precision: fp16"),
        # accelerate's loader's traceback, before: a key accelerate does not know
        ("distributed_type: 'NO'\nmixed_precison: bf16\n", "accelerate cannot read it (ValueError: The config file"),
        # each recipe's launch refused it at its start-up, after the report folder was made
        ("distributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: TVM\n", "asks for dynamo_backend: TVM"),
    ],
    ids=["missing", "fp16 on a CPU", "a key accelerate rejects", "a backend train_accel.py refuses"],
)
def test_a_launch_yaml_it_cannot_train_under_is_one_error_before_anything_is_made(tmp_path, yaml, line, unmeasured):
    launch = tmp_path / "my.yaml"
    if yaml:
        launch.write_text(yaml)
    argv = ["--recipe", "today", "--seeds", "1", "--set", f"--data-dir {tmp_path}", "--out", str(tmp_path / "ttl")]
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--accelerate-config", str(launch)])
    assert str(exc.value.code).startswith(f"error: --accelerate-config {launch}") and line in exc.value.code
    assert not (tmp_path / "ttl").exists()


@pytest.mark.slow
def test_cli_writes_table_json_and_plot_with_sane_curves(prepared_books, tmp_path):
    """AdamW and Muon at tiny-cpu for 4 steps, eager fp32 (cpu_eager.yaml) so nothing compiles: each curve starts
    near ln(vocab), falls, and is reported in the table, the JSON and the PNG."""
    out = tmp_path / "ttl"
    common = f"--data-dir {prepared_books} --max-steps 4 --warmup-steps 1 --eval-windows 8 --peak-tflops 1"
    cmd = [
        sys.executable, "-m", "bench.time_to_loss", "--config", "configs/tiny_cpu.yaml", "--seeds", "1",
        "--recipe", "adamw=--optimizer adamw --lr 3e-3", "--recipe", "muon=--optimizer muon --lr 3e-3",
        "--set", common, "--accelerate-config", "accelerate_configs/cpu_eager.yaml", "--eval-every", "2",
        "--target", "10.0", "--out", str(out),
    ]  # fmt: skip
    result = run(cmd)
    tables = result.stdout.split("| recipe |")[1:]
    assert len(tables) == 2  # on both val definitions
    for table in tables:
        assert [line.split(" | ")[0] for line in table.strip().splitlines()[2:4]] == ["| adamw", "| muon"]
    report = json.loads((out / "curves.json").read_text())
    assert report["targets"] == {"val_loss": 10.0, "val_loss_opening": 10.0} and report["budget_tokens"] == 4 * 1024
    for curve in report["curves"]:
        assert curve["tokens"] == [0, 2048, 4096]
        assert curve["seconds"][0] == 0 and curve["seconds"][1] < curve["seconds"][2]
        for key in ("val_loss", "val_loss_opening"):
            first, *_, last = curve[key]
            assert abs(first - math.log(PADDED_VOCAB_SIZE)) < 0.5 and last < first - 0.05
        assert curve["val_loss"] != curve["val_loss_opening"]
    for rows in report["tables"].values():
        for row in rows:
            (reached,) = row["tokens_to_target"]
            assert reached is None or 0 < reached <= 4096
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_plot_title_keeps_a_long_command_inside_the_figure():
    """The title is the command line: one with a long --set ran past both edges of curves.png, cut at each."""
    curve = Curve("today", 0, [0, 1024], [0.0, 1.0], [10.8, 10.2], [10.8, 10.2], 512, 0.0)
    command = "python -m bench.time_to_loss" + " --set '--preset tiny-cpu'" * 12
    gray = np.asarray(Image.open(io.BytesIO(plot([curve], 10.5, f"{command}\nCPU: X"))).convert("L"))
    title_band = gray[:40]
    assert title_band[:, :3].min() == 255 and title_band[:, -3:].min() == 255  # no ink at either edge
