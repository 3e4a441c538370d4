"""Checkpoint folders: `checkpoints/step-00001000/`, written under a temporary name and renamed into place.

A folder without the `.tmp` suffix was complete when it was renamed; its manifest.json (every file's size and
sha256) tells whether it still is, so `--resume auto` skips one damaged since (a truncated copy, a lost file).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.checkpointing import load_custom_state
from accelerate.utils import DistributedType
from safetensors import safe_open

from modeling.disk import DiskFull, atomic_write_bytes, disk_full_line, is_disk_full, swap_in, umask_modes
from modeling.runs import (
    CONFIG_FILE,
    EXPORT_DIR,
    MANIFEST,
    METRICS_FILE,
    SAMPLES_FILE,
    checkpoint_dir,
    checkpoint_engine,
    checkpoint_step,
    checkpoint_weights,
    file_sha256,
    is_checkpoint_dir,
    list_checkpoints,
    manifest_damage,
    merge_shards,
    named,
    run_of_checkpoint,
    zero_layout,
)
from training.config import ConfigError, TrainConfig


def _not_the_tied_head(record: logging.LogRecord) -> bool:
    """safetensors stores a shared tensor once, so accelerate drops GPT's lm_head.weight (tied to wte.weight) and
    warns on every save; loading wte.weight restores both (the resume tests check it exactly), so that one
    warning is noise. Any other shared tensor still warns."""
    return "Removed shared tensor {'lm_head.weight'} while saving" not in record.getMessage()


logging.getLogger("accelerate.utils.other").addFilter(_not_the_tied_head)


@dataclass
class TrainProgress:
    """Counters saved with every checkpoint (registered with `accelerator.register_for_checkpointing`)."""

    step: int = 0  # optimizer steps taken
    tokens_seen: int = 0  # training tokens consumed over all ranks
    # the tokens of the steps applied (a skipped step's are in tokens_seen only): what --max-tokens counts, as the
    # steps do; None from a checkpoint written before it was kept (the run takes its steps at this launch's batch)
    tokens_applied: int | None = 0
    total_steps: int = 0  # the steps a time budget decided on (0: none decided; the config's count)
    train_seconds: float = 0.0  # a time budget's train-step time spent (its last decision's, then each step's)
    # The batch shape of the launch that took the steps: processes, micro-batch size, accumulation (0: not known,
    # a checkpoint written before resumes could change it). A resume may change it (see `reshape`).
    world_size: int = 0
    micro_batch_size: int = 0
    grad_accum: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.tokens_applied = state.get("tokens_applied")
        self.total_steps = state.get("total_steps", 0)  # absent from checkpoints written before time budgets
        self.train_seconds = state.get("train_seconds", 0.0)  # absent from those written before re-timing
        self.world_size = state.get("world_size", 0)  # absent from those written before elastic resumes
        self.micro_batch_size = state.get("micro_batch_size", 0)
        self.grad_accum = state.get("grad_accum", 0)

    def reshape(self, world_size: int, micro_batch_size: int, grad_accum: int) -> str | None:
        """Take this launch's batch shape; after a resume, what changed from the checkpoint's (None: nothing, or
        the checkpoint does not say)."""
        saved = (self.world_size, self.micro_batch_size, self.grad_accum)
        now = (world_size, micro_batch_size, grad_accum)
        self.world_size, self.micro_batch_size, self.grad_accum = now
        if 0 in saved or saved == now:
            return None
        names = ("world size", "micro-batch", "accumulation")
        return ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(names, saved, now))


def ensure_writable(run_dir: str | Path) -> None:
    """Fail before training, not at the first checkpoint, when the run folder can't be written, or is a checkpoint
    (whose config.yaml would make it a run to set aside, its files moved out of it)."""
    run_dir = Path(run_dir)
    run = run_of_checkpoint(run_dir)
    if run is not None:
        raise NotADirectoryError(
            f"out_dir {run_dir} is a checkpoint of the run in {run}, not a run folder: to continue from it, give it as "
            f"--resume, with --out-dir {run} or a new folder"
        )
    run = named(run_dir).parent
    if named(run_dir).name == EXPORT_DIR and (run / CONFIG_FILE).is_file():  # a run there would mix into its export
        raise NotADirectoryError(
            f"out_dir {run_dir} is the export folder of the run in {run}, not a run folder: to continue that run, give "
            f"--out-dir {run}; to train from the export's weights, give it as --init-from, with a new --out-dir"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):  # a unique name: every rank probes the same folder at once
            pass
    except OSError as err:
        said = "is a file" if run_dir.is_file() else f"is not writable ({err.strerror})"
        raise NotADirectoryError(f"out_dir {run_dir} {said}; choose another --out-dir") from None


DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index: which bytes of which shard hold each tensor
PREVIOUS = "previous-"  # run folders' subfolders holding what a fresh start or a resume set aside
_LOCKS = (".run.lock", ".run.lock.json")  # training.runlock's: the live run's, never set aside


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """Every file's size and hash, written last into a checkpoint (all ranks' files are complete by then)."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in _files(folder)}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder (None: intact): a file missing, of another size or hash than its
    manifest says. Folders saved before manifests existed get a load test of the files a resume reads: each JSON
    parses, safetensors' header and tensors fit the file, each torch.save zip (.bin, .pkl, .pt) has its directory,
    and each torch.distributed.checkpoint folder's shards (FSDP2's .distcp) hold the bytes its .metadata places
    there."""
    if not folder.is_dir():
        return "it does not exist"
    if (folder / MANIFEST).is_file():
        return manifest_damage(folder)
    for path in _files(folder):
        name = str(path.relative_to(folder))
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                safe_open(str(path), "pt")  # checks that the header's tensors cover the file exactly
            elif path.suffix in (".bin", ".pkl", ".pt"):
                zipfile.ZipFile(path).close()
            elif path.name == DCP_METADATA:
                short = _short_dcp_shard(path.parent)
                if short:
                    return f"{path.parent.relative_to(folder)}/{short}"
        except Exception as err:  # OSError, ValueError, zipfile's BadZipFile, safetensors' SafetensorError, pickle's
            return f"{name} does not load ({type(err).__name__}: {str(err).partition(chr(10))[0]})"
    return None


def _short_dcp_shard(folder: Path) -> str | None:
    """A torch.distributed.checkpoint folder's first shard that is missing or ends before the tensors its
    .metadata places in it ("NAME is missing", "NAME is N bytes, its tensors end at byte M"); None if none."""
    from torch.distributed.checkpoint import FileSystemReader

    ends: dict[str, int] = {}
    for info in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for shard, end in sorted(ends.items()):
        path = folder / shard
        if not path.is_file():
            return f"{shard} is missing"
        if path.stat().st_size < end:
            return f"{shard} is {path.stat().st_size:,} bytes, its tensors end at byte {end:,}"
    return None


LAUNCH_CHOICES = ("resume", "on_new_data")  # config fields that are each launch's choice, not the run's


def _saved_config(folder: Path) -> tuple[dict, TrainConfig] | None:
    """The run config saved in `folder` (a checkpoint or a run folder): its keys as saved, and the TrainConfig they
    make; None where none was saved. CheckpointError where it does not read."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return None
    now = {f.name for f in dataclasses.fields(TrainConfig)}
    what = f"{path}, the run config it was saved with,"
    mend = "restore it from a copy, or start afresh with --resume never"
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{what} does not read as YAML ({' '.join(str(err).split())}); {mend}") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{what} is not a mapping of key: value; {mend}")
    # a launch's choices are not the run's (and older runs wrote '' for resume, which TrainConfig refuses now)
    saved = {k: v for k, v in values.items() if k in now and k not in LAUNCH_CHOICES}
    try:
        return saved, TrainConfig(**saved)
    except (ConfigError, TypeError) as err:
        raise CheckpointError(f"{what[:-1]}: {err}; {mend}") from None


SHAPE_FLAGS = "--preset/--n-layer/--n-head/--n-embd/--block-size/--init-from"  # what sets a run's model shape


def _shape(cfg: TrainConfig) -> str:
    m = cfg.model_config()
    return (f"{cfg.init_from or cfg.preset} (n_layer {m.n_layer}, n_head {m.n_head}, n_embd {m.n_embd}, "
            f"block_size {m.block_size}, vocab_size {m.vocab_size}, bias {m.bias})")  # fmt: skip


def compare_resume_config(cfg: TrainConfig, checkpoint: Path, source: str) -> str | None:
    """Before anything is loaded: stop (ConfigError, its message starting with `source`, how the user named the
    checkpoint) when the checkpoint holds another model shape or another optimizer's state; else one line listing how
    this launch's config differs from the checkpoint's (None when it doesn't, or nothing says).

    The checkpoint's config.yaml is the launch that wrote it; older checkpoints have only their run folder's."""
    found = next((c for c in map(_saved_config, (checkpoint, checkpoint.parent.parent)) if c is not None), None)
    if found is None:
        return None
    (saved, theirs), now = found, dataclasses.asdict(cfg)
    afresh = "start afresh there with --resume never"
    if _holds_a_run(Path(cfg.out_dir)):
        afresh += f" (the run is moved into {PREVIOUS}<time>/ first)"
    if _shape(theirs) != _shape(cfg):
        raise ConfigError(
            f"{source}: the checkpoint is a {_shape(theirs)} model, this run's is {_shape(cfg)}; resume with the "
            f"checkpoint's {SHAPE_FLAGS}, {afresh}, or choose another --out-dir"
        )
    if theirs.optimizer != cfg.optimizer:  # the saved optimizer state is the other optimizer's
        if "optimizer" in cfg.explicit or cfg.optimizer == "muon":
            asks, resume = f"this run asks for --optimizer {cfg.optimizer}", f"--optimizer {theirs.optimizer}"
        else:  # the default Muon, which this launch's sharding engine turned into AdamW (loop.optimizer_for_engine)
            asks = "this launch's engine (FSDP or DeepSpeed) shards each matrix and so trains adamw"
            resume = "a launch YAML of DDP or one process (Muon needs whole matrices)"
        raise ConfigError(
            f"{source}: the checkpoint holds {theirs.optimizer} state, {asks}; resume with {resume}, {afresh}, or "
            "choose another --out-dir (--init-from its export keeps the weights)"
        )
    # the batch shape's change is said after the load, with accumulation and world size (TrainProgress.reshape);
    # a decay_fraction that decay_steps overrides is not read
    unread = {"micro_batch_size", *(("decay_fraction",) if cfg.decay_steps else ())}
    # a field newer than the checkpoint's config.yaml: the run trained with its default (`theirs` holds it)
    was = {**{k: getattr(theirs, k) for k in now if k not in LAUNCH_CHOICES}, **saved}
    changed = [f"{k} {v!r} -> {now[k]!r}" for k, v in was.items() if v != now[k] and k not in unread]
    return f"resuming with a changed config (checkpoint -> now): {', '.join(changed)}" if changed else None


def plan_resume(cfg: TrainConfig) -> tuple[Path | None, list[str]]:
    """The checkpoint this launch continues from (None: it starts afresh) and the lines that say so, decided before
    anything is built, loaded or written. setup() runs it on the main process and hands the plan, or the error, to
    every rank (training.distributed.decided_on_main): the checkpoint is read and hashed once, not once per rank.

    never: afresh. auto: the newest intact checkpoint of out_dir, each damaged newer one named in a warning line;
    none at all: afresh, unless out_dir's config.yaml is another model's; all damaged: stop. PATH: that checkpoint,
    which must be intact. A checkpoint of another model shape or optimizer stops (compare_resume_config)."""
    run_dir = Path(cfg.out_dir)
    if cfg.resume == "never":
        return None, []
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        if not (path.is_dir() and is_checkpoint_dir(path)):
            # the checkpoints of the run folder given, its checkpoints/ folder or one gone from it (pruned, or a
            # step mistyped), else of out_dir
            given = next((p for p in (path, path.parent, path.parent.parent) if (p / "checkpoints").is_dir()), None)
            lower = cfg.resume.lower()
            word = f" (the words are lowercase: {lower})" if lower in ("auto", "never") else ""
            what = "not a checkpoint folder" if path.exists() else "no such folder"
            raise FileNotFoundError(
                f"--resume {cfg.resume}: {what} (expected .../checkpoints/step-NNNNNNNN, or auto or "
                f"never){word}; complete ones in {given or run_dir}: "
                f"{[str(p) for p in list_checkpoints(given or run_dir)] or 'none'}"
            )
        damage = checkpoint_damage(path)
        if damage:
            others = [p.name for p in list_checkpoints(path.parent.parent) if p != path]
            raise CheckpointError(
                f"--resume {cfg.resume}: the checkpoint is damaged ({damage}); resume from another one of "
                f"{path.parent} ({', '.join(others) or 'none'}), or --resume auto for its newest intact one"
            )
        change = compare_resume_config(cfg, path, f"--resume {cfg.resume}")
        return path, [change] if change else []
    damaged = []
    for checkpoint in reversed(list_checkpoints(run_dir)):
        damage = checkpoint_damage(checkpoint)
        if damage is None:
            notes = [f"warning: checkpoint {c} is damaged ({d}); skipping it" for c, d in damaged]
            change = compare_resume_config(cfg, checkpoint, f"out_dir {run_dir} holds a run ({checkpoint.name})")
            return checkpoint, [*notes, change] if change else notes
        damaged.append((checkpoint, damage))
    if damaged:
        listing = "; ".join(f"{c} is damaged ({d})" for c, d in damaged)
        raise CheckpointError(
            f"out_dir {run_dir} has no intact checkpoint ({listing}); restore one, or start afresh with --resume "
            f"never (the run is moved into {run_dir}/{PREVIOUS}<time>/ first)"
        )
    found = _saved_config(run_dir)
    if found is not None and _shape(theirs := found[1]) != _shape(cfg):
        raise ConfigError(
            f"out_dir {run_dir} holds a run of a {_shape(theirs)} model, this run's is {_shape(cfg)}; continue it with "
            f"its {SHAPE_FLAGS}, start afresh there with --resume never (the run is moved into "
            f"{run_dir}/{PREVIOUS}<time>/ first), or choose another --out-dir"
        )
    return None, []


def set_aside(run_dir: Path, step: int, resumed_from: Path | None, data_dir: Path | None = None) -> str | None:
    """Keep the run folder to one run before this launch writes to it, continuing after optimizer step `step` from
    checkpoint `resumed_from` (None: afresh); the main process calls it once the launch can no longer fail on its
    input. One line saying what it did (None: nothing to do).

    Afresh in a folder holding a run, or resumed from another folder's checkpoint: all of the folder's run (config,
    metrics, samples, checkpoints, export) moves into previous-<time>/. Resuming from its own checkpoint:
    checkpoints after `step` (a run resumed from an older checkpoint, damaged ones) move there, so neither
    auto-resume nor pruning ever prefers them; metrics rows logged after `step` (by a launch that stopped before
    saving again) are dropped, as the resumed run logs those steps anew. The run's data_dir, where it lies inside the
    folder, stays: it is this launch's input, not the replaced run's output. Resumed from another folder's
    checkpoint, the folder's metrics.jsonl then starts with that run's rows up to `step` (_carry_metrics)."""
    run_dir, resumed_step = Path(run_dir), step
    step, moved = _to_set_aside(run_dir, step, resumed_from, data_dir)
    lines = []
    metrics, rows = run_dir / METRICS_FILE, []
    if step and metrics.is_file():  # its rows after `step` go: read where a run continues, not where it starts
        rows = _lines(metrics)
    steps = [_row_step(row) for row in rows]
    # rows that are not JSON (a cut last row, a kill's, is simply dropped): the file as it was goes aside, kept
    garbled = any(s is None and row.endswith("\n") for row, s in zip(rows, steps))
    if garbled:
        moved.append(metrics)
    if moved:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        previous, n = run_dir / f"{PREVIOUS}{stamp}", 1
        while previous.exists():  # two set-asides in one second
            n += 1
            previous = run_dir / f"{PREVIOUS}{stamp}-{n}"
        for path in sorted(moved):
            target = previous / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
        what = ", ".join(sorted(str(p.relative_to(run_dir)) for p in moved))
        why = f"saved after step {step}, where this run continues" if step else "the run this one replaces"
        if garbled:
            why += f"; {METRICS_FILE} holds rows that are not JSON, so its readable rows go on in a new one"
        lines.append(f"moved {what} into {previous} ({why})")
    if rows:
        kept = [row for row, s in zip(rows, steps) if s is not None and s <= step]
        if len(kept) < len(rows):
            said = f"dropped the {len(rows) - len(kept)} rows of {metrics} after step {step} (logged again now"
            if moved and not garbled:  # the checkpoints of those steps went aside: their rows go with them, whole
                shutil.copy2(metrics, previous / METRICS_FILE)
                said += f"; the file as it was is in {previous}"
            atomic_write_bytes(metrics, "".join(kept).encode())  # a kill leaves the old file or the new, never half
            lines.append(f"{said})")
    if step:
        lines.append(_cut_samples(run_dir / SAMPLES_FILE, step, previous if moved else None))
    if resumed_from is not None and not _in_run(resumed_from, run_dir):
        # a checkpoint in another run's checkpoints/ (not one copied elsewhere, whose parents are no run), as named
        # (that checkpoints/ may be linked to another disk) or as a link to it resolves
        given = Path(resumed_from)
        origin = run_of_checkpoint(given) or run_of_checkpoint(given.resolve())
        if origin is not None:
            lines.append(_carry_metrics(origin, run_dir, resumed_step))
    return "; ".join(line for line in lines if line) or None


def _lines(path: Path) -> list[str]:
    """A run file's lines, each with its newline (a cut last line has none); bytes that are not UTF-8 (a kill mid-way
    through a character) read as U+FFFD, so the file's other lines still read."""
    return path.read_bytes().decode("utf-8", "replace").splitlines(keepends=True)


def _cut_samples(samples: Path, step: int, previous: Path | None) -> str | None:
    """Keep samples.txt's samples of the steps up to `step`, where a run resumed from its checkpoint of `step`
    continues: the later ones come anew (a kill after them would repeat them), and fit() writes that step's own where
    it is missing (a kill between the save and the sample: `sampled`). `previous`: where the file as it was goes."""
    if not samples.is_file():
        return None
    lines = _lines(samples)
    cut = next((i for i, line in enumerate(lines) if (s := _sample_step(line)) is not None and s > step), None)
    if cut is None:
        return None
    said = f"dropped the {sum(_sample_step(line) is not None for line in lines[cut:])} samples of {samples} after step "
    said += f"{step} (written again as the run gets there"
    if previous is not None:
        shutil.copy2(samples, previous / SAMPLES_FILE)
        said += f"; the file as it was is in {previous}"
    atomic_write_bytes(samples, "".join(lines[:cut]).encode())
    return f"{said})"


def sample_header(step: int) -> str:
    """The line above each sample in samples.txt (training.loop.write_sample), which _sample_step reads back."""
    return f"--- step {step} ---\n"


_SAMPLE_HEADER = re.compile(r"--- step (\d+) ---\n?")


def sampled(run_dir: Path, step: int) -> bool:
    """Whether the run folder's samples.txt holds a sample of `step`."""
    samples = Path(run_dir) / SAMPLES_FILE
    if not samples.is_file():
        return False
    return any(_sample_step(line) == step for line in _lines(samples))


def _sample_step(line: str) -> int | None:
    """The step of a samples.txt header line (sample_header's); None for a line of a sample's text."""
    return int(found[1]) if (found := _SAMPLE_HEADER.fullmatch(line)) else None


def _carry_metrics(origin: Path, run_dir: Path, step: int) -> str | None:
    """A run continued from another folder's checkpoint (--resume PATH --out-dir NEW, e.g. one of several anneals of
    one stable run) starts its metrics.jsonl with that run's rows up to `step`, as a copy of the folder would: the
    model card names the data, launches and losses of every step its weights took, not only this folder's."""
    source = origin / METRICS_FILE
    if not source.is_file():
        return None
    rows = _lines(source)
    kept = [row for row in rows if (s := _row_step(row)) is not None and s <= step]
    if not kept:
        return None
    atomic_write_bytes(run_dir / METRICS_FILE, "".join(kept).encode())
    return f"copied the {len(kept)} rows of {source} up to step {step} (the run this one continues)"


def _to_set_aside(run_dir: Path, step: int, resumed_from: Path | None, data_dir: Path | None) -> tuple[int, list[Path]]:
    """set_aside's step (0 where this folder's run, if any, is not the one continued) and the paths it moves."""
    if resumed_from is None or not _in_run(resumed_from, run_dir):
        step = 0
    if step:
        return step, [c for c in list_checkpoints(run_dir) if checkpoint_step(c) > step]  # .tmp: cleared
    if not _holds_a_run(run_dir):
        return 0, []
    inputs = {*Path(data_dir).resolve().parents, Path(data_dir).resolve()} if data_dir else set()
    moved = [
        p
        for p in run_dir.iterdir()
        if p.name not in _LOCKS and not p.name.startswith(PREVIOUS) and p.resolve() not in inputs
    ]
    return 0, moved


def _in_run(checkpoint: Path, run_dir: Path) -> bool:
    """Whether `checkpoint` is one of run_dir's own, however either is named: relative, or through links (run_dir's,
    or a checkpoints/ linked to a bigger disk, whose checkpoints lie in no run folder once resolved)."""
    return Path(checkpoint).resolve().parent == (Path(run_dir) / "checkpoints").resolve()


def _holds_a_run(run_dir: Path) -> bool:
    """Whether a run wrote into run_dir (its config, metrics or checkpoints), which a fresh start sets aside."""
    return any((run_dir / name).exists() for name in (CONFIG_FILE, METRICS_FILE, "checkpoints"))


def outputs_in_the_way(
    run_dir: Path, step: int, resumed_from: Path | None, data_dir: Path | None, files: list[str], folders: list[str]
) -> list[str]:
    """What this launch would find in the way of its outputs once set_aside has run: a folder where it writes one of
    `files` (samples.txt, loss.png, ...), a file where it writes one of `folders` (export/). Found when they are
    written, they stopped the run after its training; the start-up asks this first."""
    moved = set(_to_set_aside(run_dir, step, resumed_from, data_dir)[1])
    wrong = [(run_dir / n, "a folder where this run writes a file") for n in files if (run_dir / n).is_dir()]
    wrong += [
        (run_dir / n, "a file where this run writes a folder")
        for n in folders
        if (run_dir / n).exists() and not (run_dir / n).is_dir()
    ]
    return [f"{path} is {what}" for path, what in wrong if path not in moved]


def _row_step(row: str) -> int | None:
    """A metrics.jsonl row's step (0 where it has none: a launch's rows), None where the row is not a whole JSON object
    (cut short by a kill, or garbled)."""
    if not row.endswith("}\n"):
        return None
    try:
        parsed = json.loads(row)
    except ValueError:
        return None
    step = (parsed.get("step") or 0) if isinstance(parsed, dict) else None
    return step if isinstance(step, int) else None


class CheckpointError(RuntimeError):
    """No checkpoint can be resumed: the one asked for, or every one of out_dir, is damaged. (A save that fails for
    want of space raises DiskFull.)"""


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """What one checkpoint takes, before any exists: the weights plus AdamW's two moments of the same size (an
    optimizer with less state, such as Muon's one buffer, takes less)."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _mb(n: int) -> str:
    return f"{n / 2**20:,.0f} MB"


def clear_partial(run_dir: str | Path) -> None:
    """Remove this run's half-written or half-pruned checkpoints (`step-N.tmp`), which hold disk space: the run-folder
    lock guarantees no live run is writing them."""
    for stale in (Path(run_dir) / "checkpoints").glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def room_warning(
    run_dir: str | Path, one_checkpoint: int, keep: int, before_decay: bool = False, best_val: bool = False
) -> str | None:
    """A start-up line when out_dir's filesystem cannot hold the checkpoints still to come: the run keeps `keep`,
    (`best_val`: val evals on) the one with the best val loss, which is an extra one once the val loss stops falling,
    and (`before_decay`: a wsd run with checkpoints on) the one from before its decay, and writes each new one before
    pruning the oldest, so keep + 1 (+ 1 + 1) at once, less those there already (at least one)."""
    more = max(1, keep + 1 + best_val + before_decay - len(list_checkpoints(run_dir)))
    free = shutil.disk_usage(run_dir).free
    if free >= more * one_checkpoint:
        return None
    also = ", the best-val one" * best_val + ", the one from before the wsd decay" * before_decay
    return (
        f"warning: out_dir {run_dir} has {_mb(free)} free, less than {more} more checkpoint{'s' * (more > 1)} need "
        f"({_mb(more * one_checkpoint)}: --keep-checkpoints {keep}{also}, and one more while a save writes); a save "
        "will fail: free space, lower --keep-checkpoints or choose another --out-dir"
    )


def save_checkpoint(accelerator: Accelerator, run_dir: str | Path, step: int, keep: int, meta: dict, need: int) -> Path:
    """`accelerator.save_state` into step-N.tmp, then rename to step-N and prune (see `prune_checkpoints`).

    save_state writes model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl and one
    custom_checkpoint_<i>.pkl per registered object (training progress, data loader position); in place of the
    first two, FSDP2 writes its shards into pytorch_model_fsdp_0/ and optimizer_0/, DeepSpeed its ZeRO partitions
    into pytorch_model/ (modeling.runs.checkpoint_engine tells them apart). We add
    meta.json (step, tokens seen, val loss when evaluated at this step, the digest of the data it was measured on),
    the run's config.yaml (this launch's, which a resume compares with) and manifest.json (every file's size and
    sha256, which a resume checks). A failed save leaves no folder behind; when the disk is what failed (less free
    than `need`, one checkpoint's bytes, or the last one's size) it raises DiskFull saying so.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        clear_partial(run_dir)  # left by a run killed mid-save: they hold the space this save needs
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "meta.json").write_text(json.dumps(meta))
            shutil.copy2(Path(run_dir) / CONFIG_FILE, tmp / CONFIG_FILE)
            umask_modes(tmp)  # model.safetensors: readable as the other files are
            write_manifest(tmp)  # last: it covers every rank's files and ours
    except (KeyboardInterrupt, SystemExit):  # a second Ctrl-C: stop at once (the .tmp is cleared at the next start)
        raise
    except BaseException as err:  # torch reports a full disk as RuntimeError, safetensors and json as OSError, and
        # torch.distributed.checkpoint (FSDP2's shards) wraps either in its CheckpointException, a BaseException
        shutil.rmtree(tmp, ignore_errors=True)
        complete = list_checkpoints(run_dir)
        need = _size(complete[-1]) if complete else need
        if not is_disk_full(err, run_dir, need):
            raise
        free = shutil.disk_usage(Path(run_dir)).free
        todo = (
            f"free space on {{mount}} ({_mb(need)} needed, {_mb(free)} free), lower --keep-checkpoints (a save needs "
            "room for one more than it keeps) or choose another --out-dir, then run the same command again"
        )
        kept = f"complete checkpoints untouched: {', '.join(p.name for p in complete) or 'none'}"
        raise DiskFull(disk_full_line(final, kept, todo)) from err
    if accelerator.is_main_process:
        swap_in(tmp, final)  # re-saving a step: a complete copy exists at every instant
        prune_checkpoints(run_dir, keep)
    accelerator.wait_for_everyone()
    return final


def _meta(checkpoint: Path) -> dict:
    """A checkpoint's meta.json ({} where it has none, or a damaged one: nothing to keep the checkpoint for)."""
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def is_before_decay(checkpoint: Path) -> bool:
    """Whether the checkpoint was saved where a wsd schedule's decay was about to start (meta.json's before_decay):
    where a longer run of the schedule branches off (training.optim.decay_start)."""
    return bool(_meta(checkpoint).get("before_decay"))


def before_decay_checkpoint(run_dir: str | Path) -> Path | None:
    """The run's newest checkpoint from before a wsd decay (is_before_decay), or None."""
    return next((p for p in reversed(list_checkpoints(run_dir)) if is_before_decay(p)), None)


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` (>= 1, so the resumable state survives) checkpoints, the one with the best
    val loss on each data the run evaluated on (one but for a run that went on from other data, whose val split gave
    losses that do not compare with the earlier ones) and the newest one from before a wsd decay (where a longer run
    branches off); returns the kept."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest checkpoint is the run's resumable state), got {keep}")
    found = list_checkpoints(run_dir)
    best: dict[str | None, tuple[float, Path]] = {}  # data digest (None: saved before it was kept) -> best
    branch = None  # the newest from before a decay (found is oldest first)
    for path in found:
        meta = _meta(path)
        if meta.get("val_loss") is not None and meta["val_loss"] < best.get(meta.get("data"), (math.inf,))[0]:
            best[meta.get("data")] = (meta["val_loss"], path)
        if meta.get("before_decay"):
            branch = path
    kept = {*found[-keep:], *(path for _, path in best.values()), branch}
    for old in found:
        if old not in kept:
            # renamed out of the checkpoints first: a kill mid-delete leaves a step-N.tmp, which the next start clears,
            # not a step-N with part of its files that a resume would take for a checkpoint
            doomed = old.with_name(old.name + ".tmp")
            old.rename(doomed)
            shutil.rmtree(doomed)
    return [p for p in found if p in kept]


def _engine(accelerator: Accelerator) -> str:
    """This launch's engine, named as checkpoint_engine names the one that wrote a checkpoint."""
    return {DistributedType.FSDP: "FSDP", DistributedType.DEEPSPEED: "DeepSpeed"}.get(
        accelerator.distributed_type, "DDP"
    )


_ENGINE_NAMES = {"DDP": "one process or DDP", "FSDP": "FSDP2", "DeepSpeed": "DeepSpeed"}
_RESUMES_ON = {
    "DDP": "on one process or with a DDP accelerate config",
    "FSDP": "with an FSDP2 or DDP accelerate config or on one process",
    "DeepSpeed": "with a DeepSpeed accelerate config",
}


def check_zero_resume(checkpoint: Path, zero_stage: int, world_size: int) -> None:
    """DeepSpeed (0.19) loads its partitions only at the ZeRO stages (3, or 1 and 2) and on the process count that
    wrote them; elsewhere it stopped with an AssertionError of no message, or its own exception, on every rank."""
    stage, ranks = zero_layout(checkpoint)
    now = "3" if zero_stage == 3 else "1/2"
    if (stage, ranks) != (now, world_size):
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint was written by DeepSpeed ZeRO-{stage} on {ranks} processes and "
            f"this launch runs ZeRO-{now} on {world_size}; DeepSpeed resumes its partitions only at the stage and "
            "process count that wrote them: launch with those, or start a new run with --init-from on its export "
            "(python -m training.export)"
        )


def load_resume_state(
    accelerator: Accelerator,
    checkpoint: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    registered: list,
) -> str | None:
    """accelerator.load_state(checkpoint), on any number of processes. An FSDP2 checkpoint also resumes on one
    process or DDP: its model and optimizer shards (torch.distributed.checkpoint) are merged whole on each process
    and set with torch's state-dict API, which maps the saved parameter names onto this model (DDP and compile
    wrappers included); the schedule and the `registered` objects (accelerator.register_for_checkpointing's, in
    order) load as accelerate saved them. Other crossings of engines stop with one line. Returns what crossed
    (None: the engine that saved it loads it)."""
    saved, now = checkpoint_engine(checkpoint), _engine(accelerator)
    if saved == now == "DeepSpeed":
        check_zero_resume(checkpoint, accelerator.state.deepspeed_plugin.zero_stage, accelerator.num_processes)
    if saved == now or saved is None:  # None: accelerate names the missing file
        try:
            accelerator.load_state(str(checkpoint))
        except FileNotFoundError as err:  # saved before manifests: its load test checks the files it holds, not these
            others = [p.name for p in list_checkpoints(checkpoint.parent.parent) if p.name != checkpoint.name]
            raise CheckpointError(
                f"checkpoint {checkpoint} is damaged ({Path(err.filename).name} is missing); restore it, resume from "
                f"another checkpoint of {checkpoint.parent} with --resume PATH ({', '.join(others) or 'none'}), or "
                "start afresh with --resume never"
            ) from None
        except RuntimeError as err:  # the model's load_state_dict: a run started with --init-from before it kept
            if "size mismatch" not in str(err):  # the folder's 50,257 ids saved them padded to 50,304
                raise
            mismatch = next(line.strip() for line in str(err).splitlines() if "size mismatch" in line)
            raise ConfigError(
                f"--resume {checkpoint}: its weights do not fit this run's model ({mismatch}); export them (python -m "
                f"training.export {checkpoint.parent.parent} --checkpoint {checkpoint.name}) and start a new run "
                "from the export with --init-from, or start afresh with --resume never"
            ) from None
        return None
    if (saved, now) != ("FSDP", "DDP"):
        raise ConfigError(
            f"--resume {checkpoint}: the checkpoint was written by {_ENGINE_NAMES[saved]} and this launch runs "
            f"{_ENGINE_NAMES[now]}; resume it {_RESUMES_ON[saved]}, or start a new run with --init-from on its export "
            "(python -m training.export)"
        )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, checkpoint_weights(checkpoint)[0], options=whole)
    optimizer_state = merge_shards(checkpoint / "optimizer_0")["optimizer"]
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), optimizer_state, options=whole)
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.bin", weights_only=False))
    for index, obj in enumerate(registered):
        load_custom_state(obj, str(checkpoint), index)
    return "FSDP2 shards -> one whole model per process"
