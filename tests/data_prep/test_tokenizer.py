"""GPT-2 tokenizer provisioning (the real PyPI sdist, cached in the user cache after the first run)."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import data_prep.tokenizer as tokenizer
from data_prep import DataPrepError
from data_prep.assets import sdist
from data_prep.tokenizer import (
    EOT_ID,
    TOKENIZER_SHA256,
    WHISPER_SDIST,
    get_encoding,
    gpt2_vocab_and_merges,
    prompt_tokens,
)
from modeling.disk import cache_dir
from testkit import REPO


def _offline_env(cache: Path) -> dict[str, str]:
    """Env for a child process that can reach neither tiktoken's host nor a package index."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "tiktoken_cache_dir")}
    dead = "http://127.0.0.1:9"  # the discard port: connections are refused at once
    env.update(
        BOOKGPT_CACHE=str(cache),
        TIKTOKEN_CACHE_DIR=str(cache / "tiktoken"),
        HTTPS_PROXY=dead,
        https_proxy=dead,
        HTTP_PROXY=dead,
        http_proxy=dead,
        PIP_NO_INDEX="1",
        PYTHONPATH=str(REPO),
    )
    return env


def _load_in_child(cache: Path) -> subprocess.CompletedProcess:
    code = "from data_prep.tokenizer import get_encoding; print(get_encoding().encode('Hello world'))"
    return subprocess.run([sys.executable, "-c", code], env=_offline_env(cache), capture_output=True, text=True)


def test_encoding_is_gpt2():
    enc = get_encoding()
    assert enc.name == "gpt2" and enc.n_vocab == 50257 and enc.eot_token == EOT_ID == 50256
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_ID]
    text = "To be, or not to be: that is the question.\n\n  Whether 'tis nobler\r\n\u00e6sthetic 123"
    assert enc.decode(enc.encode_ordinary(text)) == text


@pytest.mark.slow
def test_a_prompt_reads_endoftext_as_the_separator_and_an_empty_one_starts_a_document():
    """Training's samples and evals.generate encode prompts alike, <|endoftext|> as the export's tokenizer reads it
    (tests/evals/test_cli.py compares the two): no prompt a user can type raises."""
    enc = get_encoding()
    assert prompt_tokens("") == [EOT_ID]
    assert prompt_tokens("<|endoftext|>ROMEO:") == [EOT_ID, *enc.encode_ordinary("ROMEO:")]
    assert enc.decode(prompt_tokens("<|endoftext|>ROMEO:")) == "<|endoftext|>ROMEO:"
    assert prompt_tokens("<|fim_prefix|>") == enc.encode_ordinary("<|fim_prefix|>")  # not GPT-2's: ordinary text


def test_provisions_ranks_from_cached_whisper_sdist_offline(tmp_path):
    archive = sdist(*WHISPER_SDIST)  # downloads into the user cache on the very first run
    (tmp_path / "downloads").mkdir()
    shutil.copy(archive, tmp_path / "downloads")
    result = _load_in_child(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[15496, 995]"
    ranks = (tmp_path / "tokenizer" / "gpt2.tiktoken").read_bytes()
    assert hashlib.sha256(ranks).hexdigest() == TOKENIZER_SHA256


@pytest.mark.slow
def test_unprovisionable_tokenizer_says_how_to_fix(tmp_path):
    result = _load_in_child(tmp_path)
    assert result.returncode != 0
    message = result.stderr
    assert "cannot load the GPT-2 tokenizer" in message
    assert "pip download --no-deps --no-binary :all: openai-whisper==20250625" in message
    assert str(tmp_path / "tokenizer" / "gpt2.tiktoken") in message
    assert not (tmp_path / "tokenizer").exists()


def read_only(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


@pytest.mark.slow  # a child process loads the tokenizer
def test_a_cache_that_cannot_be_written_says_where_and_what_to_do(tmpfs, monkeypatch):
    """A read-only cache folder (a read-only home, another user's folder): provisioning the tokenizer stops with one
    line naming the folder and BOOKGPT_CACHE, before the download and where its ranks would be kept."""
    archive = sdist(*WHISPER_SDIST)  # in the user cache
    disk = tmpfs("20m")
    monkeypatch.setenv("BOOKGPT_CACHE", str(disk / "cache"))
    what = ("set BOOKGPT_CACHE to a folder you can write, with room for the tokenizer, the default books and the "
            "eval data (~20 MB), or make room there")  # fmt: skip
    (disk / "cache" / "downloads").mkdir(parents=True)
    read_only(disk)
    with pytest.raises(DataPrepError) as err:  # nothing cached: the download's folder cannot be made
        sdist("openai-whisper", "0.0.0", "0" * 64)
    assert str(err.value) == f"cannot write in {disk / 'cache' / 'downloads'} (Read-only file system): {what}"

    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    shutil.copy(archive, disk / "cache" / "downloads")  # the archive cached, its ranks not yet taken out
    read_only(disk)
    with pytest.raises(DataPrepError) as err:
        tokenizer._provision_ranks()
    ranks_folder = f"cannot write in {disk / 'cache' / 'tokenizer'} (Read-only file system): {what}"
    assert str(err.value) == ranks_folder
    # as a process sees it when tiktoken's host is out of reach too: no advice to put the ranks there by hand
    result = _load_in_child(disk / "cache")
    last = result.stderr.strip().splitlines()[-1]
    fetch = re.escape("data_prep.DataPrepError: cannot load the GPT-2 tokenizer: tiktoken could not fetch it (")
    assert re.fullmatch(rf"{fetch}\w+\), and {re.escape(ranks_folder)}", last), result.stderr[-3000:]


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("BOOKGPT_CACHE")
    assert cache_dir() == tmp_path / "x" / "bookgpt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "bookgpt"


def test_corrupt_cached_archive_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    bad = tmp_path / "downloads" / "openai_whisper-20250625.tar.gz"
    bad.write_bytes(b"not really a tarball")
    with pytest.raises(
        DataPrepError, match=r"openai_whisper-20250625.tar.gz has sha256 \w+, expected 37a91a.*delete it"
    ):
        sdist(*WHISPER_SDIST)


def test_vocab_and_merges_are_derived_once_per_machine_and_a_damaged_copy_again(monkeypatch, tmp_path):
    """The export's tokenizer files, derived from the ranks and kept in the cache: read back as derived; a damaged
    copy, or one of other ranks, is derived again and replaced, never used."""
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    derivations, derive_for_real = [], tokenizer._derive_vocab_and_merges

    def derive(encoding):
        derivations.append(encoding)
        return derive_for_real(encoding)

    monkeypatch.setattr(tokenizer, "_derive_vocab_and_merges", derive)
    saved = tmp_path / "tokenizer" / "gpt2-vocab-merges.json"

    def fresh_call():
        gpt2_vocab_and_merges.cache_clear()  # as in a new process
        return gpt2_vocab_and_merges()

    vocab, merges = fresh_call()
    # GPT-2's vocab.json and merges.txt: 50,257 ids, 50,000 merges, the first one "Ġ t" (a space, then t)
    assert len(vocab) == 50257 and vocab["<|endoftext|>"] == EOT_ID and vocab["Hello"] == 15496
    assert len(merges) == 50000 and merges[0] == ("Ġ", "t")
    assert len(derivations) == 1 and saved.is_file()
    assert fresh_call() == (vocab, merges) and len(derivations) == 1  # read, not derived
    text = saved.read_text()
    for damaged in (text[: len(text) // 2], text.replace(TOKENIZER_SHA256, "0" * 64)):
        saved.write_text(damaged)
        assert fresh_call() == (vocab, merges)
        assert json.loads(saved.read_text())["ranks_sha256"] == TOKENIZER_SHA256  # replaced by the derived files
    assert len(derivations) == 3
    gpt2_vocab_and_merges.cache_clear()
