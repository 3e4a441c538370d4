"""Read prepared shards for training: memmapped windows, a resumable loader (the manifest's reader is
data_prep.manifest).

No `datasets` import here on purpose: training machines only need numpy and torch.
"""

from __future__ import annotations

import errno
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from data_prep import DataPrepError
from data_prep.manifest import SPLITS, Manifest, load_manifest, prepare_command


class WindowDataset(Dataset):
    """Non-overlapping (x, y) windows of `block_size` tokens (y = x shifted by one) over shards.

    A window needs block_size + 1 tokens and never crosses a shard boundary, so a shard of n
    tokens holds (n - 1) // block_size windows.
    """

    def __init__(self, manifest: Manifest, split: str, block_size: int) -> None:
        shards = manifest.shards_of(split)
        self.paths = [str(manifest.data_dir / s.file) for s in shards]
        self.split, self.data_dir, self.shard_tokens = split, manifest.data_dir, manifest.params["shard_tokens"]
        self.block_size, self.vocab_size = block_size, manifest.vocab_size
        self.redo = f"re-run `{prepare_command(manifest.data_dir, manifest.source)}`"  # what a damaged shard needs
        counts = [max(0, (s.num_tokens - 1) // block_size) for s in shards]
        self.starts = np.cumsum([0, *counts])  # first window index of each shard
        # Mapped now, as the manifest just read them: a `prepare` into the same folder meanwhile swaps in new files of
        # the same names, which a map opened later (the val split's at a resumed run's first eval) would read with
        # this manifest's window counts (another val set, or a crash where the new shard is shorter).
        self._maps: list[np.memmap] | None = self._open()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([index])
        return x[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole micro-batch in one go (DataLoader prefers this to one __getitem__ per window)."""
        windows = np.stack([self._window(i) for i in indices])
        if windows.max(initial=0) >= self.vocab_size:  # a shard altered in place (its size checks out): no token id
            row = int(np.argmax(windows.max(axis=1) >= self.vocab_size))
            path = self.paths[self._shard(indices[row])]
            raise DataPrepError(
                f"shard {path} holds token id {int(windows[row].max())}, past the tokenizer's {self.vocab_size} ids "
                f"(altered or damaged); {self.redo}"
            )
        batch = torch.from_numpy(windows.astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def _shard(self, index: int) -> int:
        return int(np.searchsorted(self.starts, index, side="right")) - 1

    def _window(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        if self._maps is None:  # a DataLoader worker started by spawn (not fork) maps the files itself
            self._maps = self._open()
        shard = self._shard(index)
        offset = (index - int(self.starts[shard])) * self.block_size
        return self._maps[shard][offset : offset + self.block_size + 1]

    def _open(self) -> list[np.memmap]:
        try:
            return [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
        except FileNotFoundError as err:  # checked by the manifest's reader, gone since
            missing = f"shard {err.filename} is missing (removed since the run started)"
            raise DataPrepError(f"{missing}; {self.redo}") from None
        except OSError as err:
            if err.errno != errno.EMFILE:
                raise
        # Each map keeps its file open: thousands of shards pass the usual soft limit of 1024 (ulimit -n), which any
        # process may raise up to its hard limit, as this one now does (its DataLoader workers inherit it).
        import resource  # POSIX only: Windows has no such limit to meet

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            except ValueError:  # macOS: an unlimited hard limit is no soft one
                pass
            else:
                return self._open()
        raise DataPrepError(
            f"the {len(self.paths)} {self.split} shards of {self.data_dir} need an open file each, past the {soft} "
            f"files this process may open in all (ulimit -n); raise the open-files limit, or prepare the books "
            f"again with a larger --shard-tokens than {self.shard_tokens} (fewer, larger shards)"
        )

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}  # memmaps don't travel to worker processes


def _cut_by_shards(manifest: Manifest, split: str, block_size: int, windows: int, needed: int) -> str | None:
    """Why a split whose tokens hold `needed` windows has only `windows`: its shards are too small (a window never
    crosses a shard's end), and what to do; None when its tokens are too few anyway."""
    tokens = manifest.num_tokens(split)
    if (tokens - 1) // block_size < needed:
        return None
    largest = max(s.num_tokens for s in manifest.shards_of(split))
    return (
        f"split {split!r} of {manifest.data_dir} has {tokens} tokens but only {windows} windows of {block_size} + 1 "
        f"tokens in its shards, {needed} needed: a window never crosses a shard's end, and its shards hold at most "
        f"{largest} tokens each (--shard-tokens {manifest.params['shard_tokens']}); prepare it again with a "
        f"--shard-tokens far above {block_size} (e.g. its default), or lower block_size"
    )


IGNORE_INDEX = -100  # a target the loss skips (PyTorch's cross-entropy default): fills up EvalWindows batches


def spread(count: int, total: int) -> np.ndarray:
    """`count` of the indices 0..total-1 spread evenly, in order: the middle one of each of `count` equal parts
    (all of them when count >= total). Parts at least one index long keep the indices distinct."""
    count = min(count, total)
    return (2 * np.arange(count, dtype=np.int64) + 1) * total // (2 * count)


class EvalWindows:
    """A fixed set of windows spread evenly over a whole split, for a loss that stands for all of it.

    The set depends only on the data, block_size and `count`, never on the number of processes or the batch
    shape, so losses compare across evals, runs and launches. Rank r evaluates every world_size-th window of it,
    and every rank yields the same number of micro-batches of exactly micro_batch_size rows: sharded engines
    need each rank's forward passes, and one shape keeps compiled graphs. The rows past a rank's windows repeat
    the first window with all targets IGNORE_INDEX, so they add nothing to the loss.
    """

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        block_size: int,
        count: int,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if min(block_size, count, micro_batch_size, world_size) < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need block_size, count, micro_batch_size >= 1 and 0 <= rank < world_size, got "
                f"{block_size=}, {count=}, {micro_batch_size=}, {rank=}, {world_size=}"
            )
        manifest = load_manifest(data_dir)
        self.dataset = WindowDataset(manifest, split, block_size)
        if len(self.dataset) == 0:
            raise DataPrepError(
                _cut_by_shards(manifest, split, block_size, 0, 1)
                or f"split {split!r} of {data_dir} has {manifest.num_tokens(split)} tokens, fewer than one window of "
                f"{block_size} + 1; prepare more books (or a larger --val-fraction for val), or lower block_size"
            )
        self.micro_batch_size = micro_batch_size
        self.indices = spread(count, len(self.dataset))  # the whole set, in split order
        self.mine = self.indices[rank::world_size]
        per_rank = -(-len(self.indices) // world_size)  # the most windows any rank has
        self.num_batches = -(-per_rank // micro_batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        size = self.micro_batch_size
        for start in range(0, self.num_batches * size, size):
            rows = self.mine[start : start + size].tolist()
            filler = size - len(rows)
            x, y = self.dataset.__getitems__(rows + [int(self.indices[0])] * filler)
            y[len(rows) :] = IGNORE_INDEX
            yield x, y


def _as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # WindowDataset.__getitems__ already returns the stacked micro-batch


class _RankBatches:
    """Batch sampler: one rank's window indices from (epoch, offset) onwards.

    Each epoch has one order of all windows (a permutation by seed and epoch). A step takes the next world_size *
    micro_batch_size windows of it, rank r the r-th micro_batch_size of them, so the windows any sequence of steps
    consumed is a prefix of the order, whatever the number of processes and micro-batch size of each step: `offset`
    (windows of the order consumed) is the whole position. An epoch ends where a step no longer fits.

    It must not refer back to the TokenLoader: DataLoader workers caught in such a reference
    cycle only shut down after a 5 s timeout each.
    """

    def __init__(
        self,
        num_windows: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        self.num_windows, self.micro_batch_size, self.seed = num_windows, micro_batch_size, seed
        self.rank, self.per_step = rank, world_size * micro_batch_size
        self.epoch = self.offset = 0  # where the next iteration begins; set by the TokenLoader

    def order(self, epoch: int) -> np.ndarray:
        """All window indices in `epoch`'s order."""
        key = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        return torch.randperm(self.num_windows, generator=generator).numpy()

    def fits(self, offset: int) -> bool:
        """Whether one more step fits in the epoch after `offset` windows of it."""
        return offset + self.per_step <= self.num_windows

    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = self.epoch, self.offset
        mine = self.rank * self.micro_batch_size
        while True:
            order = self.order(epoch)
            while self.fits(offset):  # one list per micro-batch, never a list per batch up front
                yield order[offset + mine : offset + mine + self.micro_batch_size].tolist()
                offset += self.per_step
            epoch, offset = epoch + 1, 0


class TokenLoader:
    """Micro-batches of (x, y) int64 windows for one rank, resumable at the exact window, also with another number
    of processes or micro-batch size.

    Each epoch one global permutation (by seed and epoch) of all windows is cut into steps of
    world_size * micro_batch_size windows; rank r takes the r-th micro-batch of every step and
    the incomplete last step is dropped, so all ranks get the same number of batches.
    The position is global: the tokens of the epoch's order that all ranks together consumed. Resumed with
    another world size or micro-batch size, the ranks go on from there, so no window is seen twice or skipped
    (only the epoch's dropped tail, less than one step, depends on the step's size).
    It is one endless stream: an epoch ends where a step no longer fits, and the next one starts.
    A state of other data (other tokens in the shards: books added, a subset) does not load, unless
    `restart_on_other_data`: then the loader starts at this data's beginning and `left_behind` holds that state.
    Only one iterator may be in use at a time. Do not pass it through `accelerator.prepare`:
    it already shards across ranks.
    """

    def __init__(
        self,
        data_dir: str | Path,
        split: str,
        block_size: int,
        micro_batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        restart_on_other_data: bool = False,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if block_size < 1 or micro_batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need block_size >= 1, micro_batch_size >= 1 and 0 <= rank < world_size, got "
                f"{block_size=}, {micro_batch_size=}, {rank=}, {world_size=}"
            )
        self.manifest = load_manifest(data_dir)
        self.split, self.block_size, self.micro_batch_size = split, block_size, micro_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.restart_on_other_data = restart_on_other_data
        self.left_behind: dict[str, Any] | None = None  # the state of other data that load_state_dict set aside
        shards = self.manifest.shards_of(split)
        self.dataset = WindowDataset(self.manifest, split, block_size)
        per_step = world_size * micro_batch_size
        if len(self.dataset) < per_step:
            raise DataPrepError(
                _cut_by_shards(self.manifest, split, block_size, len(self.dataset), per_step)
                or f"split {split!r} of {data_dir} has {len(self.dataset)} windows of {block_size} tokens "
                f"({self.manifest.num_tokens(split)} tokens in {len(shards)} shards), but one step of "
                f"world_size * micro_batch_size = {per_step} windows needs at least {per_step * block_size + 1} "
                f"tokens in it; prepare more books (or a larger --val-fraction for val), or lower "
                f"block_size / micro_batch_size / the number of processes"
            )
        self._sampler = _RankBatches(len(self.dataset), micro_batch_size, rank, world_size, seed)
        self.epoch = 0
        self._offset = 0  # windows of the epoch's order consumed by all ranks' delivered (not prefetched) batches
        self._loader = DataLoader(
            self.dataset,
            batch_sampler=self._sampler,
            collate_fn=_as_batch,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
        )

    def __len__(self) -> int:
        """Micro-batches per epoch and rank (from the epoch's start)."""
        return len(self.dataset) // self._sampler.per_step

    @property
    def tokens(self) -> int:
        """The position: tokens of this epoch's order consumed by all ranks together."""
        return self._offset * self.block_size

    @property
    def epochs_read(self) -> float:
        """The epochs of this data read so far (after a resume: before it), the current one by its share of windows."""
        return self.epoch + self._offset / len(self.dataset)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._next_epoch_if_done()
        self._sampler.epoch, self._sampler.offset = self.epoch, self._offset
        for batch in self._loader:
            self._offset += self._sampler.per_step
            self._next_epoch_if_done()
            yield batch

    def _next_epoch_if_done(self) -> None:
        """The position moves to the next epoch as soon as no step fits in this one."""
        if not self._sampler.fits(self._offset):
            self.epoch, self._offset = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The global position and what it is a position in; world_size and micro_batch_size only say who
        consumed it."""
        return {
            "epoch": self.epoch,
            "tokens": self.tokens,
            "seed": self.seed,
            "block_size": self.block_size,
            "num_windows": len(self.dataset),
            "data_digest": self.manifest.content_digest,
            "world_size": self.world_size,
            "micro_batch_size": self.micro_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume right after the last windows delivered on all ranks when `state` was taken, in the same epoch
        order; the number of processes and the micro-batch size may differ."""
        if "tokens" not in state:  # written before positions were global: per-rank batches of a fixed shape
            windows = state["batches_delivered"] * state["world_size"] * state["micro_batch_size"]
            state = {**state, "tokens": windows * state["block_size"]}
        mine = self.state_dict()
        keys = ("seed", "block_size", "num_windows")  # older checkpoints' "shuffle" is True: every loader shuffled
        diffs = [f"{k}={state.get(k)!r} (now {mine[k]!r})" for k in keys if state.get(k) != mine[k]]
        saved = state.get("data_digest")  # absent from checkpoints written before it was kept
        # other tokens (books added or changed, as many windows or not); num_windows tells checkpoints without a digest
        key, now = ("data_digest", mine["data_digest"]) if saved is not None else ("num_windows", len(self.dataset))
        other_data = state.get(key) != now
        if other_data and state.get("block_size") == self.block_size and self.restart_on_other_data:
            self.left_behind = state  # this data is read from its start: the position was one in other tokens
            return
        if saved is not None and other_data:
            diffs.append(
                f"data {saved[:12]} (now {mine['data_digest'][:12]}: other tokens in {self.manifest.data_dir})"
            )
        if diffs:
            # said where it applies: a changed seed or block size on the same data has no use for it
            go_on = (
                "to train this run on (its weights, optimizer, schedule and step kept) from the start of the new data, "
                "add --on-new-data continue; else "
                if other_data
                else ""
            )
            raise DataPrepError(
                f"cannot resume the {self.split} loader: the checkpoint has {', '.join(diffs)}; {go_on}resume with "
                f"the same data, seed and block size, or start afresh: --resume never sets this run aside (or give "
                "another --out-dir)"
            )
        windows, rest = divmod(int(state["tokens"]), self.block_size)
        if rest or not 0 <= windows <= len(self.dataset):
            raise DataPrepError(
                f"checkpoint position {state['tokens']} tokens is not a whole number of windows of "
                f"{self.block_size} tokens in 0..{len(self.dataset)}"
            )
        self.epoch, self._offset = int(state["epoch"]), windows
