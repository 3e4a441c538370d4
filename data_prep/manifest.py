"""A prepared dataset's manifest: its names and format, and the reader that checks it and its shards.

No torch here: data preparation reads and writes manifests on machines that may not have (or want) it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep import DataPrepError
from data_prep.tokenizer import TOKENIZER_NAME, TOKENIZER_SHA256

FORMAT_VERSION = 2  # 2: per-document metadata in documents.jsonl; 1 had it inside the manifest
READABLE_FORMATS = (1, 2)  # the shards themselves are the same in both
MANIFEST_NAME = "manifest.json"
DOCUMENTS_NAME = "documents.jsonl"  # one {"id", "title", "split", "num_tokens"} line per book, in shard order
DTYPE = "uint16"
VERIFY_MODES = ("none", "size", "sha256")
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Shard:
    file: str
    split: str
    num_tokens: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    data_dir: Path
    format_version: int
    fingerprint: str
    tokenizer_name: str
    tokenizer_sha256: str
    vocab_size: int
    eot_id: int
    dtype: str
    source: str
    params: dict[str, Any]
    splits: dict[str, dict[str, int]]
    shards: list[Shard]
    documents_sha256: str | None  # of documents.jsonl; None for format 1

    def documents(self) -> Iterator[dict[str, Any]]:
        """Per-book metadata in shard order, read lazily (training never needs it)."""
        if self.documents_sha256 is None:
            yield from json.loads((self.data_dir / MANIFEST_NAME).read_text(encoding="utf-8"))["documents"]
            return
        with open(self.data_dir / DOCUMENTS_NAME, encoding="utf-8") as f:
            yield from map(json.loads, f)

    @property
    def content_digest(self) -> str:
        """A hash of what a run reads: the tokens (each shard's split and sha256, in order), their tokenizer and dtype.
        Unlike the fingerprint it leaves out where the books were read from (the --source string, the documents' ids):
        the same books prepared from /data/a on one machine and /scratch/b on another are the same data."""
        shards = [(s.split, s.sha256) for s in self.shards]
        content = [self.tokenizer_sha256, self.dtype, shards]
        return hashlib.sha256(json.dumps(content).encode()).hexdigest()

    def shards_of(self, split: str) -> list[Shard]:
        return [s for s in self.shards if s.split == split]

    def num_tokens(self, split: str) -> int:
        return sum(s.num_tokens for s in self.shards_of(split))


PG19_DIR = "data/pg19"  # where the README prepares PG-19, and the PG-19 run configs train from


def prepare_command(data_dir: str | Path, source: str = "default") -> str:
    return f"python -m data_prep.prepare --source {shlex.quote(source)} --out {shlex.quote(str(data_dir))}"


# What a folder's books are, by the source that prepares them (data_prep.sources.folder_source)
_HELD = {"files": (".txt files", "these books"), "pg19": ("a copy of PG-19", "it"), "hf": ("dataset files", "them")}


def _missing_dataset(data_dir: Path) -> str:
    """What a --data-dir without a manifest is, and the command that prepares one: a mistyped path, a folder of the
    books themselves (a library's tree, a copy of PG-19), or a folder to prepare into (from the user's books: the
    embedded corpus only where asked for, which would otherwise train under the name of the user's own data). prepare
    writes only into a new or empty folder: a folder holding anything is never offered as its --out."""
    if not data_dir.exists() and data_dir == Path(PG19_DIR):  # a PG-19 run config launched before its data
        return (
            f"no prepared dataset in {data_dir}: no such folder; prepare PG-19 into it (~5.8 GB of shards) with:\n  "
            f"{prepare_command(data_dir, 'pg19')}"
        )
    if not data_dir.exists():
        what = f"no prepared dataset in {data_dir}: no such folder (check --data-dir)"
    elif not data_dir.is_dir():  # a book, or a prepared dataset's manifest or shard given for its folder
        folder = f": {data_dir.parent}" if (data_dir.parent / MANIFEST_NAME).is_file() else ""
        return (
            f"{data_dir} is a file, not a prepared dataset's folder: --data-dir takes the folder prepare writes{folder}"
        )
    elif data_dir.is_dir() and any(data_dir.iterdir()):
        from data_prep.sources import folder_source  # on this error's path alone
        from modeling.runs import METRICS_FILE, named

        if (data_dir / METRICS_FILE).is_file():  # its samples.txt is no book
            return (
                f"{data_dir} is a training run's folder, not a prepared dataset ({MANIFEST_NAME} is missing): "
                "--data-dir takes the folder prepare writes (e.g. data/default); check --data-dir"
            )
        source = folder_source(data_dir)
        beside = f"{named(data_dir)}-prepared"  # data_dir . (from inside it): not .-prepared, among its files
        if source is None:
            return (
                f"no prepared dataset in {data_dir} ({MANIFEST_NAME} is missing), and it holds other files, so "
                f"prepare cannot write there: check --data-dir, or prepare your books into another folder with:\n  "
                f"{prepare_command(beside, 'files:PATH/TO/BOOKS')}"
            )
        held, them = _HELD[source.partition(":")[0]]
        what = (
            f"{data_dir} holds {held}, not a prepared dataset ({MANIFEST_NAME} is missing): --data-dir takes the "
            "folder prepare writes"
        )
        return f"{what}; prepare {them} with:\n  {prepare_command(beside, source)}"
    else:
        what = f"no prepared dataset in {data_dir} ({MANIFEST_NAME} is missing)"
    return (
        f"{what}; prepare your books into it (--source default: the embedded corpus of Shakespeare and Milton) "
        f"with:\n  {prepare_command(data_dir, 'files:PATH/TO/BOOKS')}"
    )


def load_manifest(data_dir: str | Path, verify: str = "size") -> Manifest:
    """Read `data_dir/manifest.json` and check it and its shards (`verify`: none, size or sha256)."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    data_dir = Path(data_dir)
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise DataPrepError(_missing_dataset(data_dir))
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        tok = raw["tokenizer"]
        manifest = Manifest(
            data_dir=data_dir,
            format_version=raw["format_version"],
            fingerprint=raw["fingerprint"],
            tokenizer_name=tok["name"],
            tokenizer_sha256=tok["sha256"],
            vocab_size=tok["vocab_size"],
            eot_id=tok["eot_id"],
            dtype=raw["dtype"],
            source=raw["source"],
            params=raw["params"],
            splits=raw["splits"],
            shards=[Shard(**s) for s in raw["shards"]],
            documents_sha256=raw["documents"]["sha256"] if raw["format_version"] > 1 else None,
        )
    except (ValueError, KeyError, TypeError) as e:  # bad JSON, missing or unexpected fields
        raise DataPrepError(
            f"{path} is not a valid manifest ({type(e).__name__}: {e}); re-run:\n  {prepare_command(data_dir)}"
        ) from None
    _check(manifest, verify)
    return manifest


def _check(m: Manifest, verify: str) -> None:
    redo = f"re-run:\n  {prepare_command(m.data_dir, m.source)}"
    if m.format_version not in READABLE_FORMATS or m.dtype != DTYPE:
        raise DataPrepError(
            f"{m.data_dir} was prepared in format {m.format_version}/{m.dtype}, this code reads "
            f"{'/'.join(map(str, READABLE_FORMATS))} of {DTYPE}; {redo}"
        )
    if (m.tokenizer_name, m.tokenizer_sha256) != (TOKENIZER_NAME, TOKENIZER_SHA256):
        raise DataPrepError(
            f"{m.data_dir} was tokenized with {m.tokenizer_name!r} (ranks sha256 {m.tokenizer_sha256[:12]}...) "
            f"but training uses {TOKENIZER_NAME!r} ({TOKENIZER_SHA256[:12]}...); {redo}"
        )
    if verify == "none":
        return
    for shard in m.shards:
        path = m.data_dir / shard.file
        size = path.stat().st_size if path.is_file() else None
        if size != 2 * shard.num_tokens:
            found = "missing" if size is None else f"{size} bytes"
            raise DataPrepError(
                f"shard {path} is {found} but the manifest expects {2 * shard.num_tokens} bytes "
                f"(truncated or altered); {redo}"
            )
        if verify == "sha256" and file_sha256(path) != shard.sha256:
            raise DataPrepError(f"shard {path} does not match its sha256 in the manifest (altered); {redo}")
    index = m.data_dir / DOCUMENTS_NAME
    if verify == "sha256" and m.documents_sha256 and (not index.is_file() or file_sha256(index) != m.documents_sha256):
        raise DataPrepError(f"{index} is missing or does not match its sha256 in the manifest; {redo}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
