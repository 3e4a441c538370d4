"""Prepare books for training: documents -> GPT-2 tokens (+ <|endoftext|>) -> uint16 shards + manifest.

    python -m data_prep.prepare --source default --out data/default [--num-proc 8]

The source is listed first (names, sizes, mtimes: no text read), then read once: batches of books
go to `num_proc` worker processes that read, clean and tokenize them, while this process appends
their tokens, in order, to the split's shard files and one line per book to `documents.jsonl`.
Memory is bounded by the batches in flight, not by the corpus.

Documents go to train or val by a hash of their id (adding books never moves the others, except in a
library so small that no id hashes into val: its lowest hash goes there, until a new book's is lower), or as
their source splits them (PG-19: its validation and test books are val). A book whose tokens equal an
earlier book's is left out, with a `skipping` line naming both. The
dataset is built in `.NAME.build/` next to `--out` and swapped in by renames at the end, so an
interrupted or failed run leaves any previous dataset untouched (a run killed between the renames is
completed by the next one, before anything else); after every batch the build
records how far it got, and a killed run continues from there when started again with the same
inputs and parameters. Ctrl-C stops after the batch in hand and says so in one line (exit status 130).
Re-running with the same inputs and parameters is a no-op. A rebuild over an earlier dataset copies
the tokens of each book whose cleaned text it holds (text_key on the index lines) from its shards, those
whose sha256 still match, instead of tokenizing the book again: the same bytes as a fresh preparation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock, Timeout
from tqdm import tqdm

from data_prep import DataPrepError
from data_prep.manifest import DOCUMENTS_NAME, DTYPE, FORMAT_VERSION, MANIFEST_NAME, SPLITS, file_sha256, load_manifest
from data_prep.sources import (
    DEFAULT_MIRROR,
    SPEC_HELP,
    Plan,
    Record,
    SourceUnreadable,
    check_texts,
    hf_parts,
    parse_spec,
    plan,
    source_licenses,
)
from data_prep.tokenizer import EOT_ID, TOKENIZER_NAME, TOKENIZER_SHA256, VOCAB_SIZE, get_encoding
from modeling.disk import DiskFull, atomic_write_bytes, cannot_write, disk_full_reported, mount_of

log = logging.getLogger("data_prep.prepare")  # not __name__: that is __main__ under `python -m`

DEFAULT_SHARD_TOKENS = 50_000_000  # 100 MB per shard file
DEFAULT_VAL_FRACTION = 0.1
GPT2_CONTEXT = 1024  # the gpt2-* presets' block_size: a val split shorter than a window + 1 is unusable there
# About what nanoGPT holds out of OpenWebText (0.05% of its 9B tokens): a run's val loss reads --eval-windows
# windows spread over the val split, so a bigger one measures it no better. Past VAL_PLENTY times this many val
# tokens drawn by --val-fraction, the end of the preparation names the fraction that keeps about this many.
VAL_ENOUGH = 5_000_000
VAL_PLENTY = 4
BATCH_BYTES = 1 << 20  # text per worker task: amortises the hand-over, bounds memory, spreads small corpora
BATCH_DOCS = 256  # ... and at most this many books, so tiny documents still make progress checkpoints
PROGRESS_NAME = "progress.json"  # in the build dir only: how far a killed run got
LOG_EVERY_S = 60.0  # where no terminal shows the books' bar: a line of its figures at most this often
# The start-up estimate of a source's size and preparation time. GPT-2 BPE spends ~4.0 bytes of English book prose
# a token (4.01 on LAMBADA's novel passages; 3.25 on the default corpus' verse and drama). Tokenizing is the work: a
# --num-proc worker does 1.1-1.3M tokens per CPU-second (reading, cleaning and tokenizing the default corpus' books
# from parquet through pg19:FOLDER on a 2-core AMD EPYC), the main process under 0.1 CPU-second per 1M tokens.
BYTES_PER_TOKEN = 4.0
TOKENS_PER_SECOND = 1_100_000  # per --num-proc worker with a core of its own


class _SplitWithoutText(DataPrepError):
    """A split that got no book: those drawn for it were left out by the build (empty once cleaned, or repeats of
    earlier books), or there were too few. `written`: the ids of the books the build wrote."""

    def __init__(self, message: str, split: str, written: set[str]) -> None:
        super().__init__(message)
        self.split, self.written = split, written


class PreparationInterrupted(KeyboardInterrupt):
    """Ctrl-C during a preparation; its message says what was kept and what the same command does next."""


def prepare(
    source: str,
    out_dir: str | Path,
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    num_proc: int = 1,
    seed: int = 0,
    mirror: str = DEFAULT_MIRROR,
    streaming: bool = False,
) -> Path:
    """Prepare `source` (see data_prep.sources) into `out_dir`; returns the manifest path.

    Does nothing when `out_dir` already holds this exact preparation (same inputs and params).
    """
    if not 0 < val_fraction < 1:
        raise DataPrepError(
            f"--val-fraction {val_fraction:g} is not between 0 and 1: it is the share of the books that goes to val "
            f"(default {DEFAULT_VAL_FRACTION:g})"
        )
    for flag, value in (("--shard-tokens", shard_tokens), ("--num-proc", num_proc)):
        if value < 1:
            raise DataPrepError(f"{flag} must be >= 1, got {value}")
    parts = parse_spec(source)  # reject a malformed spec before touching anything
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if num_proc > cpus:  # a fork-started pool starts every worker at once: 100,000 of them stalled the machine
        log.warning(
            "warning: --num-proc %d is more than the %d CPUs this process may use: tokenizing on %d",
            num_proc,
            cpus,
            cpus,
        )
        num_proc = cpus
    out = Path(out_dir).absolute()
    if out.is_symlink():  # the data goes where the link points (its disk): the link itself is not replaced
        out = out.resolve()
    _check_out_dir(out)
    _check_out_outside_datasets(out, parts)
    get_encoding()  # fail early (before reading inputs) if the tokenizer can't be provisioned
    params = {"shard_tokens": shard_tokens, "val_fraction": val_fraction, "seed": seed}
    setup = {"format_version": FORMAT_VERSION, "tokenizer": TOKENIZER_SHA256, "source": source, **params}

    log.info("Listing source %r", source)
    books = plan(source, mirror=mirror, streaming=streaming)
    # Inputs known by listing alone (sizes, mtimes, dataset fingerprints): a re-run can skip reading.
    key = _digest({**setup, "inputs": books.key}) if books.key else None

    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):  # several ranks may call prepare() at once; the later ones find it done
        build = out.parent / f".{out.name}.build"
        _settle_swap(build, out)
        if key and _up_to_date(out, key):
            shutil.rmtree(build, ignore_errors=True)  # a killed run of other inputs or parameters
            log.info("%s is up to date (same inputs and parameters); nothing to do", out)
            return out / MANIFEST_NAME
        progress = _progress(build, key)
        if progress is None and (killed := _progress_record(build)) and killed.get("records_done"):
            # its books are dropped: say so, as at PG-19's scale that is most of an hour of work
            log.warning(
                "Starting afresh: the preparation killed in %s after %d books was of other inputs or parameters (a "
                "book added, changed or removed; another --shard-tokens, --val-fraction or --seed), so its books are "
                "prepared again",
                build,
                killed["records_done"],
            )
        if progress is not None and (short := _shortfall(build, progress)):
            # a crash before the OS wrote the last writes out, or an altered file: resuming would pad it with zero
            # bytes (token 0) that its sha256 would then vouch for
            log.warning("Starting %s afresh: %s, fewer than its progress record counts", build, short)
            progress = None
        if progress is None:
            shutil.rmtree(build, ignore_errors=True)
            build.mkdir()
        else:
            log.info("Resuming the killed preparation in %s after %d books", build, progress["records_done"])
            for stray in build.glob(".*.tmp"):  # a write the kill cut short (atomic_write_bytes's temp file)
                stray.unlink()
        with disk_full_reported(out, lambda: _kept(out, build, key)):
            try:
                earlier = _EarlierTokens(out)
                reusable = len(earlier.keys())
                if books.ids is not None and books.text_bytes is not None:  # once the tokens to reuse are known
                    log.info(size_estimate(source, len(books.ids), books.text_bytes, num_proc, reusable))
                    _warn_of_space(build, 2 * books.text_bytes / BYTES_PER_TOKEN)
                elif reusable:  # no estimate to say it in (a streamed source)
                    log.info("Reusing the tokens of up to %d unchanged books from %s", reusable, out)
                check_texts(books.paths[(progress or {"records_done": 0})["records_done"] :])
                splits = _splitter(books, val_fraction, seed)
                try:
                    manifest = _build(build, books, splits, setup, key, num_proc, progress, earlier)
                except _SplitWithoutText as err:
                    manifest = _build_again_without_the_books_left_out(err, build, books, setup, num_proc, earlier)
            except SourceUnreadable as e:  # not the inputs' fault: the books done are kept, as on a full disk
                raise DataPrepError(f"{e}; {_kept(out, build, key)}") from None
            except DataPrepError:  # bad input: fixing it changes the inputs, so this build could not be resumed
                shutil.rmtree(build)
                raise
            except KeyboardInterrupt:
                if key is None:  # a streamed source is read from its start again: nothing here could be used
                    shutil.rmtree(build)
                    again = "a streamed source cannot resume, so the same command starts over"
                elif _progress(build, key) is None:  # before its first batch of books (or in a build drawn again)
                    shutil.rmtree(build)
                    again = "no book was finished yet, so the same command starts from the first"
                else:
                    again = f"the books prepared so far are kept in {build}, and the same command resumes from there"
                raise PreparationInterrupted(f"interrupted: {out} is unchanged; {again}") from None
            if _same_output(out, manifest):  # e.g. files touched but not changed: keep the dataset as it is
                _write_json(out / MANIFEST_NAME, {**json.loads((out / MANIFEST_NAME).read_text()), "source_key": key})
                shutil.rmtree(build)
                log.info("%s is up to date (inputs read again, same content); nothing to do", out)
                return out / MANIFEST_NAME
            (build / PROGRESS_NAME).unlink(missing_ok=True)  # none for a streamed source
            _write_json(build / MANIFEST_NAME, manifest)
            replaced, into_val = _replacing(out, build)
            _swap_in(build, out)
    if replaced:
        log.info(replaced)
    if into_val:
        log.warning(
            "warning: %d book(s) of the train split of the dataset this replaced are in val now (a book's split is "
            "drawn from its id, which a renamed folder or renumbered rows change, --seed and --val-fraction): a run "
            "that trained on it and goes on with --on-new-data continue would be validated on books it trained on; "
            "start such runs afresh, or keep what draws the split",
            into_val,
        )
    totals = manifest["splits"]
    documents = [(d["id"], d["split"], d["num_tokens"]) for d in load_manifest(out, verify="none").documents()]
    # a line a book kept, and one for the part of a book split off by position (ID#val); in a big library the
    # skipping lines scroll away, so the summary counts them (a streamed source's books are not counted up front)
    kept, left_out = sum(not doc_id.endswith("#val") for doc_id, *_ in documents), ""
    if books.ids is not None and kept < len(books.ids):
        left_out = (
            f"; {len(books.ids) - kept} of the {len(books.ids)} books listed left out (each named in a skipping line)"
        )
    log.info(
        "Wrote %s: train %d tokens (%d docs), val %d tokens (%d docs)%s",
        out,
        totals["train"]["num_tokens"],
        totals["train"]["num_documents"],
        totals["val"]["num_tokens"],
        totals["val"]["num_documents"],
        left_out,
    )
    note = _plenty_of_val(documents, books.splits, val_fraction)
    if note:
        log.info(note)
    if totals["val"]["num_tokens"] <= GPT2_CONTEXT:  # written, but the GPT-2 presets' runs could not use it
        # split BY_POSITION: the written corpus is one document (a book left out as empty or repeated counts none),
        # its val part named ID#val
        one_document = any(doc_id.endswith("#val") for doc_id, split, _ in documents if split == "val")
        log.warning(
            "the val split holds %d tokens, fewer than one window of the GPT-2 presets' %d-token context + 1: their "
            "runs would stop at start-up (smaller block_size runs can use it); %s",
            totals["val"]["num_tokens"],
            GPT2_CONTEXT,
            "raise --val-fraction, the share of this one document's tokens val takes, or add books"
            if one_document
            else "add books, as val takes whole books",
        )
    return out / MANIFEST_NAME


def _plenty_of_val(documents: list[tuple[str, str, int]], given: dict[str, str], val_fraction: float) -> str | None:
    """A note where --val-fraction drew far more val tokens than a val loss needs (VAL_PLENTY × VAL_ENOUGH), naming
    the fraction that keeps about VAL_ENOUGH of them; None otherwise. Only the books whose split was drawn count
    (`given`: those whose source names their split, as PG-19's validation books). A smaller fraction keeps a subset
    of these val books, so no book moves from train to val."""
    drawn = [(split, tokens) for doc_id, split, tokens in documents if doc_id.removesuffix("#val") not in given]
    val = sum(tokens for split, tokens in drawn if split == "val")
    if val <= VAL_PLENTY * VAL_ENOUGH:
        return None
    total = sum(tokens for _, tokens in drawn)
    fraction = float(f"{VAL_ENOUGH / total:.0e}")
    kept = _amount(fraction * total, "B", "M", "k")
    return (
        f"note: --val-fraction {val_fraction:g} put {val:,} tokens in val, far more than a run's val loss needs (it "
        f"reads --eval-windows windows of them); to train on most of them, prepare again with --val-fraction "
        f"{fraction:g} (~{kept} tokens stay in val, all from this val split: no book moves there from train)"
    )


def size_estimate(source: str, books: int, text_bytes: int, num_proc: int, reusable: int = 0) -> str:
    """One line: the books, their text, the tokens and shard disk to expect, and the time at our measured rate, which
    is the time to tokenize every book: at most that where a rebuild reuses `reusable` books' tokens."""
    tokens = text_bytes / BYTES_PER_TOKEN
    seconds = tokens / (TOKENS_PER_SECOND * num_proc)
    took = f"~{seconds / 3600:.1f} h" if seconds >= 3600 else f"~{seconds / 60:.0f} min" if seconds >= 60 else "<1 min"
    took = f"at most {took}" if reusable and seconds >= 60 else took
    line = (
        f"{source}: {books:,} books, {_amount(text_bytes, ' GB', ' MB', ' kB')} of text, "
        f"~{_amount(tokens, 'B', 'M', 'k')} tokens (at ~{BYTES_PER_TOKEN:g} bytes a token), "
        f"~{_amount(2 * tokens, ' GB', ' MB', ' kB')} of shards, {took} with {num_proc} process(es) at "
        f"~{TOKENS_PER_SECOND / 1e6:g}M tokens/s each (--num-proc N divides it)"
    )
    if reusable:  # the books are read again, but only the added and changed ones are tokenized
        line += f": the tokens of up to {reusable:,} unchanged books are reused from the dataset this replaces"
    return line


def _warn_of_space(build: Path, shard_bytes: float) -> None:
    """One warning line where the shards estimated will not fit the free space of the build's disk, less what a
    resumed build already wrote there: said at the start, not found hours in (PG-19: ~45 minutes of one process for
    ~5.8 GB). Only a warning, as the estimate is one (verse takes 3.25 bytes a token, not 4)."""
    written = sum(p.stat().st_size for p in build.iterdir() if p.suffix == ".bin")
    free = shutil.disk_usage(build).free
    if shard_bytes - written > free:
        log.warning(
            "warning: the shards need ~%s%s and %s has %s free: free space or choose an --out on another disk, or "
            "the preparation stops where the disk fills (the same command then continues after the books done)",
            _amount(shard_bytes - written, " GB", " MB", " kB"),
            " more" if written else "",
            mount_of(build),
            _amount(free, " GB", " MB", " kB"),
        )


def _amount(value: float, giga: str, mega: str, kilo: str) -> str:
    """3 significant digits and the largest unit that keeps them >= 1 (11.5 GB, 2.88B, 830 kB)."""
    for scale, unit in ((1e9, giga), (1e6, mega), (1e3, kilo)):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value / 1e3:.2g}{kilo}"


def _kept(out: Path, build: Path, key: str | None) -> str:
    """What a preparation stopped by a full disk or a source failing part-way leaves: the books recorded in the
    build's progress (the rerun continues after them; a streamed source cannot be listed again, and a build that
    finished no book has nothing to continue, so either is removed to give the space back), and any previous dataset
    in `out` as it was."""
    previous = f"; {out} is untouched" if (out / MANIFEST_NAME).is_file() else ""
    if key is None:
        shutil.rmtree(build, ignore_errors=True)
        return f"a streamed source cannot be continued, so its partial build was removed{previous}"
    done = (_progress(build, key) or {"records_done": 0})["records_done"]
    if not done:
        shutil.rmtree(build, ignore_errors=True)
        return f"no book was finished yet, so there was nothing to keep: the rerun starts from the first{previous}"
    return f"the {done} books prepared so far are kept in {build} and the rerun continues after them{previous}"


def assign_splits(ids: list[str], val_fraction: float, seed: int = 0) -> dict[str, str]:
    """id -> "train"/"val" by a hash of (seed, id); with >= 2 documents both splits are non-empty."""
    if len(ids) < 2:
        log.warning("only %d document(s): all go to train, there will be no validation split", len(ids))
        return dict.fromkeys(ids, "train")
    score = {i: _score(seed, i) for i in ids}
    val = {i for i in ids if score[i] < val_fraction}
    if not val:
        val = {min(ids, key=score.__getitem__)}
    if len(val) == len(ids):
        val.remove(max(ids, key=score.__getitem__))
    return {i: "val" if i in val else "train" for i in ids}


def _score(seed: int, doc_id: str) -> float:
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big") / 2**64


# The "split" of a corpus's only document (a single input.txt): whole documents cannot give both splits, so its
# last val_fraction of tokens is the val split (_parts), as nanoGPT splits its one text file.
BY_POSITION = "train+val"


def _splitter(
    books: Plan, val_fraction: float, seed: int, left_out: frozenset[str] = frozenset()
) -> Callable[[str], str]:
    """The split of each document: its source's where it names one, else the hash rule; BY_POSITION for a corpus
    of one document. Drawn over the listed ids but those `left_out` (books a build found empty or repeated)."""
    if books.ids is None:  # a streamed source: ids come as it is read, so only the hash rule applies
        return lambda doc_id: books.splits.get(doc_id) or ("val" if _score(seed, doc_id) < val_fraction else "train")
    ids = [i for i in books.ids if i not in left_out]
    free = [i for i in ids if i not in books.splits]
    if len(ids) == 1 and not books.splits:  # one document, and its source names no split for it
        log.info("one document: its last %g%% of tokens are the val split (--val-fraction)", 100 * val_fraction)
        return lambda doc_id: BY_POSITION
    hashed = assign_splits(free, val_fraction, seed) if free else {}
    return lambda doc_id: books.splits.get(doc_id) or hashed[doc_id]


def _parts(doc_id: str, split: str, tokens: np.ndarray, val_fraction: float) -> list[tuple[str, str, np.ndarray]]:
    """(id, split, tokens) of what a document is written as: itself, or split BY_POSITION its head in train and
    its last val_fraction of tokens in val (id + "#val"), each ending in <|endoftext|>."""
    if split != BY_POSITION or len(tokens) < 3:  # under 2 tokens of text: nothing to split (train takes it)
        return [(doc_id, "train" if split == BY_POSITION else split, tokens)]
    cut = min(max(1, round((len(tokens) - 1) * (1 - val_fraction))), len(tokens) - 2)
    return [(doc_id, "train", np.append(tokens[:cut], EOT_ID).astype(DTYPE)), (f"{doc_id}#val", "val", tokens[cut:])]


# Text keys (text_key) of the books whose tokens an earlier dataset in --out holds, verified: a worker hands back
# such a book's key alone, and the main process copies its tokens from there. Set before the workers start.
_reusable: frozenset[str] = frozenset()


def text_key(text: str) -> str:
    """A cleaned book's text_key (on its index lines): the sha256 of the tokenizer, how it is called and the text,
    so equal keys mean equal tokens, whatever the book's name, file or mtime."""
    digest = hashlib.sha256(f"{TOKENIZER_SHA256}:encode_ordinary+eot:".encode())
    digest.update(text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def tokenize_records(records: list[Record]) -> list[tuple[str, str, str, np.ndarray | None]]:
    """Worker task: read and clean each book, then (id, title, text_key, its GPT-2 tokens + <|endoftext|>), the
    tokens None for a book whose key is in _reusable.

    Books empty after cleaning are left out (with a warning).
    """
    enc = get_encoding()
    out = []
    for doc in filter(None, (r.document() for r in records)):
        key = text_key(doc.text)
        if key in _reusable:
            out.append((doc.id, doc.title, key, None))
            continue
        # As encode_ordinary: a literal "<|endoftext|>" inside a book is just text, not a separator. Into a uint32
        # array, not a list of Python ints (~36 bytes a token): preparing one 225 MB book peaked at 2.9 GB, now 1.05.
        ids = enc.encode_to_numpy(doc.text, allowed_special=set(), disallowed_special=())
        tokens = np.empty(len(ids) + 1, dtype=DTYPE)
        tokens[:-1], tokens[-1] = ids, EOT_ID
        out.append((doc.id, doc.title, key, tokens))
    return out


def _batches(records: Iterator[Record]) -> Iterator[list[Record]]:
    batch, size = [], 0
    for record in records:
        batch.append(record)
        size += record.size
        if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tokenized(batches: Iterator[list[Record]], num_proc: int, reusable: frozenset[str]) -> Iterator[tuple[int, list]]:
    """(records in the batch, tokenize_records(batch)) in order, `reusable` as _reusable; at most 2 * num_proc batches
    in flight."""
    global _reusable
    if num_proc == 1:
        _reusable = reusable
        try:
            for batch in batches:
                yield len(batch), tokenize_records(batch)
        finally:
            _reusable = frozenset()
        return
    with (
        _ctrl_c_between_batches() as check,
        ProcessPoolExecutor(num_proc, initializer=_init_worker, initargs=(os.getpid(), reusable)) as pool,
    ):
        pending: deque[tuple[int, Future]] = deque()
        try:
            for batch in batches:
                pending.append((len(batch), pool.submit(tokenize_records, batch)))
                if len(pending) >= 2 * num_proc:
                    count, future = pending.popleft()
                    yield count, future.result()
                    check()  # the consumer has written that batch and its progress checkpoint
            while pending:
                count, future = pending.popleft()
                yield count, future.result()
                check()
        except BrokenProcessPool:  # not the books' fault: what was written so far is kept for the same command
            raise SourceUnreadable(
                "a preparation worker died (killed: by the kernel's OOM killer where memory ran short; a smaller "
                "--num-proc needs less)"
            ) from None
        finally:
            pool.shutdown(cancel_futures=True)


@contextmanager
def _ctrl_c_between_batches() -> Iterator[Callable[[], None]]:
    """Ctrl-C while workers tokenize: noted, and raised by the returned check() between batches, a second Ctrl-C at
    once. A KeyboardInterrupt raised inside concurrent.futures' locks can leave the pool's shutdown waiting forever
    (a hang seen with --num-proc 2)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signal handlers
        yield lambda: None
        return
    pressed = []

    def handle(signum: int, frame: object) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(signum)
        os.write(2, b"\nCtrl-C: stopping after the books in hand (again: at once)\n")  # no lock a print could hold

    def check() -> None:
        if pressed:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, previous)


def _init_worker(parent: int, reusable: frozenset[str]) -> None:
    """Worker initializer. Ctrl-C reaches every process of the terminal's group: the parent alone stops the
    preparation (a worker interrupted inside the task queue's lock leaves the others and the pool waiting on it).
    A killed parent must not leave its workers waiting for tasks forever. `reusable`: _reusable (a spawned worker
    does not inherit it)."""
    global _reusable
    _reusable = reusable
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


class _LoggedBar:
    """The bar's figures as a log line of their own, at most every LOG_EVERY_S seconds and once more at the end."""

    def __init__(self, total: int | None, done: int) -> None:
        self.total, self.initial, self.n, self.shown_n = total, done, done, done
        self.started = self.shown_at = time.monotonic()
        self.form = "{desc}: {n_fmt}/{total_fmt} books ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}]"
        if total is None:  # a streamed source: only reading it tells how many books it has
            self.form = "{desc}: {n_fmt} books [{elapsed}, {rate_fmt}]"

    def update(self, count: int) -> None:
        self.n += count
        if time.monotonic() - self.shown_at >= LOG_EVERY_S:
            self.show()

    def show(self) -> None:
        self.shown_at, self.shown_n = time.monotonic(), self.n
        elapsed = self.shown_at - self.started
        log.info(tqdm.format_meter(self.n, self.total, elapsed, initial=self.initial, prefix="Preparing",
                                   unit="book", bar_format=self.form))  # fmt: skip


@contextmanager
def _books_bar(total: int | None, done: int) -> Iterator[tqdm | _LoggedBar]:
    """The books prepared: tqdm's bar where stderr is a terminal. Elsewhere (a batch job's log, nohup) tqdm would
    redraw it by carriage returns, the whole preparation one line of the log: its figures are lines of their own."""
    if sys.stderr.isatty():
        with tqdm(total=total, initial=done, desc="Preparing", unit="book") as bar:
            yield bar
        return
    bar = _LoggedBar(total, done)
    yield bar
    if bar.n != bar.shown_n:
        bar.show()


def _build_again_without_the_books_left_out(
    err: _SplitWithoutText, build: Path, books: Plan, setup: dict[str, Any], num_proc: int, earlier: _EarlierTokens
) -> dict[str, Any]:
    """A small library whose split fell on a book the build left out (a copy of another, one empty once cleaned: the
    split is drawn over the listed ids, before the build reads the texts) is built again with the split drawn over
    the books it kept; a source that cannot be read again (streamed), or whose books all made it in, stops with err.
    The second build keeps no progress: stopped, the same command does both again, to the same bytes."""
    left_out = frozenset(books.ids or ()) - err.written
    if books.key is None or not left_out:
        raise err
    log.warning(
        "the %s split's books were left out (the skipping lines above): drawing the split again over the %d books "
        "kept, and preparing them anew",
        err.split,
        len(err.written),
    )
    shutil.rmtree(build)
    build.mkdir()
    splits = _splitter(books, setup["val_fraction"], setup["seed"], left_out)
    return _build(build, books, splits, setup, None, num_proc, None, earlier)


def _named(doc_id: str, title: str) -> str:
    return f"{doc_id} ({title!r})" if title else doc_id


def _build(
    build: Path,
    books: Plan,
    split_of: Callable[[str], str],
    setup: dict[str, Any],
    key: str | None,
    num_proc: int,
    progress: dict[str, Any] | None,
    earlier: _EarlierTokens,
) -> dict[str, Any]:
    state = progress or {"records_done": 0, "index_bytes": 0, "writers": {s: {} for s in SPLITS}}
    writers = {s: _ShardWriter(build, s, setup["shard_tokens"], **state["writers"][s]) for s in SPLITS}
    index_path = build / DOCUMENTS_NAME
    index_path.touch()
    os.truncate(index_path, state["index_bytes"])  # drop lines written after the last checkpoint
    done = state["records_done"]
    total = len(books.ids) if books.ids is not None else None
    # Each book's tokens' sha256 (book_sha256 on its index lines) -> its id and title (an hf: dataset's ids are row
    # numbers): a later book with the same text (a file copied under two names, a dataset's repeated rows) is left
    # out, so no text is trained on twice or sits in both train and val.
    kept: dict[str, str] = {}
    with open(index_path, "rb") as index:  # a resumed build's books so far
        for book in map(json.loads, index):
            if "book_sha256" in book:  # none in a build begun before books were compared
                kept.setdefault(book["book_sha256"], _named(book["id"], book["title"]))
    with open(index_path, "ab") as index, _books_bar(total, done) as bar:
        for count, docs in _tokenized(_batches(books.records(done)), num_proc, earlier.keys()):
            for doc_id, title, text, tokens in docs:
                if tokens is None:  # unchanged since the dataset this build replaces: its tokens are there
                    tokens = earlier.tokens(text)
                digest = hashlib.sha256(tokens).hexdigest()
                if digest in kept:
                    log.warning("skipping %s: the same text as %s", _named(doc_id, title), kept[digest])
                    continue
                kept[digest] = _named(doc_id, title)
                parts = _parts(doc_id, split_of(doc_id), tokens, setup["val_fraction"])
                for part_id, split, part in parts:
                    writers[split].write(part)
                    line = {"id": part_id, "title": title, "split": split, "num_tokens": len(part)}
                    line["book_sha256"] = digest
                    if len(parts) == 1:  # a part of a book split by position holds other tokens than the book's
                        line["text_key"] = text
                    index.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
            done += count
            bar.update(count)
            if key is not None:  # a source that can be listed again can be resumed
                index.flush()
                state = {"key": key, "records_done": done, "index_bytes": index.tell()}
                state["writers"] = {s: w.checkpoint() for s, w in writers.items()}
                _write_json(build / PROGRESS_NAME, state)
    shards = [s for w in writers.values() for s in w.close()]
    num_docs, written = {s: 0 for s in SPLITS}, set()
    with open(index_path, "rb") as index:
        for line in map(json.loads, index):
            num_docs[line["split"]] += 1
            written.add(line["id"].removesuffix("#val"))
    if not sum(num_docs.values()):
        raise DataPrepError(f"source {setup['source']!r} produced no documents (all empty); add some books")
    if empty := [s for s in SPLITS if not num_docs[s]]:  # a run needs both: it would stop at its start-up
        raise _SplitWithoutText(
            f"the {empty[0]} split got no text: the books assigned to it were empty after cleaning or repeated "
            "earlier ones (the skipping lines above), or the source has too few; leave those books out or add some",
            empty[0],
            written,
        )
    documents = {"file": DOCUMENTS_NAME, "count": sum(num_docs.values()), "sha256": file_sha256(index_path)}
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": _digest([setup, documents, [s["sha256"] for s in shards]]),  # content: tokens <-> text
        "source_key": key,
        "tokenizer": {"name": TOKENIZER_NAME, "sha256": TOKENIZER_SHA256, "vocab_size": VOCAB_SIZE, "eot_id": EOT_ID},
        "dtype": DTYPE,
        "source": setup["source"],
        "sources": source_licenses(setup["source"]),  # each part's license, and its Hub dataset id
        "params": {k: setup[k] for k in ("shard_tokens", "val_fraction", "seed")},
        "splits": {
            split: {
                "num_tokens": sum(s["num_tokens"] for s in shards if s["split"] == split),
                "num_documents": num_docs[split],
                "num_shards": sum(s["split"] == split for s in shards),
            }
            for split in SPLITS
        },
        "shards": shards,
        "documents": documents,
    }
    return manifest


class _EarlierTokens:
    """The tokens of the books in the dataset in `folder` (the one a rebuild replaces), by text_key: a rebuild copies
    an unchanged book's from there instead of tokenizing it again, to the same bytes. None from a dataset of another
    format or tokenizer, or whose index is not its manifest's; none of a shard whose sha256 is not its manifest's."""

    def __init__(self, folder: Path) -> None:
        self.shards: dict[str, list[tuple[Path, int, int, str]]] = {s: [] for s in SPLITS}  # file, first, count, sha
        self.where: dict[str, tuple[str, int, int]] = {}  # text_key -> (split, first token, tokens)
        try:
            manifest = load_manifest(folder, verify="size")  # raises on another format or tokenizer
            if manifest.documents_sha256 != file_sha256(folder / DOCUMENTS_NAME):
                return
            for shard in manifest.shards:
                files = self.shards[shard.split]
                first = files[-1][1] + files[-1][2] if files else 0
                files.append((folder / shard.file, first, shard.num_tokens, shard.sha256))
            at = dict.fromkeys(SPLITS, 0)
            for book in manifest.documents():
                if "text_key" in book:  # none on a part of a book split by position, nor in an older dataset
                    self.where.setdefault(book["text_key"], (book["split"], at[book["split"]], book["num_tokens"]))
                at[book["split"]] += book["num_tokens"]
            damaged = [  # their books are tokenized again; no shard is read when no book could be reused
                (split, first, first + count)
                for split, files in self.shards.items()
                for path, first, count, sha256 in files
                if self.where and file_sha256(path) != sha256
            ]
            self.where = {
                key: (split, start, count)
                for key, (split, start, count) in self.where.items()
                if not any(split == s and a < start + count and start < b for s, a, b in damaged)
            }
        except (DataPrepError, OSError, ValueError, KeyError, TypeError):  # unreadable: every book is tokenized
            self.where = {}

    def keys(self) -> frozenset[str]:
        return frozenset(self.where)

    def tokens(self, text_key: str) -> np.ndarray:
        split, start, count = self.where[text_key]
        pieces, itemsize = [], np.dtype(DTYPE).itemsize
        for path, first, num, _ in self.shards[split]:  # a book can span shard files
            lo, hi = max(start, first), min(start + count, first + num)
            if lo < hi:
                pieces.append(np.fromfile(path, dtype=DTYPE, count=hi - lo, offset=itemsize * (lo - first)))
        return np.concatenate(pieces)


class _ShardWriter:
    """Appends a split's tokens to `{split}_000.bin`, `{split}_001.bin`, ... of `shard_tokens` each.

    `shards` and `count` (tokens in the open shard) come from a checkpoint when resuming.
    """

    def __init__(self, folder: Path, split: str, shard_tokens: int, shards: tuple = (), count: int = 0) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.shards: list[dict[str, Any]] = list(shards)
        for stale in folder.glob(f"{split}_*.bin"):  # written after the checkpoint
            if int(stale.stem.rpartition("_")[2]) >= len(self.shards) + (count > 0):
                stale.unlink()
        self._file, self._count, self._hash = None, 0, hashlib.sha256()
        if count:
            path = self._path()
            os.truncate(path, 2 * count)
            self._hash.update(path.read_bytes())
            self._file, self._count = open(path, "ab"), count  # noqa: SIM115 - stays open across write() calls

    def _path(self) -> Path:
        return self.folder / _shard_name(self.split, len(self.shards))

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._file is None:
                self._file, self._count, self._hash = open(self._path(), "wb"), 0, hashlib.sha256()  # noqa: SIM115
            take = min(len(tokens), self.shard_tokens - self._count)
            data = tokens[:take].tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def checkpoint(self) -> dict[str, Any]:
        if self._file is not None:
            self._file.flush()  # in the OS's hands: survives the process being killed
        return {"shards": self.shards, "count": self._count if self._file is not None else 0}

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._finish()
        return self.shards

    def _finish(self) -> None:
        self._file.close()
        self.shards.append(
            {"file": Path(self._file.name).name, "split": self.split, "num_tokens": self._count,
             "sha256": self._hash.hexdigest()}
        )  # fmt: skip
        self._file = None


def _shard_name(split: str, index: int) -> str:
    return f"{split}_{index:03d}.bin"


def _progress(build: Path, key: str | None) -> dict[str, Any] | None:
    """The checkpoint of a killed run with the same inputs and parameters, if there is one."""
    state = _progress_record(build)
    return state if state is not None and key is not None and state.get("key") == key else None


def _progress_record(build: Path) -> dict[str, Any] | None:
    """The checkpoint of a killed run, whatever its inputs and parameters, if there is one."""
    try:
        state = json.loads((build / PROGRESS_NAME).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _shortfall(build: Path, state: dict[str, Any]) -> str | None:
    """The first of a killed run's files that holds less than its progress record counts, and how much it holds;
    None when all hold at least that (resuming cuts them back to it)."""
    need = {DOCUMENTS_NAME: state["index_bytes"]}
    for split, writer in state["writers"].items():
        need |= {shard["file"]: 2 * shard["num_tokens"] for shard in writer["shards"]}
        if writer["count"]:
            need[_shard_name(split, len(writer["shards"]))] = 2 * writer["count"]
    for name, size in need.items():
        path = build / name
        have = path.stat().st_size if path.is_file() else 0
        if have < size:
            return f"its {name} holds {have} bytes of {size}"
    return None


def _check_out_dir(out: Path) -> None:
    # Written by replacing it (renames in its parent), and locked there: fail before any work where that cannot be
    if (why := cannot_write(out)) is not None:
        raise DataPrepError(f"cannot write {out}: {why}; choose another --out")
    # The output dir is replaced wholesale, so never take over a folder we did not create.
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not _is_prepared(out))):
        raise DataPrepError(
            f"{out} exists and is not a prepared dataset (no {MANIFEST_NAME} of one); it would be replaced, so "
            f"choose another --out or remove it yourself"
        )


def _check_out_outside_datasets(out: Path, parts: list[tuple[str, str]]) -> None:
    # datasets reads a folder's files at any depth: the shards and lists written there would be read as the dataset's
    for arg in (arg for kind, arg in parts if kind == "hf"):
        folder = Path(hf_parts(arg)[0]).expanduser().absolute()
        if folder.is_dir() and folder in out.parents:
            raise DataPrepError(
                f"--out {out} is inside {folder}, the dataset folder of source 'hf:{arg}': the next preparation would "
                "read what it writes there as the dataset's files; choose an --out outside it"
            )


def _is_prepared(folder: Path) -> bool:
    """Whether `folder`'s manifest.json is a prepared dataset's, not just any file of that name: a training checkpoint
    has one too, and --out at it would have replaced the checkpoint."""
    try:
        raw = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and {"format_version", "tokenizer", "shards"} <= raw.keys()


def _up_to_date(out: Path, key: str) -> bool:
    try:
        raw = json.loads((out / MANIFEST_NAME).read_text())
        return raw.get("source_key") == key and bool(load_manifest(out, verify="sha256"))
    except (OSError, ValueError, DataPrepError):
        return False


def _same_output(out: Path, manifest: dict[str, Any]) -> bool:
    try:
        existing = load_manifest(out, verify="sha256")
    except DataPrepError:
        return False
    return (existing.format_version, existing.fingerprint) == (FORMAT_VERSION, manifest["fingerprint"])


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    # An OS lock (flock on POSIX, msvcrt on Windows): the holder's death frees it (its workers exit with it).
    lock = FileLock(out.parent / f".{out.name}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:  # said: a wait as long as the other preparation (~45 min for PG-19) looked like a hang
        log.info(
            "waiting for the other preparation into %s to finish (it holds %s; Ctrl-C stops waiting)",
            out,
            lock.lock_file,
        )
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _swap_in(build: Path, out: Path) -> None:
    """Replace `out` by the complete `build`. A run killed between the two renames leaves no `out` and the previous
    dataset in _old(out); the next run settles that (_settle_swap) before anything else."""
    old = _old(out)
    if out.exists():
        os.rename(out, old)
    os.rename(build, out)
    shutil.rmtree(old, ignore_errors=True)


def _settle_swap(build: Path, out: Path) -> None:
    """Finish the swap of a run killed inside _swap_in: with `out` gone, its complete build (manifest written, no
    progress record) goes in as that run meant, or else the previous dataset goes back; then what is left of the
    previous dataset goes."""
    old = _old(out)
    if not old.exists():
        return
    if not out.exists():
        if (build / MANIFEST_NAME).is_file() and not (build / PROGRESS_NAME).exists():
            os.rename(build, out)
            log.info("Finished replacing %s with the dataset a killed run had completed", out)
        else:
            os.rename(old, out)
            log.info("Put the previous dataset back in %s, where a killed run had moved it aside", out)
            return
    shutil.rmtree(old)


def _books(folder: Path) -> tuple[dict[str, str | None], dict[str | None, str]]:
    """A prepared dataset's books: id -> the book's sha256, and its books' sha256 -> split ("both" for a book split
    by position, whose two parts are one entry of each)."""
    books: dict[str, str | None] = {}
    splits: dict[str | None, str] = {}
    for d in load_manifest(folder, verify="none").documents():
        books[d["id"].removesuffix("#val")] = d.get("book_sha256")
        splits[d.get("book_sha256")] = "both" if d.get("book_sha256") in splits else d["split"]
    return books, splits


def _replacing(out: Path, build: Path) -> tuple[str | None, int]:
    """One line on the dataset in `out` that the complete `build` replaces (None: none there): which books changed,
    and what that means to the runs that trained on it, whose resume stops on other data; and how many books of its
    train split are in val now (a book's split follows its id, which a renamed folder or renumbered rows change)."""
    if not _is_prepared(out):
        return None, 0
    now, now_splits = _books(build)
    into_val = 0
    try:
        before, before_splits = _books(out)
        added, removed = len(now.keys() - before.keys()), len(before.keys() - now.keys())
        changed = sum(before[b] != now[b] for b in now.keys() & before.keys())
        books = (
            f"books: {added} added, {removed} removed, {changed} changed" if added + removed + changed else "same books"
        )
        into_val = sum(split == "val" and before_splits.get(t) == "train" for t, split in now_splits.items() if t)
    except (DataPrepError, OSError, ValueError, KeyError):  # damaged: it is replaced all the same
        books = "its book list unreadable"
    return (
        f"Replaced the earlier dataset in {out} ({books}): a run that trained on it stops at its resume; resume it "
        "with --on-new-data continue to train on from this data's start (its weights, optimizer and step kept)"
    ), into_val


def _old(out: Path) -> Path:
    """Where _swap_in moves the previous dataset aside: one fixed name, so a killed run's is found (under the lock)."""
    return out.parent / f".{out.name}.old"


def _write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.prepare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--source",
        action="append",
        help=f"books to use: {SPEC_HELP}; repeat or join with '+' to combine (default: default)",
    )
    parser.add_argument("--out", required=True, help="output folder (created or replaced as a whole)")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per .bin shard")
    parser.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="share of books for val")
    parser.add_argument("--num-proc", type=int, default=1, help="worker processes reading and tokenizing books")
    parser.add_argument("--seed", type=int, default=0, help="salt of the train/val split hash")
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="Project Gutenberg base URL for gutenberg:")
    parser.add_argument(
        "--streaming", action="store_true", help="stream hf: datasets instead of downloading (pg19 always streams)"
    )
    args = parser.parse_args(argv)
    # This project's lines on the screen, through a handler of its own: one on the root logger printed every line of
    # datasets and huggingface_hub twice, as each library has a handler of its own as well (their INFO lines, an HTTP
    # request each, are left out as before that; other libraries' warnings still show, once, through logging's own).
    screen = logging.StreamHandler()
    screen.setFormatter(logging.Formatter("%(message)s"))
    project = logging.getLogger("data_prep")
    project.setLevel(logging.INFO)
    project.addHandler(screen)
    try:
        prepare(
            "+".join(args.source or ["default"]),
            args.out,
            shard_tokens=args.shard_tokens,
            val_fraction=args.val_fraction,
            num_proc=args.num_proc,
            seed=args.seed,
            mirror=args.mirror,
            streaming=args.streaming,
        )
    except (DataPrepError, DiskFull) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(str(e) or f"interrupted: the same command prepares {args.out}", file=sys.stderr)
        return 130
    finally:
        project.removeHandler(screen)  # a second main() in the same process (the tests) prints each line once too
    return 0


if __name__ == "__main__":
    sys.exit(main())
