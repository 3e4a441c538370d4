"""The evals, evals.generate and evals.bench CLIs in process: run folders and exports, generation, errors, plot."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from data_prep.tokenizer import WHISPER_SDIST, get_encoding, gpt2_vocab_and_merges, prompt_tokens
from evals import EvalError
from evals.__main__ import main as evals_main
from evals.bench import main as bench_main
from evals.generate import SEPARATOR, generate_samples
from evals.generate import main as generate_main
from evals.loading import load_model
from evals.plot import main as plot_main
from evals.plot import plot_evals
from evals.runner import run_task
from modeling.config import EOT_ID
from modeling.device import device_name
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from modeling.runs import read_metrics
from testkit import REPO, TINY_MODEL, fill_disk, new_run, write_checkpoint
from training.checkpoint import checkpoint_dir, write_manifest
from training.export import main as export_main
from training.metrics import JSONLTracker


def evals_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`python -m evals`'s error: exit status 1 and one `error:` message, the last it printed (report_error: printed
    once across the processes of a launch)."""
    with pytest.raises(SystemExit) as exc:
        evals_main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 1, lines
    start = max(i for i, line in enumerate(lines) if line.startswith("error: "))
    return "\n".join(lines[start:])


def test_checkpoint_and_export_load_the_same_model(tiny_run, tmp_path):
    model, source = load_model(tiny_run, checkpoint=checkpoint_dir(tiny_run, 1))
    assert source.endswith("step-00000001 (model.safetensors)") and model.config.block_size == 32
    by_name, _ = load_model(tiny_run, checkpoint="step-00000001")  # as `--checkpoint step-00000001` (and export's)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), by_name.state_dict().values(), strict=True)
    )
    export = export_hf(model, tmp_path / "export", gpt2_vocab_and_merges())
    from_export, _ = load_model(export=export)
    for temperature in (0.0, 1.0):
        texts = {
            next(generate_samples(m, "Once upon a time", 8, temperature, 50, seed=3)) for m in (model, from_export)
        }
        assert len(texts) == 1 and texts.pop().startswith("Once upon a time")
    assert list(generate_samples(model, "", 8, seed=3)) == list(generate_samples(model, "", 8, seed=3))
    assert list(generate_samples(model, "", 8, seed=3)) != list(generate_samples(model, "", 8, seed=4))

    run = new_run(tmp_path / "only-export")  # a run whose checkpoints were deleted: its export is used
    shutil.copytree(export, run / "export")
    assert load_model(run)[1] == f"export {run / 'export'}"


def test_generate_cli_prints_the_continuation(tiny_run, capsys):
    generate_main(["--run", str(tiny_run), "--prompt", "Hello", "--max-new-tokens", "5", "--top-k", "0"])
    assert capsys.readouterr().out.startswith("Hello")
    # checked before the model loads (which would fail here first): nan and inf were torch.multinomial's traceback, a
    # seed past 64 bits torch.Generator's
    nowhere = ["--run", str(tiny_run / "nowhere")]
    for value in ("-1", "nan", "inf"):
        message = rf"--temperature must be a number >= 0 \(0 is greedy decoding\), got {float(value)}$"
        with pytest.raises(SystemExit, match=message):
            generate_main([*nowhere, "--temperature", value])
    with pytest.raises(SystemExit, match=r"--seed must be a whole number from -2\*\*63 to 2\*\*64 - 1, got 2{23}"):
        generate_main([*nowhere, "--seed", "2" * 23])
    with pytest.raises(SystemExit, match="--max-new-tokens must be positive, got 0"):
        generate_main([*nowhere, "--max-new-tokens", "0"])
    for flag, value, message in [
        ("--top-p", "0", r"--top-p must be above 0 and at most 1 \(1: no cut-off\), got 0.0$"),
        ("--top-p", "1.5", r"--top-p must be above 0 and at most 1 \(1: no cut-off\), got 1.5$"),
        ("--num-samples", "0", "--num-samples must be positive, got 0$"),
    ]:
        with pytest.raises(SystemExit, match=message):
            generate_main([*nowhere, flag, value])
    # greedy decoding printed the same text 3 times, as asked; transformers' greedy generate refuses this too
    with pytest.raises(
        SystemExit, match=r"^error: --num-samples 3 at --temperature 0: greedy decoding writes the same"
    ):
        generate_main([*nowhere, "--num-samples", "3", "--temperature", "0"])


def generated(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The samples `python -m evals.generate ARGV` prints."""
    generate_main(argv)
    return capsys.readouterr().out.removesuffix("\n").split(f"\n{SEPARATOR}\n")


PROMPTS = ["Once upon a time", "<|endoftext|>ROMEO:", "caf\u00e9 \u4e2d\U0001f600 \t\r\n  x"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_transformers_greedy_generate_on_the_export(tiny_run, tmp_path, prompt, capsys):
    """--temperature 0 from the checkpoint and from its export writes the tokens transformers' greedy generate writes
    on the export, from the ids its tokenizer reads the prompt as (<|endoftext|> was read as 7 ordinary tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = export_hf(load_model(tiny_run)[0], tmp_path / "export", gpt2_vocab_and_merges())
    tokenizer, hf_model = AutoTokenizer.from_pretrained(export), AutoModelForCausalLM.from_pretrained(export)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == prompt_tokens(prompt)
    new = hf_model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    expected = prompt + tokenizer.decode(new)
    for source in (["--run", str(tiny_run)], ["--model", str(export)]):
        assert generated([*source, "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0"], capsys) == [
            expected
        ]


def test_a_hub_id_as_model_loads_from_the_hub_cache_as_init_from_does(tiny_run, tmp_path, monkeypatch, capsys):
    """--model gpt2 (a Hub id, as --init-from takes) said "gpt2 is not an HF-format export (no config.json)". Here
    the Hub is its local cache, offline: the id samples what the export it holds samples; one out of reach is one
    line saying how to do without the Hub."""
    export = export_hf(load_model(tiny_run)[0], tmp_path / "export", gpt2_vocab_and_merges())
    repo = tmp_path / "hub" / "models--someone--tiny-books"
    revision = "0" * 40
    shutil.copytree(export, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    argv = ["--prompt", "Once upon a time", "--max-new-tokens", "12", "--temperature", "0"]
    hub = subprocess.run(
        [sys.executable, "-m", "evals.generate", "--model", "someone/tiny-books", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert hub.stderr.splitlines()[-1] == "model: Hub model someone/tiny-books"
    assert hub.stdout.removesuffix("\n") == generated(["--model", str(export), *argv], capsys)[0]
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as exc:
        generate_main(["--model", "someone/elsewhere", *argv])
    said = str(exc.value.code)
    assert "\n" not in said and said.startswith("error: cannot load someone/elsewhere from the Hub: ")
    assert said.endswith("(hf download someone/elsewhere --local-dir DIR) and give --model DIR"), said


def test_a_sample_ends_at_endoftext_as_transformers_generate_does(tiny_run, tmp_path, capsys):
    """A document's end ends the sample (transformers stops at the export's eos_token_id); it ran on to
    --max-new-tokens, through <|endoftext|> into text of another document."""
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_run)[0]
    with torch.no_grad():  # the end-of-text id's head row made likeliest after any text
        hidden = model.transformer.ln_f(model.transformer.wte.weight[:1])[0]
        model.lm_head.weight[EOT_ID] = 100 * hidden / hidden.norm() ** 2
    export = export_hf(model, tmp_path / "export", gpt2_vocab_and_merges())
    ids = torch.tensor([prompt_tokens("Hello")])
    assert AutoModelForCausalLM.from_pretrained(export).generate(ids, max_new_tokens=8, do_sample=False).shape[1] <= 2
    for temperature in ("0", "1"):
        args = ["--model", str(export), "--prompt", "Hello", "--max-new-tokens", "8", "--temperature", temperature]
        assert generated(args, capsys) == ["Hello"]


def test_several_samples_from_a_prompt_file(tiny_run, tmp_path, capsys):
    """nanoGPT's sample.py's --num_samples and --start=FILE:prompt.txt: the samples, one after another from one seed
    (the first is the one a single sample gives), separated by a line; a prompt file that is not there is one line."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("ROMEO:\nWhat light\n", encoding="utf-8")
    args = ["--run", str(tiny_run), "--prompt", f"FILE:{prompt}", "--max-new-tokens", "6", "--top-k", "0"]
    samples = generated([*args, "--num-samples", "3"], capsys)
    assert len(samples) == 3 and len(set(samples)) == 3 and all(s.startswith("ROMEO:\nWhat light\n") for s in samples)
    assert generated(args, capsys) == samples[:1]
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(SystemExit, match=rf"^error: --prompt FILE:{missing}: cannot read {missing} as UTF-8 text"):
        generate_main(["--run", str(tiny_run), "--prompt", f"FILE:{missing}"])


@pytest.mark.slow
def test_samples_print_as_they_are_written_and_ctrl_c_keeps_them(tiny_run):
    """Each sample is printed when written (all were printed at the end, and a Ctrl-C lost every one, with a
    traceback): after the second starts printing, Ctrl-C stops the run with one line and the first stays."""
    # 300 samples of 100 tokens: minutes, long past the first's print (before, all were printed at the end)
    cmd = [sys.executable, "-m", "evals.generate", "--run", str(tiny_run), "--num-samples", "300", "--top-k", "0"]
    # as a terminal's foreground job: Ctrl-C reaches it, whatever this test process ignores (an ignored SIGINT is
    # inherited, and a test run earlier in this pytest worker may have left it ignored)
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        while proc.stdout.readline() not in (f"{SEPARATOR}\n", ""):  # the second sample is printing
            pass
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert re.fullmatch(r"stopped by Ctrl-C after [1-9]\d* of 300 samples", err.strip().splitlines()[-1]), err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_reader_that_stops_reading_ends_the_samples_without_a_traceback(tiny_run):
    """`python -m evals.generate ... | head -1`: the samples after the reader stopped ended in a BrokenPipeError
    traceback; now the run ends as a program SIGPIPE stops (status 141), its stderr the model line alone."""
    cmd = [sys.executable, "-m", "evals.generate", "--run", str(tiny_run), "--num-samples", "300", "--top-k", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline()  # the first sample's first line, as `head -1` reads it
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 141, err
    assert err.splitlines() == [f"model: checkpoint {checkpoint_dir(tiny_run, 2)} (model.safetensors)"], err


def test_a_prompt_longer_than_the_context_says_so(tiny_run, capsys):
    """The model reads the prompt's last block_size (32) tokens alone; the whole prompt is printed as it was given."""
    prompt = "To be, or not to be. " * 10  # 81 tokens
    generate_main(["--run", str(tiny_run), "--prompt", prompt, "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert out.startswith(prompt)
    assert "note: the prompt is 81 tokens, longer than the model's context: the text continues from its last 32" in err


def test_device_flag(tiny_run, capsys):
    """nanoGPT's --device: cpu samples there; a device this machine lacks, or no device name, is one line before
    the model loads."""
    assert generated(["--run", str(tiny_run), "--device", "cpu", "--max-new-tokens", "3", "--prompt", "Hi"], capsys)
    nowhere = ["--run", str(tiny_run / "nowhere")]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"^error: --device cuda: this machine has no such device \(0 CUDA GPUs\)"):
            generate_main([*nowhere, "--device", "cuda"])
    with pytest.raises(SystemExit, match=r"^error: --device cuda:99: this machine has no such device"):
        generate_main([*nowhere, "--device", "cuda:99"])
    with pytest.raises(SystemExit, match="^error: --device gpu0 is not a device name: give cpu, cuda, cuda:N or mps$"):
        generate_main([*nowhere, "--device", "gpu0"])


def test_a_tiny_temperature_samples_the_greedy_text(tiny_run):
    """logits / 1e-40 overflowed to inf and softmax's nan stopped the sampling; the shifted logits go to -inf
    instead, all but the likeliest id."""
    model = load_model(tiny_run)[0]
    greedy = list(generate_samples(model, "Once upon a time", 8, temperature=0.0))
    assert list(generate_samples(model, "Once upon a time", 8, temperature=1e-40, seed=5)) == greedy


@pytest.mark.parametrize("prompt_tokens", [0, 30, 70])  # a new document; within block_size (64); past it
def test_bench_times_generation_as_the_generate_cli_samples(prompt_tokens, capsys):
    bench_main(["--preset", "tiny-cpu", "--generate", "6", "--prompt-tokens", str(prompt_tokens)])
    line = capsys.readouterr().out.strip()
    cpu = re.escape(device_name(torch.device("cpu")))  # the CPU's model, not "cpu"
    assert re.fullmatch(rf"tiny-cpu on {cpu} \(\d+ threads, fp32\): 6 tokens after {prompt_tokens} in [\d.]+ s = "
                        r"[\d.]+ tokens/s", line), line  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "lambda"], "unknown eval task 'lambda': did you mean 'lambada'?"),
        (["--checkpoint", "nowhere"], "checkpoint nowhere does not exist; "),
        pytest.param(
            ["--mixed-precision", "fp16"],
            "fp16 (--mixed-precision or the launch config) does not apply on a CPU: accelerate autocasts to fp16 on "
            "GPUs only; pass --mixed-precision bf16 or no",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 applies on the GPU"),
        ),
    ],
)
def test_cli_bad_arguments_are_one_clear_error(tiny_run, argv, message, fresh_accelerate_state, capsys):
    line = evals_error(["--run", str(tiny_run), "--tasks", "hellaswag", *argv], capsys)
    assert line.startswith("error: ") and message in line


def test_bad_limits_are_one_clear_error(tiny_run, capsys):
    with pytest.raises(SystemExit) as exc:
        evals_main(["--run", str(tiny_run), "--limit", "0"])
    # argparse's line, as every entry point's count says it (data_prep.at_least)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: argument --limit: must be at least 1, got 0")
    model, _ = load_model(tiny_run)
    with pytest.raises(EvalError, match="eval limit must be a positive number of examples"):
        run_task(model, "lambada", get_encoding(), limit=0)


@pytest.fixture
def unprovisionable_tokenizer(tmp_path, monkeypatch) -> Iterator[None]:
    """A machine where the GPT-2 tokenizer cannot be had: none in the cache, tiktoken's host refused at once, and the
    cached sdist it is provisioned from damaged (so no package index is asked either)."""
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / f"openai_whisper-{WHISPER_SDIST[1]}.tar.gz").write_bytes(b"damaged")
    monkeypatch.setenv("BOOKGPT_CACHE", str(cache))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache / "tiktoken"))
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")  # the discard port
    for no_proxy in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(no_proxy, raising=False)
    get_encoding.cache_clear()  # as in a new process
    yield
    get_encoding.cache_clear()


@pytest.mark.parametrize("cli", ["evals", "generate", "bench"])
def test_a_tokenizer_that_cannot_be_provisioned_is_one_clear_error(
    tiny_run, unprovisionable_tokenizer, fresh_accelerate_state, cli, capsys
):
    if cli == "evals":
        line = evals_error(["--run", str(tiny_run), "--tasks", "lambada", "--limit", "1"], capsys)
    else:
        main, argv = {
            "generate": (generate_main, ["--run", str(tiny_run), "--max-new-tokens", "1"]),
            "bench": (bench_main, ["--limit", "1"]),
        }[cli]
        with pytest.raises(SystemExit) as exc:
            main(argv)
        line = str(exc.value.code)
    assert line.startswith("error: cannot load the GPT-2 tokenizer: tiktoken could not fetch it")


def test_json_into_a_missing_folder_is_an_error_before_the_eval(tiny_run, tmp_path, capsys):
    missing = tmp_path / "missing"
    # --run nowhere: had the eval started, the error would be about that
    line = evals_error(["--run", str(tmp_path / "nowhere"), "--json", str(missing / "evals.json")], capsys)
    assert line.startswith(f"error: --json {missing / 'evals.json'}: the folder {missing} does not exist;")
    line = evals_error(["--run", str(tiny_run), "--json", str(tmp_path)], capsys)
    assert line.startswith(f"error: --json {tmp_path} is a folder; pass a file path such as")


def test_json_into_a_folder_that_cannot_be_written_is_an_error_before_the_eval(tmp_path, tmpfs, capsys):
    disk = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    # --run nowhere: had the eval started, the error would be about that
    line = evals_error(["--run", str(tmp_path / "nowhere"), "--json", str(disk / "evals.json")], capsys)
    assert line == f"error: --json {disk / 'evals.json'}: {disk} is not writable by this user; pass another path"


def test_json_on_a_disk_that_fills_up_keeps_the_scores_on_screen_and_no_file_cut_off(tiny_run, tmpfs, capsys):
    disk = tmpfs("1m")
    path = disk / "evals.json"
    fill_disk(disk)  # writable, as the check before the eval finds it, but with no room for the report
    with pytest.raises(SystemExit) as exc:
        evals_main(["--run", str(tiny_run), "--tasks", "lambada", "--limit", "2", "--json", str(path)])
    out, err = capsys.readouterr()
    assert exc.value.code == 1 and "| lambada | acc |" in out
    assert err.splitlines()[-1] == (
        f"error: disk full while writing {path}: free space on {disk} and run the same command again; "
        "the scores are printed above"
    )
    assert [p.name for p in disk.iterdir()] == ["filler"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "tiny-cpuu"], "error: Unknown model preset 'tiny-cpuu'. Did you mean 'tiny-cpu'? Valid presets:"),
    ],
)
def test_bench_bad_arguments_are_one_clear_error(argv, message):
    with pytest.raises(SystemExit) as exc:
        bench_main(argv)
    assert str(exc.value.code).startswith(message)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--limit", "0"], "argument --limit: must be at least 1, got 0"),
        (["--generate", "4", "--prompt-tokens", "-1"], "argument --prompt-tokens: must be at least 0, got -1"),
        (["--batch-size", "2.5"], "argument --batch-size: expected a whole number, got '2.5'"),
    ],
)
def test_bench_bad_counts_are_argparses_line(argv, line, capsys):
    """As every entry point's counts (data_prep.at_least): argparse's line naming the flag, last on screen."""
    with pytest.raises(SystemExit) as exc:
        bench_main(argv)
    assert exc.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"python -m evals.bench: error: {line}"


def test_run_folder_problems_are_one_clear_error(tmp_path, capsys):
    run = new_run(tmp_path)
    line = evals_error(["--run", str(run)], capsys)
    assert re.match(r"error: run folder .* has no checkpoint .*train it first", line)
    with pytest.raises(EvalError, match=r"run folder .*missing does not exist"):
        load_model(tmp_path / "missing")
    other = new_run(tmp_path / "other", preset="small-cpu")  # weights of a tiny-cpu model, config of small-cpu
    write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(other, 1))
    with pytest.raises(EvalError, match=r"step-00000001 does not fit the model that .*config.yaml describes"):
        load_model(other)


@pytest.mark.parametrize("cli", [evals_main, generate_main])
def test_a_run_folder_given_as_model_names_the_run_flag(tiny_run, cli, capsys):
    """--model RUN_FOLDER (the folder, not its export/): the line said "no config.json; see the run's export/ folder",
    not that --run takes the folder as it is."""
    with pytest.raises(SystemExit) as exc:
        cli(["--model", str(tiny_run)])
    # evals prints its line and exits 1; generate exits with the line (sys.exit prints it, exit status 1)
    said = exc.value.code if exc.value.code != 1 else capsys.readouterr().err.strip().splitlines()[-1]
    assert said == (
        f"error: {tiny_run} is a run folder, not an HF-format export: give --run {tiny_run} (its newest checkpoint, "
        f"else its export/), or --model {tiny_run / 'export'}"
    )


@pytest.mark.parametrize("cli", [evals_main, generate_main])
def test_a_checkpoint_or_export_given_as_the_other_flag_names_the_right_one(
    tiny_run, tmp_path, cli, capsys, monkeypatch
):
    """--run RUN/checkpoints/step-N and --run EXPORT said "no checkpoint and no export/ folder: train it first", and
    --model RUN/checkpoints/step-N said to give it as --run; each names the flags that load it."""

    def said(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exc:
            cli(argv)
        # evals prints its line and exits 1; generate exits with the line (sys.exit prints it, exit status 1)
        return exc.value.code if exc.value.code != 1 else capsys.readouterr().err.strip().splitlines()[-1]

    step = checkpoint_dir(tiny_run, 2)
    expected = (
        f"error: {step} is a checkpoint of the run {tiny_run}, not a run folder: give --run {tiny_run} --checkpoint "
        f"{step.name}"
    )
    assert said(["--run", str(step)]) == expected
    assert said(["--model", str(step)]) == expected
    # given from inside the checkpoint: it said ". has no checkpoint ... train it first"
    monkeypatch.chdir(step)
    for given in (".", "../step-00000002"):
        assert said(["--run", given]) == expected.replace(str(step), given, 1)
    export = export_hf(GPT(TINY_MODEL), tmp_path / "export", gpt2_vocab_and_merges())
    is_export = f"error: {export} is an HF-format export, not a run folder: give --model {export}"
    assert said(["--run", str(export)]) == is_export


@pytest.mark.parametrize("damage", ["cut short", "emptied"])
def test_a_damaged_checkpoint_or_export_is_one_line_naming_the_others(tmp_path, capsys, damage: str):
    """A weights file cut short (a copy that stopped, a full disk elsewhere) was safetensors' traceback in evals,
    evals.generate and training.export (and in train_accel.py's --init-from); now one line naming the checkpoint or
    export, what the loader said, and another checkpoint of the run to give."""
    run = new_run(tmp_path / "run")
    for step in (1, 2):
        write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(run, step))
    export = export_hf(GPT(TINY_MODEL), run / "export", gpt2_vocab_and_merges())
    for weights in (checkpoint_dir(run, 2) / "model.safetensors", export / "model.safetensors"):
        weights.write_bytes(weights.read_bytes()[: 5000 if damage == "cut short" else 0])
    line = evals_error(["--run", str(run), "--tasks", "lambada", "--limit", "1"], capsys)
    assert re.fullmatch(
        rf"error: {re.escape(str(checkpoint_dir(run, 2)))} does not load \(SafetensorError: .+\): a file of it is "
        r"damaged; give another of its checkpoints: step-00000001",
        line,
    ), line
    line = evals_error(["--model", str(export), "--tasks", "lambada", "--limit", "1"], capsys)
    assert re.fullmatch(
        rf"error: cannot load the export {re.escape(str(export))}: its weights do not load \(\w+: .+\); export the "
        r"run again \(python -m training.export RUN\) or give another folder",
        line,
    ), line
    assert load_model(run, "step-00000001")[1].endswith("step-00000001 (model.safetensors)")  # the intact one


def test_a_checkpoint_with_a_flipped_byte_is_one_line_in_evals_generate_and_export(tmp_path, capsys):
    """A flipped byte in a checkpoint's weights loaded silently in evals, evals.generate and training.export (a resume
    checks the manifest); now each stops with one line naming the file and another checkpoint. One saved before
    manifests existed still loads."""
    run = new_run(tmp_path / "run")
    for step in (1, 2):
        write_checkpoint(GPT(TINY_MODEL), checkpoint_dir(run, step))
    write_manifest(checkpoint_dir(run, 2))  # step 1: saved before manifests existed
    weights = checkpoint_dir(run, 2) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # in the last tensor's bytes: safetensors still loads the file
    weights.write_bytes(bytes(data))
    line = (
        f"error: checkpoint {checkpoint_dir(run, 2)} is damaged (model.safetensors does not match its sha256 when "
        "saved); give another of its checkpoints: step-00000001"
    )
    assert evals_error(["--run", str(run), "--tasks", "lambada", "--limit", "1"], capsys) == line
    generate, export = ["--run", str(run), "--prompt", "x"], [str(run), "--out", str(tmp_path / "export")]
    for main, argv in ((generate_main, generate), (export_main, export)):
        with pytest.raises(SystemExit, match=f"^{re.escape(line)}$"):
            main(argv)
    assert not (tmp_path / "export").exists()
    assert load_model(run, "step-00000001")[1].endswith("step-00000001 (model.safetensors)")


def test_plot_evals_writes_png(tmp_path):
    tracker = JSONLTracker(tmp_path)
    for step in (10, 20):
        tracker.log({"train_loss": 5.0, "tokens_seen": step * 1024}, step=step)
        # Evals at steps without a train row (eval_interval not a multiple of log_interval).
        tracker.log({"val_loss": 6.0 - step / 10}, step=step + 5)
        tracker.log({"hellaswag_acc_norm": 0.25 + step / 1000, "lambada_acc": 0.01}, step=step + 5)
    out = plot_evals(tmp_path / "metrics.jsonl", tmp_path / "evals.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_malformed_metrics_line_names_it_and_skips_a_row_cut_short(tmp_path, capsys):
    """A row a killed run cut short (the last, without its newline) is left out, as resuming leaves it out; a line
    that is not a row anywhere else is one error naming the file and line."""
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "train_loss": 5.0, "tokens_seen": 10240}, {"step": 10, "val_loss": 5.5}]
    complete = "".join(json.dumps(row) + "\n" for row in rows)
    metrics.write_text(complete + '{"step": 20, "train_lo')
    plot_main([str(tmp_path)])
    assert capsys.readouterr().out == f"{tmp_path / 'evals.png'}\n"
    assert read_metrics(metrics) == rows
    metrics.write_text(complete + '{"step": 20, "train_lo\n' + complete)
    with pytest.raises(SystemExit) as exc:
        plot_main([str(tmp_path)])
    assert str(exc.value.code).startswith(f"error: {metrics} line 3 is not a JSON row (")
    assert str(exc.value.code).endswith("); delete or repair that line")
    metrics.write_text(complete + "[]\n")
    with pytest.raises(SystemExit, match=f"^error: {metrics} line 3 is not a JSON object; delete or repair that line$"):
        plot_main([str(tmp_path)])
