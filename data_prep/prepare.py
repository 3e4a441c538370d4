"""Prepare books for training: documents -> GPT-2 tokens (+ <|endoftext|>) -> uint16 shards + manifest.

    python -m data_prep.prepare --source default --out data/default

Documents go to train or val by a hash of their id (adding books never moves the others), and
the whole dataset is built in a temp dir next to `--out` and swapped in by renames at the end:
an interrupted or failed run leaves any previous dataset untouched. Re-running with the same
inputs and parameters is a no-op.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from data_prep import DataPrepError
from data_prep.loader import DTYPE, FORMAT_VERSION, MANIFEST_NAME, file_sha256, load_manifest
from data_prep.sources import DEFAULT_MIRROR, SPEC_HELP, iter_documents, parse_spec
from data_prep.tokenizer import EOT_ID, TOKENIZER_NAME, TOKENIZER_SHA256, VOCAB_SIZE, get_encoding

log = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 50_000_000  # 100 MB per shard file
DEFAULT_VAL_FRACTION = 0.1


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
    if shard_tokens < 1 or not 0 < val_fraction < 1 or num_proc < 1:
        raise DataPrepError(
            f"need shard_tokens >= 1, 0 < val_fraction < 1 and num_proc >= 1; got {shard_tokens=}, "
            f"{val_fraction=}, {num_proc=}"
        )
    parse_spec(source)  # reject a malformed spec before touching anything
    out = Path(out_dir).absolute()
    _check_out_dir(out)
    get_encoding()  # fail early (before reading inputs) if the tokenizer can't be provisioned
    params = {"shard_tokens": shard_tokens, "val_fraction": val_fraction, "seed": seed}

    log.info("Reading source %r", source)
    docs = [
        (d.id, d.title, _sha256(d.text.encode())) for d in iter_documents(source, mirror=mirror, streaming=streaming)
    ]
    fingerprint = _fingerprint(source, params, docs)

    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(out):  # several ranks may call prepare() at once; the later ones find it done
        for stale in out.parent.glob(f".{out.name}.build-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        if _up_to_date(out, fingerprint):
            log.info("%s is up to date (same inputs and parameters); nothing to do", out)
            return out / MANIFEST_NAME
        build = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
        build.chmod(0o755)  # mkdtemp makes it private; the dataset is meant to be shared
        try:
            splits = assign_splits([d[0] for d in docs], val_fraction, seed)
            reader = {"source": source, "mirror": mirror, "streaming": streaming}
            manifest = _build(build, reader, docs, splits, params, fingerprint, num_proc)
            (build / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            _swap_in(build, out)
        finally:
            shutil.rmtree(build, ignore_errors=True)
    totals = manifest["splits"]
    log.info(
        "Wrote %s: train %d tokens (%d docs), val %d tokens (%d docs)",
        out,
        totals["train"]["num_tokens"],
        totals["train"]["num_documents"],
        totals["val"]["num_tokens"],
        totals["val"]["num_documents"],
    )
    return out / MANIFEST_NAME


def assign_splits(ids: list[str], val_fraction: float, seed: int = 0) -> dict[str, str]:
    """id -> "train"/"val" by a hash of (seed, id); with >= 2 documents both splits are non-empty."""
    if len(ids) < 2:
        log.warning("only %d document(s): all go to train, there will be no validation split", len(ids))
        return dict.fromkeys(ids, "train")
    score = {i: int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "big") / 2**64 for i in ids}
    val = {i for i in ids if score[i] < val_fraction}
    if not val:
        val = {min(ids, key=score.__getitem__)}
    if len(val) == len(ids):
        val.remove(max(ids, key=score.__getitem__))
    return {i: "val" if i in val else "train" for i in ids}


def _fingerprint(source: str, params: dict[str, Any], docs: list[tuple[str, str, str]]) -> str:
    h = hashlib.sha256()
    setup = {"format_version": FORMAT_VERSION, "tokenizer": TOKENIZER_SHA256, "source": source, **params}
    h.update(json.dumps(setup, sort_keys=True).encode())
    for doc in docs:
        h.update(json.dumps(doc).encode())
    return h.hexdigest()


def _check_out_dir(out: Path) -> None:
    # The output dir is replaced wholesale, so never take over a folder we did not create.
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST_NAME).is_file())):
        raise DataPrepError(
            f"{out} exists and is not a prepared dataset (no {MANIFEST_NAME}); it would be replaced, so "
            f"choose another --out or remove it yourself"
        )


def _up_to_date(out: Path, fingerprint: str) -> bool:
    try:
        return load_manifest(out, verify="sha256").fingerprint == fingerprint
    except DataPrepError:
        return False


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _swap_in(build: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        os.rename(out, old)
    os.rename(build, out)
    shutil.rmtree(old, ignore_errors=True)


def _generate(source: str, mirror: str, streaming: bool, expected: tuple[str, ...]) -> Iterator[dict[str, str]]:
    """Second read of the source for datasets; the content must match what was fingerprinted."""
    changed = DataPrepError(f"source {source!r} changed while it was being prepared; run prepare again")
    count = 0
    for count, doc in enumerate(iter_documents(source, mirror=mirror, streaming=streaming), 1):
        if count > len(expected) or _sha256(doc.text.encode()) != expected[count - 1]:
            raise changed
        yield {"id": doc.id, "title": doc.title, "text": doc.text}
    if count != len(expected):
        raise changed


def tokenize_batch(batch: dict[str, list]) -> dict[str, list]:
    """datasets.map function: GPT-2 tokens of each "text" followed by <|endoftext|>."""
    enc = get_encoding()
    # encode_ordinary: a literal "<|endoftext|>" inside a book is just text, not a separator.
    return {"tokens": [[*enc.encode_ordinary(text), EOT_ID] for text in batch["text"]]}


def _build(
    build: Path,
    reader: dict[str, Any],
    docs: list[tuple[str, str, str]],
    splits: dict[str, str],
    params: dict[str, Any],
    fingerprint: str,
    num_proc: int,
) -> dict[str, Any]:
    import datasets  # lazily: the loader side of this package must work without it

    # A datasets cache private to this build: it can never serve stale results, and goes with it.
    # gen_kwargs lists would be split into one generator call per item; the tuple stays whole.
    gen_kwargs = {**reader, "expected": tuple(d[2] for d in docs)}
    try:
        ds = datasets.Dataset.from_generator(
            _generate,
            features=datasets.Features({k: datasets.Value("string") for k in ("id", "title", "text")}),
            cache_dir=str(build / ".hf_cache"),
            gen_kwargs=gen_kwargs,
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, DataPrepError):
            raise e.__cause__ from None
        raise
    tokens_feature = datasets.Features(
        {
            "id": datasets.Value("string"),
            "title": datasets.Value("string"),
            "tokens": datasets.List(datasets.Value(DTYPE)),
        }
    )
    ds = ds.map(
        tokenize_batch,
        batched=True,
        batch_size=8,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
        features=tokens_feature,
        desc="Tokenizing",
    )
    writers = {split: _ShardWriter(build, split, params["shard_tokens"]) for split in ("train", "val")}
    documents = []
    with tqdm(total=len(ds), desc="Writing shards", unit="doc") as bar:
        for batch in ds.with_format("numpy").iter(batch_size=16):
            for doc_id, title, tokens in zip(batch["id"], batch["title"], batch["tokens"], strict=True):
                split = splits[str(doc_id)]
                writers[split].write(tokens)
                documents.append({"id": str(doc_id), "title": str(title), "split": split, "num_tokens": len(tokens)})
                bar.update()
    shutil.rmtree(build / ".hf_cache")
    shards = [s for w in writers.values() for s in w.close()]
    return {
        "format_version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tokenizer": {"name": TOKENIZER_NAME, "sha256": TOKENIZER_SHA256, "vocab_size": VOCAB_SIZE, "eot_id": EOT_ID},
        "dtype": DTYPE,
        "source": reader["source"],
        "params": params,
        "splits": {
            split: {
                "num_tokens": sum(s["num_tokens"] for s in shards if s["split"] == split),
                "num_documents": sum(d["split"] == split for d in documents),
                "num_shards": sum(s["split"] == split for s in shards),
            }
            for split in ("train", "val")
        },
        "shards": shards,
        "documents": documents,
    }


class _ShardWriter:
    """Appends a split's tokens to `{split}_000.bin`, `{split}_001.bin`, ... of `shard_tokens` each."""

    def __init__(self, folder: Path, split: str, shard_tokens: int) -> None:
        self.folder, self.split, self.shard_tokens = folder, split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=np.uint16)
        while len(tokens):
            if self._file is None:
                path = self.folder / f"{self.split}_{len(self.shards):03d}.bin"
                self._file = open(path, "wb")  # noqa: SIM115 - stays open across write() calls
                self._count = 0
            take = min(len(tokens), self.shard_tokens - self._count)
            self._file.write(tokens[:take].tobytes())
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._finish()
        return self.shards

    def _finish(self) -> None:
        self._file.close()
        path = Path(self._file.name)
        self.shards.append(
            {"file": path.name, "split": self.split, "num_tokens": self._count, "sha256": file_sha256(path)}
        )
        self._file = None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--seed", type=int, default=0, help="salt of the train/val split hash")
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="Project Gutenberg base URL for gutenberg:")
    parser.add_argument("--streaming", action="store_true", help="stream hf: datasets instead of downloading")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
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
    except DataPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
