"""prepare: exact tokens, document-level split, idempotence, and never damaging a good dataset."""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep import DataPrepError, sources
from data_prep import prepare as prepare_module
from data_prep.manifest import load_manifest
from data_prep.prepare import DOCUMENTS_NAME, _exclusive, assign_splits, main, prepare
from data_prep.sources import iter_documents
from data_prep.tokenizer import EOT_ID, get_encoding
from testkit import REPO, fill_disk


def _split_tokens(data_dir: Path, split: str) -> np.ndarray:
    manifest = load_manifest(data_dir)
    parts = [np.fromfile(data_dir / s.file, dtype=np.uint16) for s in manifest.shards_of(split)]
    return np.concatenate(parts).astype(np.int64)


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.iterdir())}


def _write_books(folder: Path, n: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        text = f"Book {i} of {folder.name}.\n" + f"Line {i} of a small book.\n" * 50  # another folder: another book
        (folder / f"book{i}.txt").write_text(text, encoding="utf-8")
    return folder


def _check_exact(data_dir: Path, source: str) -> None:
    """Shards hold exactly tiktoken's tokens of the cleaned texts + one EOT each, split by document."""
    enc = get_encoding()
    docs = {d.id: d for d in iter_documents(source)}
    manifest = load_manifest(data_dir, verify="sha256")
    assert [d["id"] for d in manifest.documents()] == list(docs)
    for split in ("train", "val"):
        tokens = _split_tokens(data_dir, split)
        listed = [d for d in manifest.documents() if d["split"] == split]
        assert listed, f"no {split} documents"
        assert len(tokens) == manifest.splits[split]["num_tokens"] == sum(d["num_tokens"] for d in listed)
        assert len(tokens) == sum(len(enc.encode_ordinary(docs[d["id"]].text)) + 1 for d in listed)
        ends = np.flatnonzero(tokens == EOT_ID)
        assert len(ends) == len(listed) and ends[-1] == len(tokens) - 1
        texts = [enc.decode(part.tolist()) for part in np.split(tokens, ends + 1)[:-1]]
        assert [t.removesuffix("<|endoftext|>") for t in texts] == [docs[d["id"]].text for d in listed]
    train = {d["id"] for d in manifest.documents() if d["split"] == "train"}
    val = {d["id"] for d in manifest.documents() if d["split"] == "val"}
    assert train.isdisjoint(val) and train | val == set(docs)


def test_prepared_books_fixture_is_exact_and_sharded(prepared_books):
    manifest = load_manifest(prepared_books)
    _check_exact(prepared_books, manifest.source)
    assert [s.file for s in manifest.shards] == ["train_000.bin", "train_001.bin", "train_002.bin", "val_000.bin"]
    assert all(s.num_tokens == 40_000 for s in manifest.shards[:2])
    assert (manifest.vocab_size, manifest.eot_id, manifest.dtype) == (50257, EOT_ID, "uint16")
    assert manifest.params == {"shard_tokens": 40_000, "val_fraction": 0.1, "seed": 0}
    assert sorted(p.name for p in prepared_books.iterdir()) == sorted(
        [s.file for s in manifest.shards] + ["documents.jsonl", "manifest.json"]
    )


@pytest.mark.slow
def test_whole_default_corpus_with_two_processes(tmp_path):
    prepare("default", tmp_path / "default", num_proc=2)
    _check_exact(tmp_path / "default", "default")
    manifest = load_manifest(tmp_path / "default")
    assert len(list(manifest.documents())) == 48
    assert manifest.splits["val"]["num_documents"] == 5


def test_the_same_books_read_from_another_folder_are_the_same_content(tmp_path):
    """Machines that prepare node-local copies of one corpus from different paths hold the same data: the content
    digest, which the ranks of a run compare, is equal though the fingerprint (which names the source) is not.
    Another book changes it."""
    for folder in ("node0/books", "node1/mnt/books"):
        _write_books(tmp_path / folder)
    prepare(f"files:{tmp_path / 'node0/books'}", tmp_path / "a", val_fraction=0.25)
    prepare(f"files:{tmp_path / 'node1/mnt/books'}", tmp_path / "b", val_fraction=0.25)
    a, b = load_manifest(tmp_path / "a"), load_manifest(tmp_path / "b")
    assert a.fingerprint != b.fingerprint and a.content_digest == b.content_digest
    (tmp_path / "node1/mnt/books/extra.txt").write_text("One more book, which the other machine does not have.")
    prepare(f"files:{tmp_path / 'node1/mnt/books'}", tmp_path / "c", val_fraction=0.25)
    assert load_manifest(tmp_path / "c").content_digest != a.content_digest


def test_split_is_stable_when_books_are_added_and_never_empty():
    ids = [f"files/book{i}.txt" for i in range(200)]
    before = assign_splits(ids[:100], 0.1)
    after = assign_splits(ids, 0.1)
    assert all(after[i] == before[i] for i in ids[:100])
    assert 10 <= list(after.values()).count("val") <= 30
    assert assign_splits(ids[:100], 0.1, seed=1) != before
    for n in (2, 3):
        for fraction in (1e-9, 0.999999):
            assert sorted(set(assign_splits(ids[:n], fraction).values())) == ["train", "val"]
    assert assign_splits(ids[:1], 0.5) == {ids[0]: "train"}


def test_a_corpus_of_one_document_is_split_by_position(tmp_path):
    """One input.txt, as nanoGPT users bring: whole documents cannot give a val split, so the document's last
    val_fraction of tokens is val; the two parts are the document's tokens, cut once, each ending in EOT."""
    book = _write_books(tmp_path / "one", n=1) / "book0.txt"
    data = tmp_path / "data"
    prepare(f"files:{book}", data, val_fraction=0.25)
    manifest = load_manifest(data, verify="sha256")
    [doc] = iter_documents(f"files:{book}")
    assert [(d["id"], d["split"]) for d in manifest.documents()] == [(doc.id, "train"), (doc.id + "#val", "val")]
    whole = get_encoding().encode_ordinary(doc.text)
    train, val = _split_tokens(data, "train"), _split_tokens(data, "val")
    assert train[-1] == val[-1] == EOT_ID and train[:-1].tolist() + val[:-1].tolist() == whole
    assert len(val) - 1 == pytest.approx(0.25 * len(whole), abs=1)
    assert manifest.splits["val"]["num_documents"] == manifest.splits["train"]["num_documents"] == 1


def test_a_val_split_far_larger_than_a_val_loss_needs_names_the_fraction_that_trains_on_the_rest(
    tmp_path, caplog, monkeypatch
):
    """--val-fraction's 10% of a big library is hundreds of times what a run's val loss reads: one note at the end
    names the fraction that keeps ~VAL_ENOUGH tokens in val (here 400 of ~16,000); prepared again with it, val holds
    some of the same books and no other, and no note."""
    monkeypatch.setattr(prepare_module, "VAL_ENOUGH", 400)
    library, data = _write_books(tmp_path / "library", n=40), tmp_path / "data"
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{library}", data, val_fraction=0.5)
    before = load_manifest(data).splits
    total = before["train"]["num_tokens"] + before["val"]["num_tokens"]
    fraction = float(f"{400 / total:.0e}")
    assert (
        f"note: --val-fraction 0.5 put {before['val']['num_tokens']:,} tokens in val, far more than a run's val loss "
        f"needs (it reads --eval-windows windows of them); to train on most of them, prepare again with --val-fraction "
        f"{fraction:g} (~{fraction * total / 1e3:.2g}k tokens stay in val, all from this val split: no book moves "
        "there from train)"
    ) in caplog.messages
    val_books = {d["id"] for d in load_manifest(data).documents() if d["split"] == "val"}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{library}", data, val_fraction=fraction)
    now = {d["id"] for d in load_manifest(data).documents() if d["split"] == "val"}
    assert now and now < val_books and "note:" not in caplog.text


def test_a_val_split_too_short_for_a_gpt2_window_is_said_when_written(tmp_path, caplog):
    """A val split of fewer tokens than one 1,024-token window + 1 was written without a word; the GPT-2 presets' runs
    then stopped at start-up. One warning line at the end of the preparation, and none for a val split that holds a
    window."""
    short = _write_books(tmp_path / "short", n=1)  # one book, split by position: val ~ a tenth of ~450 tokens
    with caplog.at_level(logging.WARNING, logger="data_prep.prepare"):
        prepare(f"files:{short}", tmp_path / "data")
    val = load_manifest(tmp_path / "data").splits["val"]["num_tokens"]
    assert val <= 1024
    assert (
        f"the val split holds {val} tokens, fewer than one window of the GPT-2 presets' 1024-token context + 1: their "
        "runs would stop at start-up (smaller block_size runs can use it); raise --val-fraction, the share of this one "
        "document's tokens val takes, or add books"
    ) in caplog.text
    repeated = _write_books(tmp_path / "repeated", n=1)  # its second book a copy, left out: one document again
    (repeated / "copy.txt").write_text((repeated / "book0.txt").read_text())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep.prepare"):
        prepare(f"files:{repeated}", tmp_path / "repeated_data")
    assert "raise --val-fraction, the share of this one document's tokens val takes, or add books" in caplog.text
    few = _write_books(tmp_path / "few", n=3)  # whole books: val takes one or more of the three, ~150 tokens each
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep.prepare"):
        prepare(f"files:{few}", tmp_path / "few_data")
    assert load_manifest(tmp_path / "few_data").splits["val"]["num_documents"] >= 1
    assert caplog.text.rstrip().endswith(
        "runs would stop at start-up (smaller block_size runs can use it); add books, as val takes whole books"
    )
    long = tmp_path / "long"
    long.mkdir()
    (long / "book.txt").write_text("".join(f"Line {i} of a long book.\n" for i in range(2000)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep.prepare"):
        prepare(f"files:{long}", tmp_path / "long_data")
    assert load_manifest(tmp_path / "long_data").splits["val"]["num_tokens"] > 1025
    assert "the val split holds" not in caplog.text


def test_empty_files_and_any_case_of_txt_are_sorted_out_before_the_split(tmp_path, caplog):
    """A library as it comes: an empty notes.txt took the val split's only place (val 0 tokens, found by the run's
    start-up), and a BOOK.TXT from a DOS-era archive was silently left out. The empty file is left out before the
    split, saying so, and .TXT is a book: the one book here is split by position, as a corpus of one."""
    library = _write_books(tmp_path / "library", n=1)
    (library / "notes.txt").write_text("")
    data = tmp_path / "data"
    with caplog.at_level(logging.WARNING):
        prepare(f"files:{library}", data)
    assert "skipping files/library/notes.txt: an empty file" in caplog.text
    manifest = load_manifest(data)
    assert [(d["id"], d["split"]) for d in manifest.documents()] == [
        ("files/library/book0.txt", "train"),
        ("files/library/book0.txt#val", "val"),
    ]
    (library / "book0.txt").rename(library / "BOOK0.TXT")
    _write_books(tmp_path / "more", n=1)
    (tmp_path / "more" / "book0.txt").rename(library / "Book1.Txt")
    prepare(f"files:{library}", data)
    ids = sorted(d["id"].removesuffix("#val") for d in load_manifest(data).documents())
    assert ids == ["files/library/BOOK0.TXT", "files/library/Book1.Txt"]


def _stopped_at_book(n: int, monkeypatch: pytest.MonkeyPatch, source: str, out: Path, **args: float) -> None:
    """prepare(source, out) stopped as by Ctrl-C when it reaches the n-th book, a progress record written after every
    book (BATCH_DOCS 1, left set): the build and its record are kept, for the next prepare() to resume or redo."""
    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 1)
    real, calls = prepare_module.tokenize_records, []

    def stopped(records: list) -> list:
        calls.append(records)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(records)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(prepare_module, "tokenize_records", stopped)
        prepare(source, out, **args)


def test_ctrl_c_before_a_book_is_finished_says_so_and_leaves_no_build(tmp_path, monkeypatch):
    """Stopped in its first batch of books, a build has nothing to resume from: the line said "the books prepared so
    far are kept ... and the same command resumes from there" over an empty folder."""
    library = _write_books(tmp_path / "library", n=3)

    def ctrl_c(records: list) -> list:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "tokenize_records", ctrl_c)
    with pytest.raises(prepare_module.PreparationInterrupted) as interrupted:
        prepare(f"files:{library}", tmp_path / "data")
    assert str(interrupted.value) == (
        f"interrupted: {tmp_path / 'data'} is unchanged; no book was finished yet, so the same command starts from the "
        "first"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "library"]


def test_a_dataset_prepared_into_the_library_is_no_part_of_it(tmp_path, caplog):
    """`--source files:lib --out lib/prepared`: the next run said "4 file(s) not read, books are read from .txt files
    only (2 .bin, 1 .json, 1 .jsonl)", counting the dataset's own shards, manifest and index. It is left out of the
    listing, said once, and the run finds the dataset up to date."""
    library = _write_books(tmp_path / "library")
    prepare(f"files:{library}", library / "prepared", val_fraction=0.25)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep"):
        prepare(f"files:{library}", library / "prepared", val_fraction=0.25)
    assert not any("not read" in m for m in caplog.messages), caplog.messages
    said = [m for m in caplog.messages if str(library / "prepared") in m and "skipping" in m]
    assert said == [f"skipping {library / 'prepared'}: a prepared dataset (manifest.json), no books"]
    assert f"{library / 'prepared'} is up to date (same inputs and parameters); nothing to do" in caplog.messages


def test_a_book_an_earlier_book_repeats_is_left_out_and_stays_out_on_resuming(tmp_path, monkeypatch, caplog):
    """One book saved under two names: it was trained on twice, and the hash could put one copy in train and the
    other in val, where the val loss would score text the model had learned. The later copy is left out, saying
    which book it repeats; a preparation stopped between the two leaves it out when resumed as well."""
    library = _write_books(tmp_path / "library", n=6)
    book1 = library / "book1.txt"
    book1.write_text("Title: Emma\n\n" + book1.read_text())  # named by title too: an hf: dataset's ids are rows
    shutil.copy(book1, library / "book4.txt")
    source, args = f"files:{library}", {"val_fraction": 0.25}
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, tmp_path / "fresh", **args)
    assert "skipping files/library/book4.txt ('Emma'): the same text as files/library/book1.txt ('Emma')" in caplog.text
    # the line saying what was written counts it too: in a big library the skipping lines scroll away
    [wrote] = [m for m in caplog.messages if m.startswith("Wrote ")]
    assert wrote.endswith(" docs); 1 of the 6 books listed left out (each named in a skipping line)"), wrote
    books = list(load_manifest(tmp_path / "fresh").documents())
    assert [d["id"] for d in books] == [f"files/library/book{i}.txt" for i in (0, 1, 2, 3, 5)]
    assert len({d["book_sha256"] for d in books}) == 5

    _stopped_at_book(3, monkeypatch, source, tmp_path / "data", **args)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, tmp_path / "data", **args)
    assert "after 2 books" in caplog.text  # book1 was prepared before the stop; its copy after it
    assert "skipping files/library/book4.txt ('Emma'): the same text as files/library/book1.txt ('Emma')" in caplog.text
    assert _snapshot_bytes(tmp_path / "data") == _snapshot_bytes(tmp_path / "fresh")


def test_a_killed_preparation_of_other_inputs_is_said_to_start_afresh(tmp_path, monkeypatch, caplog):
    """Killed after 3 books, then a book was changed: the same command prepared every book again from the first,
    without a word of the books done being dropped (at PG-19's scale, most of 45 minutes)."""
    library = _write_books(tmp_path / "library", n=5)
    _stopped_at_book(4, monkeypatch, f"files:{library}", tmp_path / "data")
    (library / "book4.txt").write_text("Book 4, revised.\n" * 20, encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{library}", tmp_path / "data")
    build = tmp_path / ".data.build"
    assert (
        f"Starting afresh: the preparation killed in {build} after 3 books was of other inputs or parameters (a book "
        "added, changed or removed; another --shard-tokens, --val-fraction or --seed), so its books are prepared again"
    ) in caplog.messages


def test_a_split_whose_books_were_left_out_is_drawn_again_over_the_books_kept(tmp_path, caplog):
    """Two books, one of them empty only once cleaned (blank lines): the split is drawn over the listed ids before
    the texts are read, so one split held only the blank book, and the preparation stopped at its end ("the val
    split got no text") though the other book could give both. Now the build is done again with the split drawn over
    the books kept: here one book, split by position, to the bytes of a library of that book alone."""
    library = _write_books(tmp_path / "library", n=2)
    (library / "book1.txt").write_text("\n\n   \n")  # not an empty file: empty once cleaned
    with caplog.at_level(logging.WARNING, logger="data_prep.prepare"):
        prepare(f"files:{library}", tmp_path / "data")
    assert "split's books were left out (the skipping lines above): drawing the split again over the 1 books" in (
        caplog.text
    )
    alone = _write_books(tmp_path / "alone" / "library", n=1)  # the same id: files/library/book0.txt
    prepare(f"files:{alone}", tmp_path / "alone_data")
    assert _shards_and_documents(tmp_path / "data") == _shards_and_documents(tmp_path / "alone_data")
    assert [d["split"] for d in load_manifest(tmp_path / "data").documents()] == ["train", "val"]


def test_a_copy_drawn_for_val_gives_its_place_to_a_book_kept(tmp_path):
    """A library where no id hashes below --val-fraction puts its lowest in val: here a copy of another book, which
    the build leaves out. The split is drawn again without it: the library prepares as it does without the copy."""
    library = _write_books(tmp_path / "library", n=4)
    ids = [f"files/library/book{i}.txt" for i in range(4)]
    lowest = min(prepare_module._score(0, i) for i in ids)
    # a name listed after the books (so the build keeps the original) whose id hashes below every book's
    copy = next(f"copy{k}.txt" for k in range(1000) if prepare_module._score(0, f"files/library/copy{k}.txt") < lowest)
    args = {"val_fraction": 1e-6}  # no id hashes below it
    prepare(f"files:{library}", tmp_path / "without", **args)
    shutil.copy(library / "book2.txt", library / copy)
    prepare(f"files:{library}", tmp_path / "data", **args)
    assert _shards_and_documents(tmp_path / "data") == _shards_and_documents(tmp_path / "without")
    assert load_manifest(tmp_path / "data").splits["val"]["num_documents"] == 1


def _shards_and_documents(folder: Path) -> dict[str, bytes]:
    """A prepared dataset's token shards and documents index: what two preparations of the same books share (the
    manifest also records each one's inputs)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".bin" or p.name == DOCUMENTS_NAME}


def _killed(records: list) -> list:
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer takes a worker
    return []


def test_a_file_unreadable_before_a_resumed_build_keeps_it_for_the_same_command(tmp_path, monkeypatch):
    """A file that cannot be read (gone for a moment, its permissions) is not bad text: made readable again, its size
    and mtime are as listed, so the build stopped earlier is kept and the same command resumes it to the bytes of a
    preparation never stopped (a file that is not text discards it: fixing that file changes the inputs)."""
    library = _write_books(tmp_path / "library", n=6)
    source, args = f"files:{library}", {"val_fraction": 0.25}
    prepare(source, tmp_path / "fresh", **args)
    _stopped_at_book(3, monkeypatch, source, tmp_path / "data", **args)
    build = tmp_path / ".data.build"
    aside = tmp_path / "book4.txt"

    def listed_then_moved_away(*a, **kw):  # by another program, between the listing and the read
        books = sources.plan(*a, **kw)
        (library / "book4.txt").rename(aside)
        return books

    with monkeypatch.context() as patch, pytest.raises(DataPrepError) as err:
        patch.setattr(prepare_module, "plan", listed_then_moved_away)
        prepare(source, tmp_path / "data", **args)
    assert re.fullmatch(
        rf"cannot read {library}/book4.txt \(No such file or directory\); make it readable and run the same command "
        rf"again, or leave it out of the source; the 2 books prepared so far are kept in {build} and the rerun "
        r"continues after them",
        str(err.value),
    ), str(err.value)
    aside.rename(library / "book4.txt")  # back, its mtime as it was
    prepare(source, tmp_path / "data", **args)
    assert _snapshot_bytes(tmp_path / "data") == _snapshot_bytes(tmp_path / "fresh")


def test_a_worker_killed_mid_preparation_is_one_line_and_the_same_command_finishes(tmp_path, monkeypatch):
    """A --num-proc worker the OOM killer takes: concurrent.futures' BrokenProcessPool traceback before. Now one line
    that keeps the build, and the same command finishes it to the bytes of a preparation never interrupted. Killed
    in its first batch, the build has no book to keep, and the line says so (it said "the 0 books prepared so far
    are kept")."""
    library = _write_books(tmp_path / "library", n=6)
    monkeypatch.setattr(prepare_module, "tokenize_records", _killed)  # the pool's workers are sent it by name
    with pytest.raises(DataPrepError) as err:
        prepare(f"files:{library}", tmp_path / "data", num_proc=2)
    assert str(err.value) == (
        "a preparation worker died (killed: by the kernel's OOM killer where memory ran short; a smaller --num-proc "
        "needs less); no book was finished yet, so there was nothing to keep: the rerun starts from the first"
    )
    assert not (tmp_path / ".data.build").exists()
    monkeypatch.undo()
    prepare(f"files:{library}", tmp_path / "data", num_proc=2)
    prepare(f"files:{library}", tmp_path / "again")
    assert _snapshot_bytes(tmp_path / "data") == _snapshot_bytes(tmp_path / "again")


def test_second_run_is_a_no_op_and_changed_input_rebuilds(tmp_path, caplog):
    books = _write_books(tmp_path / "books")
    out = tmp_path / "data"
    source = f"files:{books}"
    prepare(source, out, val_fraction=0.25)
    before = _snapshot(out)
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, out, val_fraction=0.25, num_proc=2)
    assert "is up to date (same inputs" in caplog.text
    assert _snapshot(out) == before

    os.utime(books / "book2.txt", ns=(1, 1))  # touched, not changed: read again, shards kept as they are
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, out, val_fraction=0.25)
        prepare(source, out, val_fraction=0.25)
    assert "inputs read again, same content" in caplog.text and "is up to date (same inputs" in caplog.text
    assert {k: v for k, v in _snapshot(out).items() if k != "manifest.json"} == {
        k: v for k, v in before.items() if k != "manifest.json"
    }

    (books / "book1.txt").write_text("A different book.\n", encoding="utf-8")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, out, val_fraction=0.25)
    assert "up to date" not in caplog.text
    _check_exact(out, source)
    assert load_manifest(out).fingerprint != json.loads(before["manifest.json"][1])["fingerprint"]

    rebuilt = _snapshot(out)
    prepare(source, out, val_fraction=0.25, shard_tokens=100)  # a changed parameter rebuilds too
    assert len(load_manifest(out).shards) > len(rebuilt)
    _check_exact(out, source)


def test_a_rebuild_over_an_earlier_dataset_says_which_books_changed_and_how_its_runs_go_on(tmp_path, caplog):
    """The library grew and was prepared into the same --out: the old dataset went without a word, and the runs that
    trained on it stop at their next resume (other data)."""
    books, out = _write_books(tmp_path / "books"), tmp_path / "data"
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{books}", out, val_fraction=0.25)
    assert "Replaced" not in caplog.text  # nothing there before
    (books / "book9.txt").write_text("Book 9, added.\n" + "Line of the added book.\n" * 50, encoding="utf-8")
    (books / "book1.txt").write_text("Book 1, revised.\n" * 20, encoding="utf-8")
    (books / "book3.txt").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{books}", out, val_fraction=0.25)
    assert (
        f"Replaced the earlier dataset in {out} (books: 1 added, 1 removed, 1 changed): a run that trained on it stops "
        "at its resume; resume it with --on-new-data continue to train on from this data's start (its weights, "
        "optimizer and step kept)\n" in caplog.text
    ), caplog.text
    assert caplog.text.index("Replaced the earlier") < caplog.text.index(f"Wrote {out}: ")  # once it is done


def test_the_estimate_of_a_rebuild_says_the_unchanged_books_are_not_tokenized_again(tmp_path, caplog):
    """The estimate printed before a rebuild was the time to tokenize every book (PG-19: ~45 min), where a rebuild
    tokenizes only the added and changed ones; and it came before a re-run that had nothing to do."""
    books, out = _write_books(tmp_path / "books"), tmp_path / "data"

    def estimates() -> list[str]:
        return [line for line in caplog.messages if line.startswith(f"files:{books}: ")]

    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{books}", out, val_fraction=0.25)
        [fresh] = estimates()
        assert fresh.startswith(f"files:{books}: 4 books, ") and fresh.endswith(" (--num-proc N divides it)")
        caplog.clear()
        prepare(f"files:{books}", out, val_fraction=0.25)
        assert not estimates() and "is up to date" in caplog.text
        (books / "book9.txt").write_text("Book 9, added.\n" + "Line of the added book.\n" * 50, encoding="utf-8")
        caplog.clear()
        prepare(f"files:{books}", out, val_fraction=0.25)
    [rebuild] = estimates()
    assert rebuild.startswith(f"files:{books}: 5 books, ") and rebuild.endswith(
        "(--num-proc N divides it): the tokens of up to 4 unchanged books are reused from the dataset this replaces"
    )
    pg19 = prepare_module.size_estimate("pg19", 28_752, 11_500_000_000, 1, reusable=28_751)
    assert ", at most ~44 min with 1 process(es) " in pg19 and "of up to 28,751 unchanged books are reused" in pg19
    assert ", ~44 min with 1 process(es) " in prepare_module.size_estimate("pg19", 28_752, 11_500_000_000, 1)


def _tokenized_texts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts the tokenizer is given from now on (by this process: num_proc 1)."""
    enc, seen = get_encoding(), []
    real = enc.encode_to_numpy
    monkeypatch.setattr(enc, "encode_to_numpy", lambda text, **kw: seen.append(text) or real(text, **kw))
    return seen


def test_a_rebuild_tokenizes_only_the_added_and_changed_books_to_a_fresh_preparations_bytes(tmp_path, monkeypatch):
    """A grown library prepared into the same --out again: the unchanged books' tokens come from the earlier dataset
    (books spanning shards too), only the added and changed books are tokenized, a rebuild stopped part-way resumes,
    and every file is a fresh preparation's byte for byte."""
    books, out, fresh = _write_books(tmp_path / "books", 12), tmp_path / "data", tmp_path / "fresh"
    source, args = f"files:{books}", {"val_fraction": 0.25, "shard_tokens": 500}
    prepare(source, out, **args)
    (books / "book20.txt").write_text("Book 20, added.\n" + "Line of the added book.\n" * 50, encoding="utf-8")
    (books / "book3.txt").write_text("Book 3, revised.\n" * 30, encoding="utf-8")
    os.utime(books / "book5.txt", ns=(1, 1))  # touched, not changed: reused
    seen = _tokenized_texts(monkeypatch)
    _stopped_at_book(7, monkeypatch, source, out, **args)
    prepare(source, out, **args)
    assert sorted(text.partition(",")[0] for text in seen) == ["Book 20", "Book 3"]
    _check_exact(out, source)
    prepare(source, fresh, **args)
    assert _shards_and_documents(out) == _shards_and_documents(fresh)
    assert (out / "manifest.json").read_bytes() == (fresh / "manifest.json").read_bytes()


def test_a_rebuild_tokenizes_the_books_of_a_damaged_shard_again(tmp_path, monkeypatch):
    books, out, fresh = _write_books(tmp_path / "books", 12), tmp_path / "data", tmp_path / "fresh"
    source, args = f"files:{books}", {"val_fraction": 0.25, "shard_tokens": 500}
    prepare(source, out, **args)
    shard = out / "train_002.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    (books / "book20.txt").write_text("Book 20, added.\n" + "Line of the added book.\n" * 50, encoding="utf-8")
    seen = _tokenized_texts(monkeypatch)
    prepare(source, out, **args)
    assert 1 < len(seen) < 13  # the added book and those in that shard, not the others
    prepare(source, fresh, **args)
    assert _shards_and_documents(out) == _shards_and_documents(fresh)


def test_altered_shard_is_rebuilt_not_reported_up_to_date(tmp_path):
    out = tmp_path / "data"
    source = f"files:{_write_books(tmp_path / 'books')}"
    prepare(source, out, val_fraction=0.25)
    shard = out / "train_000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    prepare(source, out, val_fraction=0.25)
    load_manifest(out, verify="sha256")


def test_failed_reprepare_leaves_previous_dataset_intact(tmp_path):
    books = _write_books(tmp_path / "books")
    out = tmp_path / "data"
    prepare(f"files:{books}", out, val_fraction=0.25)
    before = _snapshot(out)
    (books / "bad.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(DataPrepError, match="bad.txt is not valid UTF-8"):
        prepare(f"files:{books}", out, val_fraction=0.25)
    with pytest.raises(DataPrepError, match="no such file or directory"):
        prepare(f"files:{tmp_path}/gone", out)
    with pytest.raises(DataPrepError, match="unknown source kind 'file'"):
        prepare(f"file:{books}", out)
    with pytest.raises(DataPrepError, match=r"^--val-fraction 1 is not between 0 and 1: it is the share of the books"):
        prepare(f"files:{books}", out, val_fraction=1.0)
    with pytest.raises(DataPrepError, match=r"^--num-proc must be >= 1, got 0$"):
        prepare(f"files:{books}", out, num_proc=0)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "books", "data"]


def test_empty_source_creates_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataPrepError, match=r"files:.*empty matched no .txt files"):
        prepare(f"files:{tmp_path / 'empty'}", tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_refuses_to_replace_a_folder_it_did_not_create(tmp_path):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("precious", encoding="utf-8")
    with pytest.raises(DataPrepError, match="exists and is not a prepared dataset"):
        prepare(f"files:{_write_books(tmp_path / 'books')}", mine)
    assert [p.name for p in mine.iterdir()] == ["chapter1.tex"]
    # a manifest.json of another kind: a training checkpoint's (its files' sizes and hashes) was replaced whole
    (mine / "manifest.json").write_text('{"files": {"model.safetensors": {"bytes": 1, "sha256": "00"}}}')
    with pytest.raises(DataPrepError, match=r"exists and is not a prepared dataset \(no manifest.json of one\)"):
        prepare(f"files:{tmp_path / 'books'}", mine)
    assert sorted(p.name for p in mine.iterdir()) == ["chapter1.tex", "manifest.json"]


def test_an_out_that_is_a_symlink_prepares_where_it_points(tmp_path):
    """data/ linked to a scratch disk, as clusters keep data: the link was replaced by a real folder on the home disk
    (the scratch folder left empty), and every later run, the up-to-date one too, ended in rmtree's traceback."""
    (tmp_path / "scratch" / "books").mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "scratch" / "books")
    books = f"files:{_write_books(tmp_path / 'library')}"
    for _ in range(2):  # the second: up to date
        assert prepare(books, link) == tmp_path / "scratch" / "books" / "manifest.json"
    assert link.is_symlink() and load_manifest(link).num_tokens("train") > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "library", "scratch"]  # no .data.old link left


def test_an_output_folder_that_cannot_be_written_stops_before_any_work(tmp_path, tmpfs):
    disk = tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    out = disk / "prepared" / "data"
    with pytest.raises(DataPrepError) as err:
        prepare(f"files:{_write_books(tmp_path / 'books')}", out)
    assert str(err.value) == f"cannot write {out}: {disk} is not writable by this user; choose another --out"


@pytest.mark.parametrize("module", ["data_prep.prepare", "data_prep.bench"])
def test_preparing_data_does_not_import_torch(module):
    """Data preparation needs no torch: importing it took 1.6 s of prepare's start-up (a CPU box preparing data for a
    GPU cluster may not even want it), through the manifest reader in data_prep.loader and modeling's package; and
    ~200 MB of the peak memory the data benchmark measures for prepare."""
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


@pytest.mark.slow
def test_each_line_of_a_library_that_logs_shows_once(tmp_path):
    """main() configured the root logger, and datasets and huggingface_hub have handlers of their own: each of their
    lines (the Hub's retries, datasets' notes on a local dataset, here at DATASETS_VERBOSITY=info) printed twice."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shelf = tmp_path / "shelf"
    shelf.mkdir()
    pq.write_table(
        pa.table({"text": ["First book. " * 20, "Second book. " * 20, "Third book. " * 20]}), shelf / "a.parquet"
    )
    env = {**os.environ, "DATASETS_VERBOSITY": "info", "HF_DATASETS_CACHE": str(tmp_path / "hf_cache")}
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "data_prep.prepare", "--source", f"hf:{shelf}", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line]
    assert "Generating train split" in lines  # a line of datasets' own
    assert f"Listing source 'hf:{shelf}'" in lines and any(line.startswith(f"Wrote {out}:") for line in lines)
    assert [line for line in lines if lines.count(line) > 1] == []


@pytest.mark.slow
def test_killed_reprepare_leaves_previous_dataset_intact(tmp_path):
    out = tmp_path / "data"
    prepare("default:sonnets,macbeth", out)
    before = _snapshot(out)
    # A bigger rebuild, killed (no cleanup possible) as soon as its build dir exists.
    child = subprocess.Popen(
        [sys.executable, "-m", "data_prep.prepare", "--source", "default", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".data.build")) and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, "prepare finished before it could be interrupted"
    assert (tmp_path / ".data.build").is_dir(), "no build dir to leave behind"
    assert _snapshot(out) == before
    load_manifest(out, verify="sha256")
    prepare("default:sonnets,macbeth", out)  # up to date, and clears the killed run's leftovers
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "data"]


@pytest.mark.parametrize("cut", ["open shard", "documents.jsonl"])
def test_a_killed_build_whose_files_came_up_short_is_started_afresh(tmp_path, monkeypatch, caplog, cut):
    """A crash before the OS wrote a build's last writes out leaves a file shorter than the progress record counts:
    resuming would pad it with zero bytes (token 0) that its sha256 then vouches for. The build starts afresh instead,
    says so, and ends as a run never stopped."""
    source = f"files:{_write_books(tmp_path / 'books', n=6)}"
    args = {"shard_tokens": 1000, "val_fraction": 0.25}
    prepare(source, tmp_path / "fresh", **args)
    out, build = tmp_path / "data", tmp_path / ".data.build"
    _stopped_at_book(4, monkeypatch, source, out, **args)
    state = json.loads((build / "progress.json").read_text())
    if cut == "open shard":
        [(split, writer)] = [(s, w) for s, w in state["writers"].items() if w["count"]]
        name, size = f"{split}_{len(writer['shards']):03d}.bin", 2 * writer["count"]
    else:
        name, size = "documents.jsonl", state["index_bytes"]
    assert size > 0 and (build / name).stat().st_size >= size
    os.truncate(build / name, size // 2)

    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, out, **args)
    assert _snapshot_bytes(out) == _snapshot_bytes(tmp_path / "fresh")
    assert f"Starting {build} afresh: its {name} holds {size // 2} bytes of {size}, fewer than" in caplog.text
    assert "Resuming" not in caplog.text


def _snapshot_bytes(folder: Path) -> dict[str, bytes]:
    return {name: data for name, (_, data) in _snapshot(folder).items()}


class _Killed(BaseException):
    """A kill at a chosen instant: nothing in prepare() handles it, so what is on disk stays as a kill leaves it."""


def _killed_inside_the_swap(monkeypatch: pytest.MonkeyPatch, source: str, out: Path) -> None:
    """prepare(source, out) killed after moving the previous dataset aside, before renaming its build into place."""
    rename = os.rename

    def killed_after_moving_out_aside(src: str | Path, dst: str | Path) -> None:
        rename(src, dst)
        if Path(src) == out:
            raise _Killed

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", killed_after_moving_out_aside)
        with pytest.raises(_Killed):
            prepare(source, out, val_fraction=0.25)
    assert not out.exists()


def test_a_run_killed_inside_the_swap_is_completed_by_the_next(tmp_path, monkeypatch, caplog):
    """The next run puts the killed run's completed build in place (its inputs then up to date) and leaves no copy
    of the previous dataset behind; without that build, it puts the previous dataset back."""
    books = _write_books(tmp_path / "books")
    source, out = f"files:{books}", tmp_path / "data"
    prepare(source, out, val_fraction=0.25)
    (books / "book1.txt").write_text("A different book.\n", encoding="utf-8")
    prepare(source, tmp_path / "fresh", val_fraction=0.25)  # what the killed run was writing
    _killed_inside_the_swap(monkeypatch, source, out)
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(source, out, val_fraction=0.25)
    assert "is up to date (same inputs and parameters)" in caplog.text
    assert _snapshot_bytes(out) == _snapshot_bytes(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", ".fresh.lock", "books", "data", "fresh"]

    (books / "book2.txt").write_text("Another different book.\n", encoding="utf-8")
    _killed_inside_the_swap(monkeypatch, source, out)
    shutil.rmtree(tmp_path / ".data.build")
    (books / "bad.txt").write_bytes(b"caf\xe9\n")  # the next run fails after settling the swap
    with pytest.raises(DataPrepError, match="bad.txt is not valid UTF-8"):
        prepare(source, out, val_fraction=0.25)
    assert _snapshot_bytes(out) == _snapshot_bytes(tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", ".fresh.lock", "books", "data", "fresh"]


def test_cli_combines_repeated_sources_and_reports_errors(tmp_path, capsys):
    a = _write_books(tmp_path / "a", 2)
    b = _write_books(tmp_path / "b", 1)
    out = tmp_path / "data"
    assert main(["--source", f"files:{a}", "--source", f"files:{b}/*.txt", "--out", str(out)]) == 0
    manifest = load_manifest(out)
    assert manifest.source == f"files:{a}+files:{b}/*.txt"
    assert [d["id"] for d in manifest.documents()] == ["files/a/book0.txt", "files/a/book1.txt", "files/b/book0.txt"]
    assert main(["--source", "nope:1", "--out", str(tmp_path / "other")]) == 1
    assert "error: unknown source kind 'nope'" in capsys.readouterr().err
    assert os.path.exists(out / "manifest.json") and not (tmp_path / "other").exists()


def test_exclusive_holds_other_processes_off_and_frees_on_exit(tmp_path):
    """The dataset lock (filelock: flock on POSIX, LockFileEx on Windows) is seen by another process."""
    out = tmp_path / "books"
    probe = (
        "import sys; from filelock import FileLock, Timeout\n"
        "try:\n    FileLock(sys.argv[1], timeout=0).acquire(); print('free')\nexcept Timeout:\n    print('held')"
    )
    lock_file = str(tmp_path / ".books.lock")

    def other_process_sees() -> str:
        return subprocess.run([sys.executable, "-c", probe, lock_file], capture_output=True, text=True).stdout.strip()

    with _exclusive(out):
        assert other_process_sees() == "held"
    assert other_process_sees() == "free"


def test_a_rebuild_that_moves_trained_books_into_val_warns_the_runs_continued_on_it(tmp_path, caplog):
    """The split is a hash of each book's id, and the id changes with its folder's name (files:) or its row (hf:,
    where a file sorting first renumbers the rest): the same books prepared again into the same --out from a renamed
    folder put books of the earlier train split in val, saying nothing, and a run continued on it (--on-new-data
    continue, as the README suggests for annealing) was validated on books it had trained on."""
    books, out = _write_books(tmp_path / "books", n=8), tmp_path / "data"
    prepare(f"files:{books}", out, val_fraction=0.25)
    before = {d["book_sha256"]: d["split"] for d in load_manifest(out).documents()}
    books.rename(tmp_path / "library")
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        prepare(f"files:{tmp_path / 'library'}", out, val_fraction=0.25)
    after = {d["book_sha256"]: d["split"] for d in load_manifest(out).documents()}
    moved = sum(before[text] == "train" and split == "val" for text, split in after.items())
    assert moved == 1  # of the 8 books, one of train's is val's now
    assert (
        "warning: 1 book(s) of the train split of the dataset this replaced are in val now (a book's split is drawn "
        "from its id, which a renamed folder or renumbered rows change, --seed and --val-fraction): a run that trained "
        "on it and goes on with --on-new-data continue would be validated on books it trained on; start such runs "
        "afresh, or keep what draws the split" in caplog.messages
    ), caplog.messages


def test_a_preparation_waiting_for_another_into_the_same_out_says_so(tmp_path, caplog):
    """A second prepare into the --out another is writing (a forgotten nohup job, a second terminal) waited for its
    lock after "Listing source ...", saying nothing for as long as the other ran (~45 min for PG-19): it looked hung.
    It now says what it waits for, then goes on once the other is done."""
    library = _write_books(tmp_path / "library", n=2)
    holder = (
        "import sys, time; from filelock import FileLock\n"
        "lock = FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(1); lock.release()"
    )
    other = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path / ".data.lock")], stdout=subprocess.PIPE)
    try:
        assert other.stdout.readline() == b"held\n"
        with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
            prepare(f"files:{library}", tmp_path / "data")
    finally:
        other.wait(timeout=60)
    assert (
        f"waiting for the other preparation into {tmp_path / 'data'} to finish (it holds {tmp_path / '.data.lock'}; "
        "Ctrl-C stops waiting)" in caplog.messages
    )
    assert (tmp_path / "data" / "manifest.json").is_file()


def test_a_full_disk_stops_with_one_line_and_the_rerun_continues_to_the_same_bytes(
    prepared_books, tmpfs, monkeypatch, capsys, caplog
):
    """The disk fills up mid-way (room for about half the shards): a warning said so at the start (it was found only
    where the disk filled), one line says so and what was kept; after space is freed the same command continues
    after the books done and writes exactly what an uninterrupted run wrote."""
    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 1)  # a progress record after every book
    disk = tmpfs("2m")
    shards = sum(p.stat().st_size for p in prepared_books.glob("*.bin"))
    filler = fill_disk(disk, leave=shards // 2)
    out = disk / "books"
    command = ["--source", "default:hamlet,macbeth,tempest,twelfth_night", "--out", str(out),
               "--shard-tokens", "40000", "--val-fraction", "0.1"]  # fmt: skip  # the prepared_books fixture's
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        assert main(command) == 1
    estimate = re.search(r"~([\d.]+ kB) of shards", caplog.text)[1]
    warning = (
        rf"warning: the shards need ~{estimate} and {disk} has [\d.]+ kB free: free space or choose an --out on "
        r"another disk, or the preparation stops where the disk fills \(the same command then continues after the "
        r"books done\)"
    )
    assert any(re.fullmatch(warning, message) for message in caplog.messages), caplog.messages
    caplog.clear()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"error: disk full while writing {out}: free space on {disk} and run the same command again; the ([123]) "
        rf"books prepared so far are kept in {disk}/\.books\.build and the rerun continues after them",
        line,
    ), line
    done = re.search(r"the (\d) books", line)[1]
    assert not out.exists()

    filler.unlink()
    with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
        assert main(command) == 0
    assert f"Resuming the killed preparation in {disk}/.books.build after {done} books" in caplog.text
    assert "warning: the shards need" not in caplog.text  # with room for the rest
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in prepared_books.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in prepared_books.iterdir())


def test_in_a_log_the_books_done_are_lines_of_their_own(tmp_path, monkeypatch, capsys, caplog):
    """A batch job's log (stderr no terminal): tqdm redrew its bar there by carriage returns, the whole preparation
    one line of the log; its figures are log lines of their own instead, at most every LOG_EVERY_S and at the end."""
    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 1)
    for every_s, shown in ((0.0, ["1/3", "2/3", "3/3"]), (60.0, ["3/3"])):
        monkeypatch.setattr(prepare_module, "LOG_EVERY_S", every_s)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="data_prep.prepare"):
            assert main(["--source", "default:sonnets,hamlet,macbeth", "--out", str(tmp_path / str(every_s))]) == 0
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Preparing")]
        assert [
            re.match(r"Preparing: (\d/3) books \(\d+%\) \[\d\d:\d\d<\d\d:\d\d, ", line)[1] for line in lines
        ] == shown
        assert "\r" not in capsys.readouterr().err
