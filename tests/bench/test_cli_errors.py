"""The benchmark CLIs' bad input (bench.ladder, bench.profile, bench.loss_speed, bench.attention_speed,
bench.loss_numerics, bench.activation_memory) and a machine they cannot compile on: one `error:` line (in the
benchmark's own flags), before anything is built, prepared or timed; a disk that fills up by the report: one line
below the results."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from bench.activation_memory import main as activation_memory_main
from bench.attention_speed import main as attention_speed_main
from bench.ladder import main as ladder_main
from bench.loss_numerics import main as loss_numerics_main
from bench.loss_speed import main as loss_speed_main
from bench.profile import main as profile_main
from bench.time_to_loss import main as time_to_loss_main
from testkit import REPO, fill_disk

CLIS: dict[str, Callable[[list[str]], None]] = {"ladder": ladder_main, "profile": profile_main}  # on a corpus
ALL_CLIS = {**CLIS, "loss_speed": loss_speed_main, "attention_speed": attention_speed_main}


def argparse_line(cli: Callable[[list[str]], None], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line `cli`'s argparse printed refusing argv (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        cli(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("cli", ALL_CLIS)
def test_a_preset_typo_is_one_error_with_the_closest_preset(cli: str):
    with pytest.raises(SystemExit) as exc:
        ALL_CLIS[cli](["--preset", "smal-cpu"])
    assert str(exc.value.code).startswith("error: Unknown model preset 'smal-cpu'. Did you mean 'small-cpu'? Valid")


@pytest.mark.parametrize("cli", [*CLIS, "attention_speed"])
@pytest.mark.parametrize("holds", ["books", "a file"])
def test_a_data_dir_that_is_no_corpus_is_one_error_in_the_benchmarks_flags(tmp_path: Path, cli: str, holds: str):
    """A folder of other files (raw books, a typo'd path to something else) is not prepared over, and the advice
    names --data-dir, not prepare's --out (bench.attention_speed reads one for its --step-rounds)."""
    data_dir = tmp_path / "data"
    if holds == "books":
        data_dir.mkdir()
        (data_dir / "hamlet.txt").write_text("To be, or not to be")
    else:
        data_dir.write_text("not a folder")
    with pytest.raises(SystemExit) as exc:
        steps = ["--step-rounds", "1"] if cli == "attention_speed" else []
        ALL_CLIS[cli](["--preset", "tiny-cpu", "--data-dir", str(data_dir), *steps])
    assert exc.value.code == (
        f"error: --data-dir {data_dir} is not a prepared corpus (no manifest.json) nor an empty folder to prepare the "
        "default corpus in; pass a folder `python -m data_prep.prepare --out DIR` wrote, or a new one"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing prepared beside it


def test_a_ladder_out_that_cannot_be_a_folder_is_one_error_before_the_rungs(prepared_books: Path, tmp_path: Path):
    (tmp_path / "report").write_text("a file where the report folder goes")
    with pytest.raises(SystemExit) as exc:
        ladder_main(["--preset", "tiny-cpu", "--data-dir", str(prepared_books), "--out", str(tmp_path / "report")])
    out = tmp_path / "report"
    assert exc.value.code == f"error: --out {out}: {out} is a file; give a folder for the report"  # not "File exists"


@pytest.mark.parametrize("yaml", ["nowhere.yaml", "1xgpu_fp16.yaml", "typo.yaml", "cudagraphs.yaml"])
def test_a_ladder_launch_yaml_it_cannot_run_is_one_error_before_anything_is_made(tmp_path: Path, yaml: str):
    """A missing --accelerate-config was accelerate's FileNotFoundError traceback, and one accelerate's loader
    rejects its ValueError's; an fp16 one on the CPU ran rung 11 in fp32 (accelerate autocasts to fp16 on GPUs only)
    under an fp16 label, and one with a compile backend train_accel.py refuses timed rung 11 under it."""
    path = REPO / "accelerate_configs" / yaml
    written = {
        "typo.yaml": "distributed_type: MULTI_GPUS\nmixed_precision: bf16\n",  # a value accelerate lacks
        "cudagraphs.yaml": "distributed_type: 'NO'\nuse_cpu: true\ndynamo_config:\n  dynamo_backend: CUDAGRAPHS\n",
    }
    if yaml in written:
        path = tmp_path.parent / f"{tmp_path.name}-{yaml}"
        path.write_text(written[yaml])
    data, out = tmp_path / "data", tmp_path / "report"
    with pytest.raises(SystemExit) as exc:
        ladder_main(["--device", "cpu", "--accelerate-config", str(path), "--data-dir", str(data), "--out", str(out)])
    if yaml == "nowhere.yaml":
        assert exc.value.code == (
            f"error: --accelerate-config {path}: no such file; give a launch YAML (accelerate_configs/)"
        )
    elif yaml == "cudagraphs.yaml":
        assert exc.value.code == (
            f"error: --accelerate-config {path} asks for dynamo_backend: CUDAGRAPHS, which train_accel.py does not "
            "train with: give a YAML with dynamo_backend INDUCTOR or NO (accelerate_configs/)"
        )
    elif yaml == "typo.yaml":
        assert exc.value.code == (
            f"error: --accelerate-config {path}: accelerate cannot read it (ValueError: 'MULTI_GPUS' is not a valid "
            "DistributedType); write one with `accelerate config`, or start from accelerate_configs/"
        )
    else:
        assert exc.value.code == (
            f"error: --accelerate-config {path} asks for mixed_precision: fp16, which accelerate does not apply on a "
            "CPU: give accelerate_configs/cpu_bf16.yaml or cpu.yaml"
        )
    assert list(tmp_path.iterdir()) == []  # no corpus prepared, no report folder


@pytest.mark.parametrize("cli", ["ladder", "profile", "attention_speed"])
def test_a_step_backend_train_accel_does_not_train_with_is_refused_by_the_flags(tmp_path: Path, capsys, cli: str):
    """rung 11's step under another compile backend than train_accel.py's (training.distributed.TRAINED_BACKENDS)
    was accelerate's ValueError traceback at the step, after bench.attention_speed had timed its layers; the
    ladder's refusal blamed its --accelerate-config YAML."""
    out = ["--out", str(tmp_path / "report")] if cli == "attention_speed" else []
    last = argparse_line(ALL_CLIS[cli], ["--preset", "tiny-cpu", "--dynamo-backend", "cudagraphs", *out], capsys)
    assert ": error: argument --dynamo-backend: invalid choice: 'cudagraphs'" in last
    assert list(tmp_path.iterdir()) == []  # no report folder


@pytest.mark.parametrize("cli", ALL_CLIS)
@pytest.mark.parametrize(
    ("flag", "value", "minimum"),
    [("--steps", "0", 1), ("--micro-batch-size", "0", 1), ("--warmup", "-1", None), ("--steps", "ten", None)],
)
def test_a_count_out_of_range_is_argparses_line_naming_the_flag(
    tmp_path: Path, capsys, cli: str, flag: str, value: str, minimum: int | None
):
    """--steps 0 was statistics' traceback after the work (bench.profile, bench.loss_speed), --warmup -1 a median
    over the wrong calls, --micro-batch-size 0 the loader's ValueError or a report of nan losses: each count is now
    argparse's one line naming its flag, before anything is prepared, made or timed. --warmup's least value is the
    benchmark's: 1 where the first step compiles inside the timed rows' process (ladder, profile), else 0."""
    argv = ["--preset", "tiny-cpu", flag, value]
    argv += ["--data-dir", str(tmp_path / "data")] if cli in CLIS else ["--out", str(tmp_path / "report")]
    last = argparse_line(ALL_CLIS[cli], argv, capsys)
    if value == "ten":
        assert last.endswith(f"error: argument {flag}: expected a whole number, got 'ten'")
    else:
        least = minimum if minimum is not None else (1 if cli in CLIS else 0)
        assert last.endswith(f"error: argument {flag}: must be at least {least}, got {value}")
    assert list(tmp_path.iterdir()) == []  # no corpus, no report folder


def test_a_ladder_batch_factor_that_is_no_power_of_two_is_one_error_before_anything_is_made(tmp_path: Path):
    with pytest.raises(SystemExit) as exc:
        ladder_main(["--preset", "tiny-cpu", "--max-batch-factor", "3", "--data-dir", str(tmp_path / "data")])
    assert exc.value.code == "error: --max-batch-factor must be a power of two (1, 2, 4, ...), got 3"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cli", ["profile", "loss_speed", "attention_speed"])
def test_without_a_cpp_compiler_a_compiling_benchmark_is_one_error_before_the_measuring(
    prepared_books: Path, tmp_path: Path, monkeypatch, cli: str
):
    """CXX naming no compiler (a container without build tools): inductor's traceback at the first compiled step was
    the benchmark's end. bench.ladder's compiled rows are n/a instead (tests/e2e/test_ladder_cli.py)."""
    monkeypatch.setenv("CXX", "/nowhere/g++")
    args = ["--preset", "tiny-cpu"]
    args += ["--data-dir", str(prepared_books)] if cli == "profile" else ["--out", str(tmp_path / "report")]
    with pytest.raises(SystemExit) as exc:
        ALL_CLIS[cli](args)
    assert str(exc.value.code).startswith(
        "error: torch.compile builds C++ kernels on the CPU, and this machine has no working C++ compiler "
        "(/nowhere/g++): install one"
    ) and str(exc.value.code).endswith("; this benchmark compiles with it")


@pytest.mark.parametrize("cli", ["ladder", "loss_speed", "attention_speed"])
def test_an_out_that_cannot_be_written_is_one_error_before_the_measuring(prepared_books: Path, tmpfs, cli: str):
    """The benchmarks write their report at the end: a read-only --out stops them at the start."""
    disk = tmpfs("1m")
    (disk / "report").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    data = ["--data-dir", str(prepared_books)] if cli == "ladder" else []
    with pytest.raises(SystemExit) as exc:
        ALL_CLIS[cli](["--preset", "tiny-cpu", *data, "--out", str(disk / "report")])
    assert exc.value.code == (
        f"error: --out {disk / 'report'}: {disk / 'report'} is not writable by this user; give a folder for the report"
    )


def test_a_report_on_a_disk_that_fills_up_is_one_error_below_the_results(tmpfs, capsys):
    """The report is written at the end, on a disk that is writable, as checked at the start, but has no room left:
    the results are printed, then one `error:` line, and no file is left cut off."""
    disk = tmpfs("1m")
    out = disk / "report"
    out.mkdir()
    fill_disk(disk)
    argv = ["--preset", "tiny-cpu", "--warmup", "1", "--steps", "1", "--micro-batch-size", "1", "--dynamo-backend"]
    with pytest.raises(SystemExit) as exc:
        loss_speed_main([*argv, "eager", "--out", str(out)])
    assert exc.value.code == (
        f"error: disk full while writing {out / 'loss_speed.json'}: free space on {disk} and run the same command "
        "again; the results are printed above"
    )
    assert "| fused (modeling.fused_ce), compiled |" in capsys.readouterr().out
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("cli", ["ladder", "time_to_loss"])
@pytest.mark.parametrize(
    ("script", "said"),
    [
        ("class GPTConfig:\n    pass\n", "has no GPT, GPT.configure_optimizers"),  # another script, or a cut copy
        ("class GPT(:\n", "does not load (SyntaxError: "),
    ],
)
def test_a_peer_script_it_cannot_read_is_one_error_before_the_measuring(
    prepared_books: Path, tmp_path: Path, cli: str, script: str, said: str
):
    """The ladder times build-nanogpt after its own rungs: a --peer-dir whose train_gpt2.py it cannot use ended the
    benchmark there with a traceback, and the rungs' rows with it. Both benchmarks check it before measuring."""
    peer_dir = tmp_path / "build-nanogpt"
    peer_dir.mkdir()
    (peer_dir / "train_gpt2.py").write_text(script)
    out = tmp_path / "report"
    common = ["--peer-dir", str(peer_dir), "--out", str(out)]
    argv = ["--preset", "tiny-cpu", "--data-dir", str(prepared_books), *common]
    if cli == "time_to_loss":
        argv = ["--recipe", "today", "--recipe", "build-nanogpt", "--seeds", "1", "--target", "5", *common]
    with pytest.raises(SystemExit) as exc:
        (ladder_main if cli == "ladder" else time_to_loss_main)(argv)
    assert str(exc.value.code).startswith(f"error: --peer-dir: {peer_dir / 'train_gpt2.py'} {said}")
    assert str(exc.value.code).endswith(
        "give a checkout of karpathy/build-nanogpt, whose train_gpt2.py this benchmark reads"
    )
    assert not out.exists()  # nothing measured, no report folder


@pytest.mark.skipif(torch.cuda.is_available(), reason="a torch that sees a GPU runs --device cuda")
@pytest.mark.parametrize("cli", ["ladder", "loss_speed", "loss_numerics"])
def test_device_cuda_without_a_gpu_is_argparses_line_naming_the_flag(tmp_path: Path, capsys, cli: str):
    """On a CPU-only torch --device cuda was CUDA's AssertionError traceback ("Torch not compiled with CUDA
    enabled") at the first peak probe or tensor."""
    main = {"ladder": ladder_main, "loss_speed": loss_speed_main, "loss_numerics": loss_numerics_main}[cli]
    last = argparse_line(main, ["--device", "cuda"], capsys)
    why = f"cuda, but torch {torch.__version__} sees no CUDA GPU here; give cpu"
    assert last.endswith(f"error: argument --device: {why}")


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--precisions", "fp8", "invalid choice: 'fp8' (choose from 'fp32', 'bf16', 'fp16')"),
        ("--p-target", "1.5", "must be between 0 and 1 (exclusive), got 1.5"),
        ("--p-target", "0", "must be between 0 and 1 (exclusive), got 0"),
    ],
)
def test_a_loss_numerics_row_it_cannot_measure_is_argparses_line(capsys, flag: str, value: str, why: str):
    """--precisions fp8 printed fp32's errors in rows labelled fp8, and --p-target 1.5 a table of nan errors."""
    assert argparse_line(loss_numerics_main, [flag, value], capsys).endswith(f"error: argument {flag}: {why}")


@pytest.mark.parametrize("cli", ["loss_speed", "attention_speed"])
def test_help_says_what_the_benchmark_compares_whole_and_names_its_command(capsys, cli: str):
    """--help's description was the docstring's first line, which ends mid-sentence ("... against"), and
    bench.loss_speed's usage line read 'loss_speed.py'."""
    with pytest.raises(SystemExit):
        ALL_CLIS[cli](["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(f"usage: python -m bench.{cli} ")
    whole = {"loss_speed": "against modeling.fused_ce, eager", "attention_speed": "against modeling.cpu_attention's"}
    assert whole[cli] in out


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_ladder_peak_that_is_no_positive_rate_is_argparses_line(tmp_path: Path, capsys, value: str):
    """--peak-tflops 0 was a ZeroDivisionError traceback after the corpus was prepared; -1 printed negative MFUs."""
    argv = ["--preset", "tiny-cpu", "--peak-tflops", value, "--data-dir", str(tmp_path / "data")]
    last = argparse_line(ladder_main, argv, capsys)
    assert last.endswith(f"error: argument --peak-tflops: must be a positive number of TFLOP/s, got {value}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--layers", "0", "must be at least 1, got 0"),
        ("--micro-batch-size", "0", "must be at least 1, got 0"),
        ("--width", "65", "must be a multiple of 4 (the heads), got 65"),
    ],
)
def test_an_activation_memory_shape_it_cannot_build_is_argparses_line(capsys, flag: str, value: str, why: str):
    """--layers 0 and --width 65 were GPTConfig's ValueError traceback, --micro-batch-size 0 a child's: now refused
    before any child process runs."""
    assert argparse_line(activation_memory_main, [flag, value], capsys).endswith(f"error: argument {flag}: {why}")
