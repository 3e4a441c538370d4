"""Book sources: the embedded default corpus, local files, Gutenberg (offline paths only), hf."""

import logging
import os
import re
import shutil
import sys
import zipfile

import pytest

from data_prep import DataPrepError, sources
from data_prep.prepare import main
from data_prep.sources import clean_text, iter_documents, parse_spec
from tests.testkit import run

PG_MODERN = (
    "\ufeffThe Project Gutenberg eBook of Tiny Book\r\n\r\nTitle: Tiny Book\r\nAuthor: Nobody\r\n\r\n"
    "*** START OF THE PROJECT GUTENBERG EBOOK TINY BOOK ***\r\n\r\n\r\nCHAPTER I.   \r\n\r\n"
    "It was a dark night.\r\n\r\n\r\n\r\n\r\n\r\nThe end.\r\n\r\n"
    "*** END OF THE PROJECT GUTENBERG EBOOK TINY BOOK ***\r\n\r\nUpdated editions will replace...\r\n"
)
PG_OLD = (
    "The Project Gutenberg Etext of Old Book\n**Welcome To The World of Free Plain Vanilla Etexts**\n"
    "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\nOLD BOOK\n\nOnce upon a time.\n\n"
    "End of the Project Gutenberg EBook of Old Book\n\n*** END OF THIS PROJECT GUTENBERG EBOOK OLD BOOK ***\n"
)


def test_default_corpus_is_the_modern_shakespeare_and_milton_books():
    docs = list(iter_documents("default"))
    ids = [d.id for d in docs]
    assert len(docs) == 48 and len(set(ids)) == 48
    assert sum(i.startswith("default/shakespeare/") for i in ids) == 42
    assert sum(i.startswith("default/milton/") for i in ids) == 6
    by_id = {d.id: d for d in docs}
    assert by_id["default/shakespeare/hamlet"].title == "Hamlet"
    assert by_id["default/milton/paradise_regained"].title == "Paradise Regained"
    # folio duplicates, metadata and the collection repeating Comus are left out
    assert not any(i.endswith("_f") or "metadata" in i or "lallegro" in i for i in ids)
    assert all(d.text.endswith("\n") and "\r" not in d.text and "\ufeff" not in d.text for d in docs)
    assert by_id["default/shakespeare/hamlet"].text.startswith("HAMLET, PRINCE OF DENMARK\n")
    assert "\n\n\n\n" not in by_id["default/milton/comus"].text
    # the same play from the folio must not be a second document of the corpus
    assert sum("Prince of Denmark" in d.title or d.title == "Hamlet" for d in docs) == 1


def test_default_subset_and_unknown_book():
    docs = list(iter_documents("default:sonnets, hamlet"))
    assert [d.id for d in docs] == ["default/shakespeare/sonnets", "default/shakespeare/hamlet"]
    with pytest.raises(DataPrepError, match=r"unknown default book\(s\) \['hamlett'\]; available: .*hamlet"):
        list(iter_documents("default:hamlett"))


def test_clean_text_strips_gutenberg_boilerplate_modern_and_old():
    assert clean_text(PG_MODERN) == "CHAPTER I.\n\nIt was a dark night.\n\n\nThe end.\n"
    assert clean_text(PG_OLD) == "OLD BOOK\n\nOnce upon a time.\n"
    assert clean_text("no markers\r\nat all\rhere") == "no markers\nat all\nhere\n"
    assert clean_text(" \r\n\n\t\n") == ""
    # several books in one file (a collection joined into one input.txt): every body, no header or license between
    # them (only the last book's body was kept)
    both = clean_text(PG_OLD + "\n" + PG_MODERN)
    assert both == "OLD BOOK\n\nOnce upon a time.\n\n\nCHAPTER I.\n\nIt was a dark night.\n\n\nThe end.\n"


def test_files_directory_tree_glob_and_single_file(tmp_path):
    books = tmp_path / "books"
    (books / "sub" / "deeper").mkdir(parents=True)
    (books / "b.txt").write_text(PG_MODERN, encoding="utf-8")
    (books / "a.txt").write_text("Alpha.\n", encoding="utf-8")
    (books / "notes.md").write_text("not a book", encoding="utf-8")
    (books / "sub" / "c.txt").write_text("Gamma.\n", encoding="utf-8")
    (books / "sub" / "deeper" / "d.txt").write_text("Delta.\n", encoding="utf-8")
    # hidden ones are left out of both the tree and a glob: a notebook's copy, a Mac's resource fork (binary)
    (books / ".ipynb_checkpoints").mkdir()
    (books / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("Alpha.\n", encoding="utf-8")
    (books / "sub" / "._c.txt").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        \xff\xfe")
    docs = list(iter_documents(f"files:{books}"))  # a folder is its whole tree, as PG-19 lays out its books
    assert [(d.id, d.title) for d in docs] == [
        ("files/books/a.txt", "a"),
        ("files/books/b.txt", "Tiny Book"),
        ("files/books/sub/c.txt", "c"),
        ("files/books/sub/deeper/d.txt", "d"),
    ]
    assert docs[1].text == clean_text(PG_MODERN)
    (books / "sub" / "deeper" / "d.txt").unlink()
    assert [d.id for d in iter_documents(f"files:{books}/**/*.txt")] == [
        "files/books/a.txt",
        "files/books/b.txt",
        "files/books/sub/c.txt",
    ]
    assert [d.id for d in iter_documents(f"files:{books}/sub/c.txt+files:{books}/a.txt")] == [
        "files/sub/c.txt",
        "files/books/a.txt",
    ]
    with pytest.raises(DataPrepError, match="document 'files/books/a.txt' appears twice"):
        list(iter_documents(f"files:{books}/a.txt+files:{books}"))
    # two folders of the same name, each listed once: the books of both, not "listed twice"
    other = tmp_path / "bob" / "books"
    other.mkdir(parents=True)
    (other / "a.txt").write_text("Another book altogether.")
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"files:{books}+files:{other}"))
    assert str(err.value) == (
        f"{books / 'a.txt'} and {other / 'a.txt'} get the same id 'files/books/a.txt' (a book's id starts with its "
        "folder's name, which keeps its split when the folder moves): rename one of the folders, or link it under "
        "another name"
    )


def test_a_folder_linked_into_a_library_is_read_as_a_glob_reads_it(tmp_path, caplog):
    """A library assembled from links (a shelf on another disk linked in) was read without the linked folders' books,
    saying nothing, while files:LIBRARY/**/*.txt read them."""
    shelf = tmp_path / "other_disk" / "shelf"
    shelf.mkdir(parents=True)
    (shelf / "b.txt").write_text("Beta.\n", encoding="utf-8")
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("Alpha.\n", encoding="utf-8")
    (books / "linked").symlink_to(shelf)
    (books / "loop").symlink_to(books)  # a link back up the tree: read once, not forever
    expected = ["files/books/a.txt", "files/books/linked/b.txt"]
    assert [d.id for d in iter_documents(f"files:{books}")] == expected
    assert f"skipping {books / 'loop'}: the folder {books}, read already" in caplog.text


def test_a_folders_files_that_are_not_txt_are_counted_not_passed_over(tmp_path, caplog):
    """A library holding other formats beside its .txt books (a Gutenberg mirror's .zip and .htm, an .epub) was
    prepared from its .txt files alone, saying nothing of the rest: one line now counts them by suffix."""
    books = tmp_path / "books"
    (books / "sub").mkdir(parents=True)
    (books / "a.txt").write_text("Alpha.\n", encoding="utf-8")
    for name in ("b.epub", "sub/c.epub", "sub/c.htm", "README"):
        (books / name).write_text("not read", encoding="utf-8")
    (books / ".DS_Store").write_text("hidden: left out as a glob leaves it", encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="data_prep.sources"):
        assert [d.id for d in iter_documents(f"files:{books}")] == ["files/books/a.txt"]
    assert (
        f"files:{books}: 4 file(s) not read, books are read from .txt files only (2 .epub, 1 .htm, 1 no suffix)"
        in caplog.messages
    )


def test_a_book_linked_to_a_missing_file_stops_the_listing_naming_it(tmp_path, caplog):
    """A library of links into a disk that is not mounted: each link to nothing was left out without a word, by the
    folder and by a glob alike, and the dataset was prepared without those books."""
    books = tmp_path / "books"
    books.mkdir()
    (books / "a.txt").write_text("Alpha.\n", encoding="utf-8")
    (books / "b.txt").symlink_to(tmp_path / "unmounted" / "b.txt")
    (books / "c.txt").symlink_to(tmp_path / "unmounted" / "c.txt")
    for spec in (f"files:{books}", f"files:{books}/*.txt"):
        with pytest.raises(DataPrepError) as err:
            list(iter_documents(spec))
        assert str(err.value) == (
            f"{books / 'b.txt'} links to {tmp_path / 'unmounted' / 'b.txt'}, which is not there (a disk not mounted, "
            "a file moved); and 1 more link(s) to nothing (each named above): point each at its book, or remove it"
        )
        assert f"{books / 'c.txt'} links to {tmp_path / 'unmounted' / 'c.txt'}, which is not there" in caplog.text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "no source given"),
        ("books/", "unknown source kind 'books/'"),
        ("default+pdf:x.pdf", "unknown source kind 'pdf'"),
        ("files:", "source 'files:' needs an argument"),
        ("gutenberg:12a", r"\['12a'\] are not Project Gutenberg book numbers"),
        # the column 'text:body' was found missing only after the dataset was downloaded
        ("hf:shelf/books:train:text:body", r"'hf:shelf/books:train:text:body' has more parts than hf:DATASET:SPLIT:"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(DataPrepError, match=message):
        list(iter_documents(spec))
    if not spec.startswith("gutenberg:"):  # the ids are checked as the books are listed
        with pytest.raises(DataPrepError, match=message):  # before anything is listed, downloaded or made
            parse_spec(spec)


def test_files_errors(tmp_path, caplog):
    with pytest.raises(DataPrepError, match=r"files:.*missing: no such file or directory; check the path"):
        list(iter_documents(f"files:{tmp_path}/missing"))
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"files:{tmp_path}"))
    assert str(err.value) == f"source files:{tmp_path} matched no .txt files; check the path or pattern"
    notes = tmp_path / "notes"
    for name in ("a.md", "b.md", "sub/c.epub", ".notes/d.md", ".DS_Store"):  # the hidden ones are not said
        (notes / name).parent.mkdir(parents=True, exist_ok=True)
        (notes / name).write_text("text")
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"files:{notes}"))
    assert str(err.value) == (
        f"source files:{notes} matched no .txt files (it holds 2 .md, 1 .epub: books are read from .txt files "
        "only); check the path or pattern"
    )
    shutil.rmtree(notes)
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    with pytest.raises(DataPrepError, match="produced no documents"):
        list(iter_documents(f"files:{tmp_path}"))
    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 society\n".encode("latin-1"))
    with pytest.raises(DataPrepError, match=r"latin1.txt is not valid UTF-8 \(bad byte at offset 3\); convert") as e:
        list(iter_documents(f"files:{tmp_path}"))
    # cp1252, not latin1: Windows text's quotes and dashes (0x91-0x97) are control codes in latin1
    assert "(e.g. `iconv -f cp1252 -t utf-8` for Windows or Latin-1 text)" in str(e.value)
    # every bad file named at once, before a build: fixing one changes the inputs, so a build it stopped could not
    # be resumed, and each rerun would stop at the next
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cover.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    (tmp_path / "zz.txt").write_bytes(b"\x93quoted\x94\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="data_prep.sources"), pytest.raises(DataPrepError) as e:
        sources.check_texts(sources.plan(f"files:{tmp_path}").paths)
    assert re.fullmatch(r".*/latin1.txt is not valid UTF-8 .* out of the source; and 2 more file\(s\) cannot be "
                        r"read as text \(each named above\)", str(e.value)), str(e.value)  # fmt: skip
    assert caplog.messages[0] == "Checking that the 4 file(s) read as text"  # said first: many GB take a while
    said = [m.split("/")[-1].split(" (")[0] for m in caplog.messages[1:]]
    assert said == ["cover.txt holds NUL bytes", "zz.txt is not valid UTF-8"]
    for bad in ("latin1.txt", "sub/cover.txt", "zz.txt"):
        (tmp_path / bad).unlink()
    # a file name that is not UTF-8 (copied from an old archive): UnicodeEncodeError's traceback at the index write
    bad_name = tmp_path / os.fsdecode(b"caf\xe9.txt")
    bad_name.write_text("A book.\n", encoding="utf-8")
    with pytest.raises(DataPrepError, match=r"^the name of b'.*/caf\\xe9.txt' is not UTF-8; rename it \(e.g. `convmv"):
        list(iter_documents(f"files:{tmp_path}"))
    bad_name.unlink()
    # Windows' "Unicode" text: UTF-16 with its byte-order mark, read as what it says it is
    (tmp_path / "notepad.txt").write_bytes("\u201cCaf\u00e9,\u201d she said.\r\n".encode("utf-16"))
    assert [d.text for d in iter_documents(f"files:{tmp_path}")] == ["\u201cCaf\u00e9,\u201d she said.\n"]


def test_gutenberg_reads_its_cache_and_reports_network_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    (tmp_path / "gutenberg").mkdir()
    (tmp_path / "gutenberg" / "pg77.txt").write_text(PG_MODERN, encoding="utf-8")
    [doc] = iter_documents("gutenberg:77")
    assert (doc.id, doc.title, doc.text) == ("gutenberg/77", "Tiny Book", clean_text(PG_MODERN))
    monkeypatch.setattr(sources, "RETRY_PAUSE", 0.01)
    with pytest.raises(DataPrepError, match=r"could not download Project Gutenberg book 145 from http://127.0.0.1:9/"):
        list(iter_documents("gutenberg:77,145", mirror="http://127.0.0.1:9"))
    assert sorted(p.name for p in (tmp_path / "gutenberg").iterdir()) == ["pg77.txt"]


def test_gutenberg_books_from_a_mirror_whose_name_does_not_resolve_fail_without_retries(tmp_path, monkeypatch):
    """No network (or a mistyped --mirror): each book was tried 4 times over 7 s of pauses, 8 at a time, so 1,000
    ids took ~15 minutes to say "check the network". A name that does not resolve is not retried."""
    monkeypatch.setenv("BOOKGPT_CACHE", str(tmp_path))
    ids = ",".join(str(i) for i in range(1, 17))
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"gutenberg:{ids}", mirror="http://mirror.invalid"))
    assert re.fullmatch(
        r"could not download Project Gutenberg book 1 from http://mirror.invalid/cache/epub/1/pg1.txt \(.+; 1 "
        r"attempt\(s\)\); check the network, pass --mirror with a reachable mirror, or save the .txt yourself and use "
        r"files:PATH",
        str(err.value),
    ), err.value


def test_hf_local_json_dataset(tmp_path, monkeypatch):
    import datasets

    # datasets read HF_DATASETS_CACHE at import; point it here so runs leave nothing in ~/.cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    data = tmp_path / "ds"
    data.mkdir()
    (data / "part.jsonl").write_text(
        '{"text": "First book.\\r\\nLine two.", "title": "One"}\n{"text": "Second.", "title": null}\n',
        encoding="utf-8",
    )
    resolved = []  # datasets' resolution of a dataset's files (for a Hub dataset, its API calls), counted
    factory = datasets.load.dataset_module_factory
    monkeypatch.setattr(datasets.load, "dataset_module_factory", lambda *a, **k: resolved.append(a) or factory(*a, **k))
    docs = list(iter_documents(f"hf:{data}"))
    assert len(resolved) == 1  # once, not again inside load_dataset
    assert [(d.id, d.title, d.text) for d in docs] == [
        ("hf/ds/train/0", "One", "First book.\nLine two.\n"),
        ("hf/ds/train/1", f"{data} #1", "Second.\n"),
    ]
    with pytest.raises(DataPrepError, match=r"no column 'body' \(columns: \['text', 'title'\]\)"):
        list(iter_documents(f"hf:{data}:train:body"))
    # a local path that is not there: said so, not sent to the Hub as an id ("the Hub cannot be reached" offline)
    for name in (f"{tmp_path}/nope", "shelf/books.parquet", "./shelf", "~/shelf"):
        with pytest.raises(DataPrepError) as err:
            list(iter_documents(f"hf:{name}:train:text"))
        assert (
            str(err.value) == f"hf:{name}: no such file or folder (nor a Hub dataset's id, OWNER/NAME); check the path"
        )
    # a local file datasets cannot read: its own error's cause named (its text says only that an error occurred),
    # and the file to check, not the network
    (data / "part.jsonl").write_text('{"text": "A book."}\n{"text": "cut sh\n', encoding="utf-8")
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"hf:{data / 'part.jsonl'}"))
    assert re.search(
        r"\(DatasetGenerationError: .*; \w+Error: .+\); check that file or folder: its format and its rows$",
        str(err.value),
    ), err.value


def test_a_local_hf_dataset_keeps_its_ids_and_split_however_its_folder_is_named_or_moved(tmp_path, monkeypatch):
    """A book's id decides its split: the same folder given as hf:shelf, hf:./shelf/ or by its full path, or moved,
    must give the same ids, or a rebuild moves books between train and val (a run continued on it would be
    validated on books it trained on)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (shelf / "part.jsonl").write_text('{"text": "First book."}\n{"text": "Second book."}\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    expected = ["hf/shelf/train/0", "hf/shelf/train/1"]
    for spec in (f"hf:{shelf}", "hf:shelf", "hf:./shelf/"):
        assert [d.id for d in iter_documents(spec)] == expected, spec
    (tmp_path / "moved").mkdir()
    shutil.move(shelf, tmp_path / "moved" / "shelf")
    assert [d.id for d in iter_documents(f"hf:{tmp_path}/moved/shelf")] == expected
    # two datasets in folders of one name: one line naming both, as for two files: folders of one name
    other = tmp_path / "bob" / "shelf"
    other.mkdir(parents=True)
    (other / "part.jsonl").write_text('{"text": "Another book."}\n', encoding="utf-8")
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"hf:moved/shelf+hf:{other}"))
    assert str(err.value).startswith(f"moved/shelf and {other} get the same id 'hf/shelf/train/0' ")


def test_a_dataset_folder_of_two_formats_says_which_files_it_does_not_read(tmp_path, monkeypatch, caplog):
    """datasets reads one format of a folder (its most common): a folder of parquet files with a .jsonl of more books
    beside them was prepared from the parquet alone, saying nothing of the .jsonl's books."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    pq.write_table(pa.table({"text": ["First book.", "Second book."]}), shelf / "a.parquet")
    (shelf / "b.jsonl").write_text('{"text": "A third book."}\n', encoding="utf-8")
    (shelf / "README.md").write_text("A shelf of books.", encoding="utf-8")  # no data file: not said
    with caplog.at_level(logging.WARNING, logger="data_prep.sources"):
        assert [d.text for d in iter_documents(f"hf:{shelf}")] == ["First book.\n", "Second book.\n"]
    assert (
        f"hf:{shelf}: 1 data file(s) of the folder not read ({shelf / 'b.jsonl'}): datasets reads one format of a "
        "folder (here .parquet) and, where some files are named by a split (train, test, validation), only those; add "
        f"each as a source of its own, e.g. --source 'hf:{shelf}+hf:{shelf / 'b.jsonl'}'"
    ) in caplog.messages
    caplog.clear()  # that source reads all three books, and says nothing more
    with caplog.at_level(logging.WARNING, logger="data_prep.sources"):
        assert len(list(iter_documents(f"hf:{shelf}+hf:{shelf / 'b.jsonl'}"))) == 3
    assert not any("not read" in m for m in caplog.messages), caplog.messages


def test_a_dataset_folders_other_splits_are_said_not_read(tmp_path, monkeypatch, caplog):
    """A folder laid out as the Hub lays out a dataset (train.parquet, validation.parquet): hf:FOLDER reads its train
    split alone, and its validation books were left out without a word."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    pq.write_table(pa.table({"text": ["First book.", "Second book."]}), shelf / "train.parquet")
    pq.write_table(pa.table({"text": ["A held-out book."]}), shelf / "validation.parquet")
    with caplog.at_level(logging.WARNING, logger="data_prep.sources"):
        assert len(list(iter_documents(f"hf:{shelf}"))) == 2
    assert (
        f"hf:{shelf}: its validation split (1 file(s)) is not read, as hf:DATASET reads one split (train unless "
        f"named); add it as a source of its own, e.g. --source 'hf:{shelf}+hf:{shelf}:validation'"
    ) in caplog.messages
    caplog.clear()  # that source reads all three books, and says nothing more
    with caplog.at_level(logging.WARNING, logger="data_prep.sources"):
        assert len(list(iter_documents(f"hf:{shelf}+hf:{shelf}:validation"))) == 3
    assert not any("not read" in m for m in caplog.messages), caplog.messages


def test_a_dataset_without_the_split_asked_for_names_its_splits(tmp_path, monkeypatch):
    """A Gutenberg dataset split by language (data/en-00000-of-00001.parquet, as on the Hub): hf:FOLDER asks for
    its train split, and the line said "Unknown split" and to check the files' format and rows, not which split to
    name."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    data = tmp_path / "gutenberg" / "data"
    data.mkdir(parents=True)
    for lang in ("en", "de"):
        pq.write_table(pa.table({"id": ["1"], "text": [f"A book in {lang}."]}), data / f"{lang}-00000-of-00001.parquet")
    folder = tmp_path / "gutenberg"
    with pytest.raises(DataPrepError) as err:
        list(iter_documents(f"hf:{folder}"))
    assert str(err.value) == f"hf:{folder} has no split 'train' (its splits: de, en); name one: hf:{folder}:de"
    assert [d.text for d in iter_documents(f"hf:{folder}:en")] == ["A book in en.\n"]


def test_an_out_inside_a_local_dataset_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    """--out shelf/prepared for hf:shelf was written, and then the same command stopped with "No (supported) data
    files found in shelf": datasets read the shards and lists there as the dataset's files."""
    import datasets

    from data_prep.prepare import prepare

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    (shelf / "part.jsonl").write_text('{"text": "First book."}\n{"text": "Second book."}\n', encoding="utf-8")
    with pytest.raises(DataPrepError) as err:
        prepare(f"hf:{shelf}", shelf / "prepared")
    assert str(err.value) == (
        f"--out {shelf / 'prepared'} is inside {shelf}, the dataset folder of source 'hf:{shelf}': the next "
        "preparation would read what it writes there as the dataset's files; choose an --out outside it"
    )
    assert sorted(p.name for p in shelf.iterdir()) == ["part.jsonl"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("hf:someone/books", "could not load Hugging Face dataset 'someone/books' split 'train': "),
        ("pg19", "could not list pg19 (the Hub dataset emozilla/pg19): "),
    ],
)
def test_a_hub_dataset_without_a_network_is_one_line_at_once(tmp_path, source, message):
    """With no network (an endpoint whose name does not resolve: .invalid never does), huggingface_hub retried each
    request for ~25 s, 24 lines of retries on screen, before a line blaming a cache ("not cached in None"). Now
    the Hub's name is looked up first: one line says the Hub cannot be reached and datasets' cache has no copy."""
    env = {**os.environ, "HF_ENDPOINT": "http://hub.invalid", "HF_HOME": str(tmp_path / "hf")}
    env = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    cmd = [sys.executable, "-m", "data_prep.prepare", "--source", source, "--out", str(tmp_path / "data")]
    out = run(cmd, expect_rc=1, env=env, timeout=60)
    assert "Retrying" not in out.stderr and "thrown while requesting" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {message}the Hub (hub.invalid) cannot be reached (its name does not resolve: "), (
        last
    )
    assert "; check the network" in last, last
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_dataset_of_text_files_is_a_document_per_file_not_per_line(tmp_path, monkeypatch, streaming):
    """A Hub dataset (or a local folder) of .txt books: datasets' text builder would give every line as a row, and so
    a document of its own, split between train and val line by line."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    books = {"a.txt": "Book one\n\nIts first line.\nIts second.\n", "b.txt": "Book two\nA line.\n\nAnother.\n"}
    data = tmp_path / "shelf"
    data.mkdir()
    for name, text in books.items():
        (data / name).write_text(text, encoding="utf-8")
    docs = list(iter_documents(f"hf:{data}", streaming=streaming))
    assert [d.text for d in docs] == list(books.values())
    assert [d.title for d in docs] == ["a", "b"]  # each book named by its file, as files: names them
    # a zip among the files holds several books: a row is no longer a listed file, so rows are numbered instead
    with zipfile.ZipFile(data / "more.zip", "w") as z:
        z.writestr("c.txt", "Book three\n")
        z.writestr("d.txt", "Book four\n")
    docs = list(iter_documents(f"hf:{data}", streaming=streaming))
    assert [(d.title, d.text) for d in docs] == [
        (f"{data} #{i}", t) for i, t in enumerate([*books.values(), "Book three\n", "Book four\n"])
    ]


def test_hf_column_that_is_not_text_is_one_clear_error(tmp_path, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "A book.", "year": 1850, "tags": ["a", "b"]}\n', encoding="utf-8")
    with pytest.raises(DataPrepError, match=r"column 'tags' holds list values \(row 0: \['a', 'b'\]\), not text"):
        list(iter_documents(f"hf:{data}:train:tags"))
    out = tmp_path / "data"
    assert main(["--source", f"hf:{data}:train:year", "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: hf:{data}:train:year: column 'year' holds int values (row 0: 1850), not text; name the dataset's "
        f"text column: hf:DATASET:SPLIT:COLUMN"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "hf_cache", "rows.jsonl"]


def test_malformed_spec_fails_before_reading_anything():
    with pytest.raises(DataPrepError, match="unknown source kind 'pdf'"):
        iter_documents("default+pdf:x.pdf")  # not iterated: the spec is checked up front
    # PG-19 by its Hub id through hf: is sent to the pg19 source, before datasets downloads anything
    for spec in ("hf:emozilla/pg19", "default + hf:deepmind/pg19:validation:text"):
        with pytest.raises(DataPrepError, match=r"reads PG-19 as a generic dataset .* use --source pg19 \(streams"):
            iter_documents(spec)


def test_parse_spec_combines_with_plus():
    assert parse_spec("default + files:a/*.txt+hf:x/y:test:body") == [
        ("default", ""),
        ("files", "a/*.txt"),
        ("hf", "x/y:test:body"),
    ]
    # a + that does not start a source (a word and a colon, or a kind that needs no argument) is part of a path
    assert parse_spec("files:~/C++/notes+files:Books+Letters/*.txt+pg19 + default") == [
        ("files", "~/C++/notes"),
        ("files", "Books+Letters/*.txt"),
        ("pg19", ""),
        ("default", ""),
    ]


def test_files_in_a_folder_whose_name_holds_a_plus(tmp_path):
    books = tmp_path / "Books+Letters"
    books.mkdir()
    (books / "a.txt").write_text("Alpha.\n", encoding="utf-8")
    docs = list(iter_documents(f"files:{books}+default:sonnets"))
    assert [d.id for d in docs] == ["files/Books+Letters/a.txt", "default/shakespeare/sonnets"]
