"""Data pipeline at library scale: prepare vs raw tiktoken, memory, disk, loader start-up; a Markdown table.

    python -m data_prep.bench --tokens 50e6 500e6

Synthetic libraries are written locally from the embedded books (nothing downloaded): a tree of
~120k-token books, `--tokens` in all. For each size and num_proc in (1, 2) it times, side by side,
raw `encode_ordinary_batch(texts, num_threads=num_proc)` on the same cleaned texts already in memory,
and `prepare(files:...)` end to end (list, read, clean, tokenize, split, write shards and index, hash),
each prepare in a fresh process so its peak RSS (and its workers') is its own. Then the TokenLoader's
start-up on the result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

from data_prep import number_arg
from data_prep.tokenizer import get_encoding

BOOK_CHARS = 400_000  # ~120k GPT-2 tokens: the size of a long novel
SHELF = 100  # books per sub-folder, as a library tree (PG-19's layout) has them
LOADER_BATCHES = 500  # micro-batches timed after the first, in the training process (num_workers=0)


def build_library(folder: Path, tokens: float) -> Path:
    """A tree of distinct books made from the embedded corpus, ~`tokens` GPT-2 tokens in all (cached)."""
    from data_prep.sources import iter_documents

    done = folder / ".complete"
    if done.is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    texts = [d.text for d in iter_documents("default")]
    stream = "".join(texts)
    chars = int(tokens / 0.306)  # the embedded corpus's tokens per character
    for i in range(chars // BOOK_CHARS + 1):
        start = (i * 7919 * 1000) % (len(stream) - BOOK_CHARS)  # a different window of the corpus each time
        path = folder / f"shelf{i // SHELF:03d}" / f"book{i:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"Book {i}\n\n" + stream[start : start + BOOK_CHARS], encoding="utf-8")
    done.touch()
    return folder


def raw_tiktoken(library: Path, num_threads: int) -> float:
    """Tokens/s of encode_ordinary_batch alone on the library's cleaned texts, chunk by chunk."""
    from data_prep.sources import plan

    enc = get_encoding()
    records = plan(f"files:{library}").records(0)
    tokens, seconds = 0, 0.0
    while chunk := [d.text for d in map(lambda r: r.document(), islice(records, 32)) if d]:
        start = time.perf_counter()
        tokens += sum(map(len, enc.encode_ordinary_batch(chunk, num_threads=num_threads)))
        seconds += time.perf_counter() - start
    return tokens / seconds


def _child(argv: list[str]) -> dict:
    """Run one measurement in a fresh process; returns what it printed as JSON."""
    proc = subprocess.run([sys.executable, "-m", "data_prep.bench", *argv], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rss_mb(who: str) -> float:
    import resource  # POSIX only: this benchmark measures worker processes as Linux reports them

    return resource.getrusage(getattr(resource, who)).ru_maxrss / 1024  # kB on Linux


def _prepare_child(library: str, out: str, num_proc: int) -> None:
    from data_prep.prepare import prepare

    get_encoding()
    start = time.perf_counter()
    manifest = json.loads(prepare(f"files:{library}", out, num_proc=num_proc).read_text())
    seconds = time.perf_counter() - start
    tokens = sum(s["num_tokens"] for s in manifest["splits"].values())
    result = {"seconds": seconds, "tokens": tokens, "books": manifest["documents"]["count"]}
    result |= {"rss_main": _rss_mb("RUSAGE_SELF"), "rss_worker": _rss_mb("RUSAGE_CHILDREN")}
    print(json.dumps(result))


def _loader_child(data_dir: str) -> None:
    import torch  # noqa: F401 - imported before the baseline RSS, as a training run has it

    from data_prep.loader import TokenLoader

    before = _rss_mb("RUSAGE_SELF")
    start = time.perf_counter()
    loader = TokenLoader(data_dir, "train", 1024, 8)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - start
    rss = _rss_mb("RUSAGE_SELF") - before  # before the timed batches fault in memmapped shard pages
    start = time.perf_counter()
    for _ in islice(batches, LOADER_BATCHES):
        pass
    rate = LOADER_BATCHES * 8 * 1024 / (time.perf_counter() - start)
    result = {"seconds": seconds, "rss": rss, "tokens_per_s": rate}
    print(json.dumps(result | {"shards": len(loader.manifest.shards)}))


def _millions(tokens: float) -> str:
    """A library's size as the tables name it: whole millions from 10M, else to 0.01M (a 0.1M and a 0.2M library
    were both '0M')."""
    return f"{tokens / 1e6:,.{0 if tokens >= 10e6 else 2}f}M"


# --tokens: a library of at least one token (below, a traceback from the empty library)
_tokens = number_arg("a number of tokens such as 50e6", lambda v: v >= 1, "at least 1")


def _du_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_prep.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=_tokens, nargs="+", default=[50e6, 500e6], help="library sizes, in tokens")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bookgpt-data-bench"), help="scratch folder")
    parser.add_argument("--prepare-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--loader-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare_child:
        return _prepare_child(args.prepare_child[0], args.prepare_child[1], int(args.prepare_child[2]))
    if args.loader_child:
        return _loader_child(args.loader_child)

    try:  # before the first library is built, not as mkdir's traceback
        args.work.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        why = "a file is there" if isinstance(err, FileExistsError) else err.strerror
        parser.error(f"--work {args.work}: {why}; give a scratch folder")
    rows, loader_rows = [], []
    for tokens in args.tokens:
        library = build_library(args.work / f"library-{tokens / 1e6:g}M", tokens)
        text_mb = _du_mb(library)
        for num_proc in (1, 2):
            raw = raw_tiktoken(library, num_proc)
            out = args.work / f"prepared-{tokens / 1e6:g}M-{num_proc}"
            shutil.rmtree(out, ignore_errors=True)
            got = _child(["--prepare-child", str(library), str(out), str(num_proc)])
            size = _millions(got["tokens"])  # what was built: at least one whole book, whatever --tokens asked
            rate = got["tokens"] / got["seconds"]
            worker_rss = f"{got['rss_worker']:,.0f}" if num_proc > 1 else "-"
            rows.append(
                f"| {size} ({got['books']:,} books, {text_mb:,.0f} MB text) | {num_proc} "
                f"| {raw / 1e6:.2f}M | {rate / 1e6:.2f}M | {rate / raw:.0%} | {got['seconds']:.0f} "
                f"| {got['rss_main']:,.0f} | {worker_rss} | {_du_mb(out):,.0f} |"
            )
            print(rows[-1], file=sys.stderr)
            if num_proc == 2:
                got = _child(["--loader-child", str(out)])
                loader_rows.append(
                    f"| {size} | {got['shards']} | {got['seconds']:.2f} | {got['rss']:,.0f} "
                    f"| {got['tokens_per_s'] / 1e6:.1f}M |"
                )
            shutil.rmtree(out)
    from modeling.device import cpu_model  # imports torch: here, not in the prepare child whose memory is measured

    print(f"Data preparation, CPU: {cpu_model()}, files: source, default shards\n")
    print(
        "| library | num_proc | raw tiktoken tokens/s | prepare tokens/s | prepare / raw | prepare s "
        "| peak RSS main (MB) | peak RSS per worker (MB) | shards + index (MB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\nTokenLoader, block 1024 x micro-batch 8, num_workers=0 (start-up: manifest, size checks, first batch)\n")
    print("| library | shards | start-up s | RSS added (MB) | tokens/s after |\n|---|---:|---:|---:|---:|")
    print("\n".join(loader_rows))
    return None


if __name__ == "__main__":
    main()
