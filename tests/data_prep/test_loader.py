"""Loader: manifest checks, windows, rank disjointness and exact resume."""

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep import DataPrepError
from data_prep.loader import IGNORE_INDEX, EvalWindows, TokenLoader, WindowDataset, spread
from data_prep.manifest import load_manifest, prepare_command
from data_prep.prepare import main as prepare_main
from data_prep.prepare import prepare
from testkit import write_pg19_copy

BLOCK = 64


def _copy(prepared: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "data"))


def _rows(batches) -> Counter:
    return Counter(tuple(row) for x, _ in batches for row in x.tolist())


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


def test_windows_are_shifted_pairs_inside_one_shard(prepared_books):
    manifest = load_manifest(prepared_books)
    shards = manifest.shards_of("train")
    ds = WindowDataset(manifest, "train", BLOCK)
    assert len(ds) == sum((s.num_tokens - 1) // BLOCK for s in shards)
    first_of_shard2 = sum((s.num_tokens - 1) // BLOCK for s in shards[:2])
    shard2 = np.fromfile(prepared_books / shards[2].file, dtype=np.uint16).astype(np.int64)
    x, y = ds[first_of_shard2 + 3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (BLOCK,)
    assert x.tolist() == shard2[3 * BLOCK : 4 * BLOCK].tolist()
    assert y.tolist() == shard2[3 * BLOCK + 1 : 4 * BLOCK + 1].tolist()
    x, y = ds[first_of_shard2 - 1]  # the last window of shard 1 ends inside shard 1
    shard1 = np.fromfile(prepared_books / shards[1].file, dtype=np.uint16).astype(np.int64)
    start = ((shards[1].num_tokens - 1) // BLOCK - 1) * BLOCK
    assert y.tolist() == shard1[start + 1 : start + BLOCK + 1].tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_two_ranks_cover_each_window_once_per_epoch(prepared_books):
    ranks = [TokenLoader(prepared_books, "train", BLOCK, 4, rank=r, world_size=2, seed=3) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(ranks[0].dataset) // 8
    epochs = [list(islice(loader, len(loader))) for loader in ranks]
    assert [(r.epoch, r.tokens) for r in ranks] == [(1, 0)] * 2  # the epoch's end: the next one starts
    assert [len(e) for e in epochs] == [len(ranks[0])] * 2
    for x, y in epochs[0][:3]:
        assert x.shape == y.shape == (4, BLOCK) and torch.equal(x[:, 1:], y[:, :-1])
    everything = Counter(tuple(ranks[0].dataset[i][0].tolist()) for i in range(len(ranks[0].dataset)))
    seen = _rows(epochs[0]) + _rows(epochs[1])
    assert sum(seen.values()) == 8 * len(ranks[0])
    assert len(everything) - len(seen) < 8  # only the incomplete last step is dropped
    assert all(count <= everything[row] for row, count in seen.items())  # nothing twice
    assert not (_rows(epochs[0]) & _rows(epochs[1]))


def test_infinite_loader_reshuffles_each_epoch(prepared_books):
    loader = TokenLoader(prepared_books, "train", BLOCK, 8, seed=1)
    it = iter(loader)
    first = list(islice(it, len(loader)))
    assert loader.epoch == 1
    second = list(islice(it, len(loader)))
    assert loader.epoch == 2
    assert not _same(first, second)
    assert len(_rows(first) - _rows(second)) < 8  # the same windows, up to the dropped remainder
    again = list(islice(TokenLoader(prepared_books, "train", BLOCK, 8, seed=1), len(loader)))
    assert _same(first, again)


def test_spread_takes_the_middle_of_equal_parts():
    assert spread(4, 100).tolist() == [12, 37, 62, 87]
    assert spread(3, 3).tolist() == [0, 1, 2] and spread(9, 3).tolist() == [0, 1, 2]  # all when too few
    for count, total in [(7, 10), (10, 10), (13, 1000), (1, 5), (6, 6001)]:
        picked = spread(count, total)
        assert len(picked) == count and set(np.diff(picked)) <= {total // count, -(-total // count)}  # even gaps
        assert set(picked + picked[::-1]) <= {total - 1, total}  # mirror-symmetric: from start to end alike


def _eval_rows(windows: EvalWindows) -> list[tuple[int, ...]]:
    """The windows of the set this rank evaluates (x rows), filler rows left out."""
    return [tuple(xr) for x, y in windows for xr, yr in zip(x.tolist(), y.tolist()) if yr[0] != IGNORE_INDEX]


def test_eval_windows_spread_over_every_shard_of_the_split(prepared_books):
    """The train split here has 3 shards (val has 1): the set reaches from its start to its end through each."""
    windows = EvalWindows(prepared_books, "train", BLOCK, 12, 4)
    total, shard_starts = len(windows.dataset), windows.dataset.starts
    assert windows.indices[0] == total // 24 and windows.indices[-1] == 23 * total // 24
    shards = np.searchsorted(shard_starts, windows.indices, side="right") - 1
    assert sorted(set(shards.tolist())) == [0, 1, 2] and np.all(np.diff(windows.indices) >= total // 12)
    assert len(windows) == 3
    assert _eval_rows(windows) == [tuple(windows.dataset[i][0].tolist()) for i in windows.indices]
    for x, y in windows:
        assert torch.equal(x[:, 1:], y[:, :-1])
    every = EvalWindows(prepared_books, "val", BLOCK, 10**6, 8)
    assert every.indices.tolist() == list(range(len(every.dataset)))  # more than the split has: all of it


@pytest.mark.parametrize("micro_batch_size", [4, 5])
def test_eval_windows_are_one_set_split_over_any_number_of_ranks(prepared_books, micro_batch_size):
    """The same 21 windows on 1, 2 or 3 processes, each evaluated once; every rank yields the same number of
    full-size micro-batches (sharded engines need each rank's forwards), the filler rows with ignored targets."""
    one = EvalWindows(prepared_books, "val", BLOCK, 21, micro_batch_size)
    want = Counter(_eval_rows(one))
    assert sum(want.values()) == 21
    for world_size in (2, 3):
        ranks = [
            EvalWindows(prepared_books, "val", BLOCK, 21, micro_batch_size, rank=r, world_size=world_size)
            for r in range(world_size)
        ]
        assert all(r.indices.tolist() == one.indices.tolist() for r in ranks)
        batches = [list(r) for r in ranks]
        assert len({len(b) for b in batches}) == 1 and len(batches[0]) == len(ranks[0])
        assert all(x.shape == y.shape == (micro_batch_size, BLOCK) for b in batches for x, y in b)
        filler = [row for b in batches for _, y in b for row in y.tolist() if row[0] == IGNORE_INDEX]
        assert all(set(row) == {IGNORE_INDEX} for row in filler)
        assert sum((Counter(_eval_rows(r)) for r in ranks), Counter()) == want


def test_eval_windows_are_the_same_at_every_eval(prepared_books):
    windows = EvalWindows(prepared_books, "val", BLOCK, 16, 8, rank=1, world_size=2)
    first = list(windows)
    assert _same(list(windows), first)
    assert _same(list(EvalWindows(prepared_books, "val", BLOCK, 16, 8, rank=1, world_size=2)), first)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])  # 2: worker processes
def test_resume_yields_exactly_the_remaining_batches(prepared_books, num_workers):
    def make() -> TokenLoader:
        return TokenLoader(prepared_books, "train", BLOCK, 8, rank=1, world_size=2, seed=7, num_workers=num_workers)

    reference = make()
    n = len(reference)
    expected = list(islice(iter(reference), n + 5))  # crosses into the next epoch
    for stop in (3, n - 1, n + 2):
        loader = make()
        it = iter(loader)
        _ = [next(it) for _ in range(stop)]  # workers have prefetched past this point
        state = json.loads(json.dumps(loader.state_dict()))
        epoch, batches = divmod(stop, n)
        assert (state["epoch"], state["tokens"]) == (epoch, batches * 2 * 8 * BLOCK)  # all ranks' windows
        resumed = make()
        resumed.load_state_dict({**state, "shuffle": True})  # as checkpoints written before it was dropped
        assert _same(list(islice(iter(resumed), n + 5 - stop)), expected[stop:])


def _windows(loader: TokenLoader, steps: int, ranks: list[TokenLoader] | None = None) -> list[tuple[int, ...]]:
    """The windows (as token tuples) that `steps` steps of `ranks` (default: just `loader`) consume, in global order:
    each step's micro-batches by rank."""
    iterators = [iter(r) for r in ranks or [loader]]
    return [tuple(row) for _ in range(steps) for it in iterators for row in next(it)[0].tolist()]


def _reshaped(prepared: Path, state: dict, micro_batch_size: int, world_size: int) -> list[TokenLoader]:
    ranks = [
        TokenLoader(prepared, "train", BLOCK, micro_batch_size, rank=r, world_size=world_size, seed=3)
        for r in range(world_size)
    ]
    for loader in ranks:
        loader.load_state_dict(json.loads(json.dumps(state)))
    return ranks


def test_a_resume_at_another_world_size_and_micro_batch_continues_the_same_windows(prepared_books):
    """1 process × micro-batch 4 for 5 steps, then 2 processes × 4 for 6, then 1 × 2 for 12: the windows consumed are
    exactly those of an uninterrupted 1 × 4 run, in its order (none twice, none skipped), and the position is kept in
    tokens of all ranks together."""
    reference = _windows(TokenLoader(prepared_books, "train", BLOCK, 4, seed=3), 5 + 12 + 6)
    first = TokenLoader(prepared_books, "train", BLOCK, 4, seed=3)
    seen = _windows(first, 5)
    assert first.state_dict()["tokens"] == 5 * 4 * BLOCK
    two = _reshaped(prepared_books, first.state_dict(), 4, 2)
    seen += _windows(two[0], 6, two)
    assert [r.state_dict()["tokens"] for r in two] == [(5 + 6 * 2) * 4 * BLOCK] * 2
    half = _reshaped(prepared_books, two[1].state_dict(), 2, 1)[0]
    seen += _windows(half, 12)
    assert seen == reference
    assert len(set(seen)) == len(seen)


def test_a_reshaped_resume_ends_the_epoch_where_its_steps_stop_fitting_then_follows_the_next_order(prepared_books):
    """Resumed at 2 × 4 from a 1 × 4 position 12 to 15 windows before the epoch's end, where 1 × 4 would take three
    more micro-batches: the epoch ends after the one whole 8-window step (the rest, less than a step, is dropped),
    and the next epoch is the same order any shape sees."""
    loader = TokenLoader(prepared_books, "train", BLOCK, 4, seed=3)
    n = len(loader)
    skip = (len(loader.dataset) - 12) // 4
    _windows(loader, skip)
    two = _reshaped(prepared_books, loader.state_dict(), 4, 2)
    tail = _windows(two[0], 1, two)
    assert two[0].epoch == two[1].epoch == 1 and two[0].tokens == 0
    assert tail == _windows(TokenLoader(prepared_books, "train", BLOCK, 4, seed=3), n)[skip * 4 : skip * 4 + 8]
    next_epoch = _windows(two[0], 3, two)
    fresh = TokenLoader(prepared_books, "train", BLOCK, 8, seed=3)
    fresh.load_state_dict({**fresh.state_dict(), "epoch": 1})
    assert next_epoch == _windows(fresh, 3)


def test_a_position_from_before_global_positions_resumes(prepared_books):
    """A checkpoint of the per-rank format (batches delivered at a fixed shape) resumes at the same windows."""
    ranks = [TokenLoader(prepared_books, "train", BLOCK, 4, rank=r, world_size=2, seed=3) for r in (0, 1)]
    _windows(ranks[0], 3, ranks)
    expected = _windows(ranks[0], 2, ranks)
    old = {"epoch": 0, "batches_delivered": 3, "seed": 3, "world_size": 2, "block_size": BLOCK,
           "micro_batch_size": 4, "shuffle": True, "num_windows": len(ranks[0].dataset)}  # fmt: skip
    assert _windows(None, 2, _reshaped(prepared_books, old, 4, 2)) == expected
    assert _windows(_reshaped(prepared_books, old, 8, 1)[0], 2) == expected


def test_resume_with_other_data_or_seed_is_refused(prepared_books):
    state = TokenLoader(prepared_books, "train", BLOCK, 8, world_size=2, seed=1).state_dict()
    other = TokenLoader(prepared_books, "train", BLOCK, 4, world_size=1)
    with pytest.raises(
        DataPrepError,
        match=r"cannot resume the train loader: the checkpoint has seed=1 \(now 0\); resume with the same data, seed "
        r"and block size, or start afresh: --resume never sets this run aside",
    ):
        other.load_state_dict(state)


def test_a_position_in_other_data_restarts_at_the_new_datas_start_only_where_asked(prepared_books, tmp_path):
    """The library grew (a real preparation with one more book): a position saved in the old data is refused with
    the way to go on (--on-new-data continue), and with restart_on_other_data the loader reads the new data from
    its start, keeping what it set aside. The data the position is in resumes there with the flag too, so a
    relaunch of the same command (a requeued job) never restarts it."""
    grown = tmp_path / "grown"
    prepare("default:hamlet,macbeth,tempest,twelfth_night,othello", grown, shard_tokens=40_000, val_fraction=0.1)
    old = TokenLoader(prepared_books, "train", BLOCK, 4, seed=1)
    _windows(old, 3)
    state = old.state_dict()

    with pytest.raises(DataPrepError, match=r"other tokens in .*grown\); to train this run on \(its weights, "
                       r"optimizer, schedule and step kept\) from the start of the new data, add --on-new-data "
                       r"continue; else resume with the same data"):  # fmt: skip
        TokenLoader(grown, "train", BLOCK, 4, seed=1).load_state_dict(state)
    restarted = TokenLoader(grown, "train", BLOCK, 4, seed=1, restart_on_other_data=True)
    restarted.load_state_dict(state)
    assert restarted.left_behind == state and (restarted.epoch, restarted.tokens) == (0, 0)
    assert _windows(restarted, 2) == _windows(TokenLoader(grown, "train", BLOCK, 4, seed=1), 2)

    again = TokenLoader(grown, "train", BLOCK, 4, seed=1, restart_on_other_data=True)
    again.load_state_dict(restarted.state_dict())
    assert again.left_behind is None and again.tokens == 2 * 4 * BLOCK
    same = TokenLoader(prepared_books, "train", BLOCK, 4, seed=1, restart_on_other_data=True)
    same.load_state_dict(state)
    assert same.left_behind is None and _windows(same, 2) == _windows(old, 2)


def test_resume_on_other_tokens_of_as_many_windows_is_refused_and_on_a_copy_elsewhere_goes_on(prepared_books, tmp_path):
    """Books prepared again with other text of the same length: as many windows, other tokens. The content digest
    tells them apart; the same shards in another folder (a node-local copy) are the same data."""
    state = TokenLoader(prepared_books, "train", BLOCK, 4, seed=1).state_dict()
    copy, other = tmp_path / "copy", tmp_path / "other"
    shutil.copytree(prepared_books, copy)
    shutil.copytree(prepared_books, other)
    manifest = json.loads((other / "manifest.json").read_text())
    shard = next(s for s in manifest["shards"] if s["split"] == "train")
    tokens = np.fromfile(other / shard["file"], dtype=np.uint16)[::-1].copy()  # the same tokens, in another order
    tokens.tofile(other / shard["file"])
    shard["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()
    (other / "manifest.json").write_text(json.dumps(manifest))

    TokenLoader(copy, "train", BLOCK, 4, seed=1).load_state_dict(state)
    moved = TokenLoader(other, "train", BLOCK, 4, seed=1)
    assert len(moved.dataset) == state["num_windows"]
    with pytest.raises(DataPrepError, match=rf": other tokens in {re.escape(str(other))}\); to train this run on"):
        moved.load_state_dict(state)


def test_accelerate_checkpointing_round_trip(prepared_books, tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    loader = TokenLoader(prepared_books, "train", BLOCK, 8, seed=5)
    accelerator.register_for_checkpointing(loader)
    it = iter(loader)
    _ = [next(it) for _ in range(4)]
    accelerator.save_state(str(tmp_path / "ckpt"))
    expected = [next(it) for _ in range(3)]
    loader.load_state_dict(TokenLoader(prepared_books, "train", BLOCK, 8, seed=5).state_dict())  # back to start
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert _same(list(islice(iter(loader), 3)), expected)


def test_too_small_split_says_how_many_tokens_are_needed(prepared_books):
    with pytest.raises(DataPrepError, match=r"split 'val' .* has 1 windows of 20000 tokens .* needs at least 80001"):
        TokenLoader(prepared_books, "val", 20_000, 2, world_size=2)


def test_split_without_one_eval_window_says_so(prepared_books):
    with pytest.raises(DataPrepError, match=r"split 'val' .* has \d+ tokens, fewer than one window of 100000 \+ 1"):
        EvalWindows(prepared_books, "val", 100_000, 8, 4)


def test_windows_lost_to_small_shards_point_to_shard_tokens(prepared_books):
    """A window never crosses a shard's end: with shards of about a window (--shard-tokens 40000), a split whose
    tokens hold the windows asked for has fewer, and the message says why instead of "too few tokens"."""
    tokens = load_manifest(prepared_books).num_tokens("train")
    assert tokens > 100_001  # three shards' worth: two windows of 40000 + 1, four of 25000 + 1
    with pytest.raises(DataPrepError) as lost:
        EvalWindows(prepared_books, "train", 40_000, 8, 4)
    assert str(lost.value) == (
        f"split 'train' of {prepared_books} has {tokens} tokens but only 0 windows of 40000 + 1 tokens in its shards, "
        f"1 needed: a window never crosses a shard's end, and its shards hold at most 40000 tokens each "
        f"(--shard-tokens 40000); prepare it again with a --shard-tokens far above 40000 (e.g. its default), or lower "
        f"block_size"
    )
    with pytest.raises(DataPrepError, match=r"has \d+ tokens but only 3 windows of 25000 \+ 1 tokens in its shards, 4"):
        TokenLoader(prepared_books, "train", 25_000, 4)


@pytest.mark.parametrize("folder", ["missing", "books", "empty"])
def test_missing_dataset_prints_the_prepare_command_for_the_users_books(tmp_path, folder):
    """A mistyped --data-dir, the folder of the books themselves, a folder to prepare into: the command prepares the
    user's books (it named the embedded corpus, which trained on under the name of the user's data)."""
    data = tmp_path / folder
    if folder != "missing":
        data.mkdir()
    if folder == "books":
        (data / "emma.txt").write_text("Emma Woodhouse, handsome, clever, and rich.")
    with pytest.raises(DataPrepError) as err:
        TokenLoader(data, "train", BLOCK, 8)
    said, command = str(err.value).split("\n")
    to_yours = "prepare your books into it (--source default: the embedded corpus of Shakespeare and Milton) with:"
    expected = {
        "missing": f"no prepared dataset in {data}: no such folder (check --data-dir); {to_yours}",
        "books": f"{data} holds .txt files, not a prepared dataset (manifest.json is missing): --data-dir takes the "
        "folder prepare writes; prepare these books with:",
        "empty": f"no prepared dataset in {data} (manifest.json is missing); {to_yours}",
    }
    assert said == expected[folder]
    source, out = (f"files:{data}", f"{data}-prepared") if folder == "books" else ("files:PATH/TO/BOOKS", data)
    assert command == f"  python -m data_prep.prepare --source {source} --out {out}"


def test_the_pg19_folder_missing_prints_the_command_that_prepares_pg19(tmp_path, monkeypatch):
    """A PG-19 run config (data_dir: data/pg19) launched before its data: the command prepares PG-19 there (it named
    --source files:PATH/TO/BOOKS, the user's own books)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataPrepError) as err:
        TokenLoader("data/pg19", "train", BLOCK, 8)
    assert str(err.value) == (
        "no prepared dataset in data/pg19: no such folder; prepare PG-19 into it (~5.8 GB of shards) with:\n"
        "  python -m data_prep.prepare --source pg19 --out data/pg19"
    )


def test_a_data_dir_that_is_a_file_is_said_to_be_one(prepared_books, tmp_path):
    """--data-dir at a book or at the manifest itself: it was told to prepare books into that path, which prepare
    refuses."""
    book = tmp_path / "emma.txt"
    book.write_text("Emma Woodhouse, handsome, clever, and rich.\n")
    for path in (prepared_books / "manifest.json", prepared_books / "train_000.bin", book):
        with pytest.raises(DataPrepError) as err:
            TokenLoader(path, "train", BLOCK, 8)
        folder = "" if path == book else f": {prepared_books}"  # the dataset's own
        assert str(err.value) == (
            f"{path} is a file, not a prepared dataset's folder: --data-dir takes the folder prepare writes{folder}"
        )


@pytest.mark.parametrize("folder", ["library", "pg19", "parquet", "other", "run"])
def test_a_data_dir_holding_files_is_never_offered_as_prepares_out(tmp_path, monkeypatch, folder):
    """--data-dir at a library's tree (its books in subfolders), at a local copy of PG-19 or another dataset's parquet
    files, at any other folder with files in it or at a run's folder: the command printed prepares into a new folder,
    as prepare takes no other (it named the folder itself, and prepare then stopped: 'exists and is not a prepared
    dataset'); a run's samples.txt is not taken for a book."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    data = tmp_path / folder
    if folder == "pg19":
        write_pg19_copy(data)
    elif folder == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        (data / "data").mkdir(parents=True)
        books = [f"Book {i}: it was a dark and stormy night.\n" * 50 for i in range(4)]
        pq.write_table(pa.table({"text": books}), data / "data" / "train-00000-of-00001.parquet")
    else:
        (data / "austen").mkdir(parents=True)
        (data / "notes.md").write_text("Books to read.\n")
    if folder == "run":
        (data / "metrics.jsonl").write_text('{"step": 1, "train_loss": 10.8}\n')
        (data / "samples.txt").write_text("step 1: ROMEO: the the the\n")
    if folder == "library":
        (data / "austen" / "emma.txt").write_text("Emma Woodhouse, handsome, clever, and rich.\n" * 50)
        (data / "austen" / "persuasion.txt").write_text("Sir Walter Elliot, of Kellynch Hall.\n" * 50)
    with pytest.raises(DataPrepError) as err:
        TokenLoader(data, "train", BLOCK, 8)
    if folder == "run":
        assert str(err.value) == (
            f"{data} is a training run's folder, not a prepared dataset (manifest.json is missing): --data-dir takes "
            "the folder prepare writes (e.g. data/default); check --data-dir"
        )
        return
    said, command = str(err.value).split("\n")
    expected = {
        "library": (f"{data} holds .txt files", "these books", f"files:{data}"),
        "pg19": (f"{data} holds a copy of PG-19", "it", f"pg19:{data}"),
        "parquet": (f"{data} holds dataset files", "them", f"hf:{data}"),
        "other": (f"no prepared dataset in {data} (manifest.json is missing), and it holds other files", "", ""),
    }[folder]
    assert said.startswith(expected[0])
    if folder == "other":
        assert said.endswith("so prepare cannot write there: check --data-dir, or prepare your books into another "
                             "folder with:")  # fmt: skip
        assert command == f"  python -m data_prep.prepare --source files:PATH/TO/BOOKS --out {data}-prepared"
        return
    assert said.endswith(f"(manifest.json is missing): --data-dir takes the folder prepare writes; prepare "
                         f"{expected[1]} with:")  # fmt: skip
    assert command == f"  python -m data_prep.prepare --source {expected[2]} --out {data}-prepared"
    assert prepare_main(shlex.split(command)[3:]) == 0  # the command as printed prepares them
    assert load_manifest(f"{data}-prepared", verify="sha256").num_tokens("val") > 0


def test_truncated_or_altered_shard_is_named(prepared_books, tmp_path):
    data = _copy(prepared_books, tmp_path)
    shard = data / "train_001.bin"
    original = shard.read_bytes()
    shard.write_bytes(original[:-2])
    with pytest.raises(DataPrepError, match=r"shard .*train_001.bin is 79998 bytes but the manifest expects 80000"):
        TokenLoader(data, "train", BLOCK, 8)
    with pytest.raises(DataPrepError, match=r"re-run:\n  python -m data_prep.prepare --source default:hamlet"):
        load_manifest(data)
    shard.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    load_manifest(data)  # same size: only the sha256 check can tell
    with pytest.raises(DataPrepError, match=r"shard .*train_001.bin does not match its sha256 .*re-run"):
        load_manifest(data, verify="sha256")
    shard.unlink()
    with pytest.raises(DataPrepError, match=r"train_001.bin is missing"):
        load_manifest(data)


def test_manifest_from_another_tokenizer_is_refused(prepared_books, tmp_path):
    data = _copy(prepared_books, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"].update(name="cl100k_base", sha256="0" * 64)
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataPrepError, match="tokenized with 'cl100k_base'.* but training uses 'gpt2'.*re-run"):
        TokenLoader(data, "train", BLOCK, 8)
    (data / "manifest.json").write_text("{not json")
    with pytest.raises(DataPrepError, match="is not a valid manifest"):
        load_manifest(data)


def test_format_1_dataset_still_loads_and_prepare_migrates_it(prepared_books, tmp_path):
    """Format 1 kept per-document metadata inside manifest.json; its shards are the same bytes."""

    data = _copy(prepared_books, tmp_path)
    documents = list(load_manifest(data).documents())
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["source_key"]
    manifest.update(format_version=1, documents=documents)
    (data / "manifest.json").write_text(json.dumps(manifest))
    (data / "documents.jsonl").unlink()
    old = load_manifest(data, verify="sha256")
    assert list(old.documents()) == documents
    expected = list(islice(TokenLoader(prepared_books, "train", BLOCK, 8), 3))
    assert _same(list(islice(TokenLoader(data, "train", BLOCK, 8), 3)), expected)

    prepare(manifest["source"], data, **manifest["params"])  # not "up to date": rebuilt in format 2
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in prepared_books.iterdir())
    assert all((data / p.name).read_bytes() == p.read_bytes() for p in prepared_books.iterdir())


def test_a_run_reads_the_data_it_started_with_while_prepare_replaces_the_folder(prepared_books, tmp_path):
    """`prepare` into the folder a run is reading (other books: other shards of the same names). The run's loaders
    read the data they were built on: the val set mapped at a resumed run's first eval read the new val_000.bin with
    the old manifest's windows, another val set or (where it was shorter) numpy's ValueError traceback."""
    data = Path(shutil.copytree(prepared_books, tmp_path / "data"))
    val = EvalWindows(data, "val", BLOCK, 64, 8)
    train = TokenLoader(data, "train", BLOCK, 4, seed=1)
    prepare("default:hamlet,macbeth,othello,tempest", data, shard_tokens=40_000, val_fraction=0.1)
    assert load_manifest(data).content_digest != load_manifest(prepared_books).content_digest
    expected_val = EvalWindows(prepared_books, "val", BLOCK, 64, 8)
    assert _same(list(val), list(expected_val))
    assert _windows(train, 3) == _windows(TokenLoader(prepared_books, "train", BLOCK, 4, seed=1), 3)


def test_a_shard_altered_in_place_or_removed_is_one_error_naming_it(prepared_books, tmp_path):
    """Of the right size, so the start-up's size check passes, but holding ids no tokenizer wrote: the embedding's
    IndexError traceback at the first step, before; now the batch that reads it stops with one line. A shard removed
    after that check: numpy's FileNotFoundError, naming neither the fix nor, in its line, the corpus."""
    data = tmp_path / "data"
    shutil.copytree(prepared_books, data)
    shard = sorted(data.glob("train_*.bin"))[1]
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    manifest = load_manifest(data)
    shards = manifest.shards_of("train")
    ds = WindowDataset(manifest, "train", BLOCK)
    first_of_shard1 = (shards[0].num_tokens - 1) // BLOCK
    ds.__getitems__([0, 1])  # the intact shard reads
    (data / shards[2].file).rename(tmp_path / "aside.bin")  # removed after the start-up's check
    redo = f"re-run `{prepare_command(data, manifest.source)}`"
    with pytest.raises(DataPrepError) as err:
        WindowDataset(manifest, "train", BLOCK)  # the files are mapped as it is built: numpy named no fix
    (tmp_path / "aside.bin").rename(data / shards[2].file)
    assert str(err.value) == f"shard {data / shards[2].file} is missing (removed since the run started); {redo}"
    with pytest.raises(DataPrepError) as err:
        ds.__getitems__([0, first_of_shard1 + 2])
    assert str(err.value) == (
        f"shard {shard} holds token id 65535, past the tokenizer's 50257 ids (altered or damaged); {redo}"
    )


def _lowest_free_fd() -> int:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.close(fd)
    return fd


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX open-file limits (ulimit -n)")
def test_shards_past_the_open_files_soft_limit_still_load(prepared_books):
    """Each shard's map holds an open file: a corpus of thousands of shards met the usual soft limit of 1024
    (ulimit -n) with numpy's OSError traceback "Too many open files", though the hard limit allowed them. Here the
    soft limit leaves room for one shard of the three."""
    import resource  # POSIX only

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd() + 2, hard))
    try:
        loader = TokenLoader(prepared_books, "train", BLOCK, 4)
        assert len(loader.dataset.paths) == 3 and next(iter(loader))[0].shape == (4, BLOCK)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX open-file limits (ulimit -n)")
def test_shards_past_the_open_files_hard_limit_are_one_error_saying_what_to_do(prepared_books):
    """Where even the hard limit is too low: one line naming the limit and the two ways out, not numpy's traceback."""
    code = (
        "import os, resource, sys\n"
        "from data_prep import DataPrepError\n"
        "from data_prep.loader import TokenLoader\n"
        "fd = os.open(os.devnull, os.O_RDONLY); os.close(fd)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (fd + 2, fd + 2))\n"
        "try:\n"
        "    TokenLoader(sys.argv[1], 'train', 64, 4)\n"
        "except DataPrepError as err:\n"
        "    print(err)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(prepared_books)], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        rf"the 3 train shards of {re.escape(str(prepared_books))} need an open file each, past the \d+ files this "
        r"process may open in all \(ulimit -n\); raise the open-files limit, or prepare the books again with a "
        r"larger --shard-tokens than 40000 \(fewer, larger shards\)\n",
        done.stdout,
    ), done.stdout


def test_a_data_dir_of_books_given_as_dot_is_prepared_beside_the_folder(tmp_path, monkeypatch):
    """--data-dir . from inside a folder of books: the command said --out .-prepared, a hidden folder among the
    books themselves."""
    books = tmp_path / "library"
    books.mkdir()
    for name in ("emma", "persuasion"):
        (books / f"{name}.txt").write_text(f"{name.title()}: it was a dark and stormy night.\n" * 50)
    monkeypatch.chdir(books)
    with pytest.raises(DataPrepError) as err:
        TokenLoader(".", "train", BLOCK, 8)
    command = str(err.value).split("\n")[1]
    assert command == f"  python -m data_prep.prepare --source files:. --out {books}-prepared"
    assert prepare_main(shlex.split(command)[3:]) == 0  # the command as printed prepares them there
    assert load_manifest(f"{books}-prepared", verify="sha256").num_tokens("val") > 0
