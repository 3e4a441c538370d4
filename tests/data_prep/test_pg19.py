"""The pg19 source on a local copy of emozilla/pg19 built here: its exact schema and file layout, read through the
same `datasets` calls as the Hub's, its own splits kept, resumed after a kill as if never stopped."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep import DataPrepError
from data_prep import prepare as prepare_module
from data_prep.manifest import load_manifest
from data_prep.prepare import prepare
from data_prep.sources import clean_text
from data_prep.tokenizer import EOT_ID, get_encoding
from testkit import PG19_FILES, pg19_book, write_pg19_copy

SPLITS = ("train", "validation", "test")  # PG-19's


@pytest.fixture
def pg19_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import datasets

    # datasets read HF_DATASETS_CACHE at import; point it here so runs leave nothing in ~/.cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return write_pg19_copy(tmp_path / "pg19")


def split_tokens(data_dir: Path, split: str) -> np.ndarray:
    manifest = load_manifest(data_dir, verify="sha256")
    return np.concatenate([np.fromfile(data_dir / s.file, dtype=np.uint16) for s in manifest.shards_of(split)])


def test_pg19_keeps_its_splits_and_tokenizes_every_book_exactly(pg19_copy, tmp_path, caplog, monkeypatch):
    out = tmp_path / "data"
    monkeypatch.setattr(prepare_module, "VAL_ENOUGH", 1)  # its val books are PG-19's own: no --val-fraction to lower
    with caplog.at_level(logging.INFO):
        prepare(f"pg19:{pg19_copy}", out, shard_tokens=2_000)
    assert f"pg19:{pg19_copy}: 8 books, " in caplog.text and " of shards, <1 min with 1 process(es)" in caplog.text
    assert "--val-fraction" not in caplog.text
    manifest = load_manifest(out, verify="sha256")
    numbers = {split: [n for name, ns in PG19_FILES.items() if name.startswith(split) for n in ns] for split in SPLITS}
    expected = {
        "train": [(f"pg19/train/{n}", n) for n in numbers["train"]],
        "val": [(f"pg19/validation/{n}", n) for n in numbers["validation"]]
        + [(f"pg19/test/{n}", n) for n in numbers["test"]],
    }
    docs = list(manifest.documents())
    enc = get_encoding()
    for split, books in expected.items():
        listed = [d for d in docs if d["split"] == split]
        assert [(d["id"], d["title"]) for d in listed] == [(i, f"Title of {n}") for i, n in books]
        want = [t for _, n in books for t in [*enc.encode_ordinary(clean_text(pg19_book(n))), EOT_ID]]
        assert split_tokens(out, split).tolist() == want
        assert manifest.splits[split] == {
            "num_tokens": len(want), "num_documents": len(books), "num_shards": -(-len(want) // 2_000)
        }  # fmt: skip
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["sources"] == [{"source": f"pg19:{pg19_copy}", "license": "apache-2.0", "dataset": "emozilla/pg19"}]


def test_killed_pg19_preparation_resumes_inside_a_parquet_file(pg19_copy, tmp_path, monkeypatch, caplog):
    """Killed after 2 batches of 2 books: the resumed run skips the first file and one book of the second, and
    ends byte-identical to a run never stopped."""
    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 2)
    real, calls = prepare_module.tokenize_records, []

    def killed_at_the_third_batch(records):
        calls.append([r.id for r in records])
        if len(calls) == 3:
            raise KeyboardInterrupt  # as Ctrl-C: BaseException, nothing cleans the build folder up
        return real(records)

    monkeypatch.setattr(prepare_module, "tokenize_records", killed_at_the_third_batch)
    source, out = f"pg19:{pg19_copy}", tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        prepare(source, out, shard_tokens=2_000)
    assert (tmp_path / ".data.build" / "progress.json").is_file() and not out.exists()
    monkeypatch.setattr(prepare_module, "tokenize_records", real)
    resumed = []
    monkeypatch.setattr(prepare_module, "tokenize_records", lambda rs: resumed.append(rs[0].id) or real(rs))
    with caplog.at_level(logging.INFO):
        prepare(source, out, shard_tokens=2_000)
    assert "after 4 books" in caplog.text
    assert resumed[0] == "pg19/train/2701"  # the second book of the second train file: nothing read twice
    fresh = tmp_path / "fresh"
    prepare(source, fresh, shard_tokens=2_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in fresh.iterdir()}


def test_a_source_failing_while_read_keeps_the_books_done_for_the_same_command(
    pg19_copy, tmp_path, monkeypatch, caplog
):
    """A stream that fails part-way (here the second train file goes away after listing, as a Hub file the network
    drops would) stops with one line that says so and keeps the books done; the same command then continues after
    them to the bytes of a run never stopped."""
    monkeypatch.setattr(prepare_module, "BATCH_DOCS", 2)
    second = pg19_copy / "data" / "train-00001-of-00002-54b567998cd5eb4b.parquet"
    away = tmp_path / "away.parquet"
    real = prepare_module.tokenize_records

    def file_gone_after_the_first_batch(records):
        if second.exists():
            second.rename(away)  # a rename keeps its mtime: the same inputs once it is back
        return real(records)

    monkeypatch.setattr(prepare_module, "tokenize_records", file_gone_after_the_first_batch)
    source, out, build = f"pg19:{pg19_copy}", tmp_path / "data", tmp_path / ".data.build"
    with pytest.raises(DataPrepError) as failed:
        prepare(source, out, shard_tokens=2_000)
    assert re.fullmatch(
        rf"could not read {source} \(FileNotFoundError: .*{second.name}'\); check the network \(or the files\), "
        rf"then run the same command again; the 2 books prepared so far are kept in {build} and the rerun continues "
        r"after them",
        str(failed.value),
    ), str(failed.value)
    assert not out.exists()

    away.rename(second)
    monkeypatch.setattr(prepare_module, "tokenize_records", real)
    with caplog.at_level(logging.INFO):
        prepare(source, out, shard_tokens=2_000)
    assert f"Resuming the killed preparation in {build} after 2 books" in caplog.text
    fresh = tmp_path / "fresh"
    prepare(source, fresh, shard_tokens=2_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in fresh.iterdir()}


def test_pg19_errors_say_what_to_do(pg19_copy, tmp_path, monkeypatch):
    import datasets

    with pytest.raises(DataPrepError, match=r"pg19:.*nope: no such folder; give the folder of a local copy of emozi"):
        prepare(f"pg19:{tmp_path}/nope", tmp_path / "a")
    (pg19_copy / "data" / "test-00000-of-00001-29a571947c0b5ccc.parquet").unlink()
    with pytest.raises(DataPrepError, match=r"has no test split \(found: \['train', 'validation'\]\)"):
        prepare(f"pg19:{pg19_copy}", tmp_path / "b")
    pq.write_table(pa.table({"title": ["x"], "text": ["y"]}), pg19_copy / "data" / "test-00000-of-00001-0.parquet")
    with pytest.raises(DataPrepError, match=r"has no column\(s\) \['short_book_title', 'publication_date', 'url'\]"):
        prepare(f"pg19:{pg19_copy}", tmp_path / "c")
    # The Hub's copy goes through the same calls; with the Hub out of reach, one line says what to do.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataPrepError, match=r"could not list pg19 \(the Hub dataset emozilla/pg19\) .*pg19:FOLDER"):
        prepare("pg19", tmp_path / "d")
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_a_pg19_folder_that_is_no_copy_of_it_says_so_not_to_check_the_network(pg19_copy, tmp_path):
    """pg19:FOLDER at a folder of .txt books, at a prepared dataset (data/pg19 for ~/pg19) or with a file damaged: one
    line saying what the folder holds or which file to download again (each said to check the network, which a
    local copy does not use, after datasets' own error on the folder's other files)."""
    library = tmp_path / "library"
    library.mkdir()
    (library / "emma.txt").write_text("Emma Woodhouse, handsome, clever, and rich.\n")
    prepared = tmp_path / "prepared"
    prepare(f"pg19:{pg19_copy}", prepared)
    copy_of = (
        "give the folder of a local copy of emozilla/pg19 (its data/*.parquet files, e.g. from `hf download "
        "emozilla/pg19 --repo-type dataset --local-dir FOLDER`), or drop the folder to stream it"
    )
    with pytest.raises(DataPrepError) as err:
        prepare(f"pg19:{library}", tmp_path / "out")
    assert str(err.value) == (
        f"pg19:{library} holds no parquet files (it holds 1 .txt: books are read from PG-19's parquet files only); "
        f"{copy_of}"
    )
    with pytest.raises(DataPrepError) as err:
        prepare(f"pg19:{prepared}", tmp_path / "out")
    assert str(err.value) == (
        f"pg19:{prepared} is a prepared dataset, not a copy of emozilla/pg19's parquet files: train on it with "
        f"--data-dir {prepared}; to prepare PG-19 again, {copy_of}"
    )
    damaged = pg19_copy / "data" / "test-00000-of-00001-29a571947c0b5ccc.parquet"
    damaged.write_bytes(damaged.read_bytes()[:100])  # a download cut short
    with pytest.raises(DataPrepError) as err:
        prepare(f"pg19:{pg19_copy}", tmp_path / "out")
    assert str(err.value).startswith(f"could not read {damaged} of pg19:{pg19_copy} (")
    assert str(err.value).endswith("); download that file again from emozilla/pg19")
    assert not (tmp_path / "out").exists()


def test_a_local_copy_of_pg19_read_through_hf_is_sent_to_the_pg19_source(pg19_copy, tmp_path):
    """As hf:emozilla/pg19 is: hf:FOLDER read its train split alone (PG-19's validation and test books dropped, val
    drawn from its train books), after datasets cached an Arrow copy of it."""
    for spec in (f"hf:{pg19_copy}", f"default+hf:{pg19_copy}:validation"):
        with pytest.raises(DataPrepError) as err:
            prepare(spec, tmp_path / "out")
        assert str(err.value) == (
            f"source {spec.removeprefix('default+')!r} reads PG-19 as a generic dataset (its train split alone, all "
            "of it cached by datasets first, the titles lost): use --source pg19 (streams emozilla/pg19, keeps "
            f"PG-19's validation and test books for val, resumes where it stopped), or --source pg19:{pg19_copy} "
            "for this local copy"
        )
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf_cache").exists()
