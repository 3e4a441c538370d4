"""A run folder as training leaves it, read back: its model shape (config.yaml), its checkpoints from any engine,
its metrics. Training writes these files; evals and exports read them.

    runs/<name>/config.yaml                       the run config (TrainConfig fields)
    runs/<name>/metrics.jsonl                     one JSON row per log
    runs/<name>/checkpoints/step-NNNNNNNN/        accelerator.save_state, one of (by engine):
        model.safetensors                           DDP or one process: the whole model
        pytorch_model_fsdp_0/                       FSDP2 sharded state dict (torch.distributed.checkpoint)
        pytorch_model/zero_pp_rank_*_...pt          DeepSpeed ZeRO-2/3: each rank's partition

It lives in modeling, the lowest layer, because reading it needs only the model (GPT, GPTConfig): evals (which
must not import training) and training both build on it. Sharded checkpoints are gathered on one process with
the engines' own tools: torch's dcp_to_torch_save (the function accelerate's merge_fsdp_weights wraps) and
DeepSpeed's zero_to_fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from modeling.config import REAL_VOCAB_SIZE, GPTConfig, get_preset
from modeling.device import quiet_deepspeed
from modeling.gpt import GPT, real_vocab_rows

# A run folder's files and folders, as training writes them (besides its checkpoints/)
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"
EVALS_PLOT = "evals.png"
SAMPLES_FILE = "samples.txt"
EXPORT_DIR = "export"  # the transformers export, with its model card
EXPORT_STEP_FILE = "bookgpt.json"  # in an export: {"step": n}, the optimizer step of the weights it holds
_STEP_DIR = re.compile(r"^step-(\d{8,})$")  # 8 digits sort as text; step 10**8 on has more
_FSDP_SHARDS = "pytorch_model_fsdp_0"  # accelerate's name for the model's state dict (fsdp SHARDED_STATE_DICT)
_ZERO_TAG = "pytorch_model"  # accelerate's DeepSpeed checkpoint tag (its folder name)
MANIFEST = "manifest.json"  # in a checkpoint: {"files": {relative path: {"bytes": n, "sha256": hex}}}
_CHUNK = 64 * 2**20  # files are hashed in chunks on threads (hashlib releases the GIL): GBs take seconds, not minutes
_READ = 4 * 2**20  # each thread reads its chunk in pieces: memory stays a few MB however many threads run
_THREADS = min(8, os.cpu_count() or 1)  # one process hashes: the main one (a resume's check, a save's manifest)


class RunError(ValueError):
    """A run folder or checkpoint that cannot be read; the message says what was wrong and what to do."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def checkpoint_step(checkpoint: Path) -> int:
    """The optimizer step of a checkpoint folder named by checkpoint_dir (is_checkpoint_dir holds)."""
    return int(checkpoint.name.removeprefix("step-"))


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is named as a complete checkpoint (step-NNNNNNNN, no .tmp/.old suffix)."""
    return bool(_STEP_DIR.match(path.name))


def named(folder: Path) -> Path:
    """`folder` as a path whose last parts are its own and its parents' names: . and ../step-N (given from inside a
    folder) as absolute paths."""
    return Path(os.path.abspath(folder)) if folder.name == "" or ".." in folder.parts else folder


def run_of_checkpoint(folder: Path) -> Path | None:
    """The run folder whose checkpoints/ `folder` is one of (it holds a copy of config.yaml, so it looks like a run
    folder); None where it is not one."""
    folder = named(folder)
    if is_checkpoint_dir(folder) and folder.parent.name == "checkpoints":
        return folder.parent.parent
    return None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_checkpoint_dir(p)]
    return sorted(found, key=checkpoint_step)


def read_metrics(path: str | Path) -> list[dict]:
    """metrics.jsonl rows; when a resumed run logged a step again, the later row wins. A last row without its newline
    that does not parse is left out: one a killed run cut short (resuming drops it) or a running one is writing. Any
    other row that is not a JSON object is a RunError naming its line."""
    rows: dict[tuple[int | None, frozenset], dict] = {}
    text = Path(path).read_text()
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except ValueError as err:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise RunError(f"{path} line {number} is not a JSON row ({err}); delete or repair that line") from None
        if not isinstance(row, dict):
            raise RunError(f"{path} line {number} is not a JSON object; delete or repair that line")
        rows[(row.get("step"), frozenset(row))] = row
    return sorted(rows.values(), key=lambda r: (r.get("step") is None, r.get("step") or 0))


def is_hub_id(init_from: str) -> bool:
    """Whether init_from names a model on the Hub (NAME or OWNER/NAME) rather than a folder: nothing at that path."""
    return not Path(init_from).exists()


def names_a_hub_model(name: str) -> bool:
    """Whether `name` can only mean a Hub model: nothing at that path, and a Hub id's shape (NAME or OWNER/NAME, not a
    path from / . or ~)."""
    return is_hub_id(name) and name.count("/") <= 1 and name[0] not in "/.~"


SHAPE_FIELDS = ("n_layer", "n_head", "n_embd")  # what a run config may set over its preset's (None: the preset's)
SHAPE_FLAGS = (*SHAPE_FIELDS, "block_size")  # and with the context: every field that sets the model's shape


def model_shape(
    preset: str,
    block_size: int | None = None,
    init_from: str = "",
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
) -> GPTConfig:
    """The model a run config names: init_from's shape (a transformers folder or Hub id), whose block_size may only
    shorten its context (its positions past n_positions were never trained), or the preset's with n_layer, n_head,
    n_embd and block_size set over it (learned positions from scratch: any number of them). A ValueError says what to
    change."""
    given = {name: value for name, value in zip(SHAPE_FIELDS, (n_layer, n_head, n_embd)) if value is not None}
    if init_from and given:
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
        raise ValueError(
            f"{flags} set the shape of a model trained from scratch, and init_from {init_from}'s shape is its "
            f"config.json's: drop {flags} (or drop --init-from to train that shape from scratch)"
        )
    if init_from:
        from modeling.hf_export import load_hf_config  # imports transformers: seconds a scratch run does without

        # A Hub id is NAME or OWNER/NAME; anything else is a folder, and a missing one gets a plain message.
        if is_hub_id(init_from) and not names_a_hub_model(init_from):
            raise ValueError(
                f"init_from {init_from}: no such folder; give a transformers GPT-2 folder such as a run's "
                "export/ (runs/NAME/export) or a Hub id such as gpt2"
            )
        folder = Path(init_from).expanduser()
        if not (folder / "config.json").is_file() and (folder / EXPORT_DIR / "config.json").is_file():
            raise ValueError(f"init_from {init_from} is a run folder: give its export, {folder / EXPORT_DIR}")
        try:
            config = load_hf_config(init_from)
        except ValueError as err:  # a GPT-2 shape our GPT cannot take
            raise ValueError(f"init_from {init_from}: {err}") from None
        except OSError as err:  # a folder without config.json, no such Hub id, or no way to the Hub
            said = " ".join(str(err).split())  # transformers' messages run over several lines
            if is_hub_id(init_from):
                said += (
                    f" A Hub id is read from huggingface.co: where it cannot be reached, download it where it can "
                    f"(hf download {init_from} --local-dir DIR) and give --init-from DIR"
                )
            raise ValueError(f"init_from {init_from}: {said}") from None
        except Exception as err:  # a config.json field transformers' config class refuses (a str for an int)
            said = " ".join(str(err).split())[:300]
            raise ValueError(
                f"init_from {init_from}: its config.json does not load ({type(err).__name__}: {said}); give a "
                "transformers GPT-2 folder such as a run's export/"
            ) from None
        if block_size is not None and block_size > config.block_size:
            raise ValueError(
                f"block_size={block_size} exceeds {init_from}'s {config.block_size} positions, the context its weights "
                f"were trained at: give --block-size {config.block_size} or less (a longer context needs a model "
                "trained from scratch, without --init-from)"
            )
    else:
        config = get_preset(preset)
        heads, width = given.get("n_head", config.n_head), given.get("n_embd", config.n_embd)
        if width % heads:
            raise ValueError(_heads_advice(preset, heads, width, given))
        config = dataclasses.replace(config, **given)
    return config if block_size is None else dataclasses.replace(config, block_size=block_size)


def _heads_advice(preset: str, heads: int, width: int, given: dict[str, int]) -> str:
    """The line for an n_embd that n_head does not divide, naming which of the two the preset gave, and a head count
    that fits: GPT-2's head size of 64 where the width allows it, else the divisor nearest the one asked for."""
    whose = {name: "" if name in given else f" (the {preset} preset's)" for name in ("n_embd", "n_head")}
    named = f"n_embd {width}{whose['n_embd']} is not divisible by n_head {heads}{whose['n_head']}"
    divisors = [h for h in range(1, width + 1) if width % h == 0]
    fits = width // 64 if width % 64 == 0 else min(divisors, key=lambda h: abs(h - heads))
    return (
        f"{named}: every head takes n_embd / n_head channels; give e.g. "
        f"--n-head {fits} (heads of {width // fits}) or an --n-embd that {heads} divides"
    )


def shape_name(
    preset: str,
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
    block_size: int | None = None,
) -> str:
    """A model as its run config names it: the preset (or init_from), and what the config sets over its shape."""
    fields = zip(SHAPE_FLAGS, (n_layer, n_head, n_embd, block_size))
    given = [f"{name} {value}" for name, value in fields if value is not None]
    return f"{preset} with {', '.join(given)}" if given else preset


def run_model_config(run_dir: str | Path) -> GPTConfig:
    """The model shape a run trained, from its config.yaml."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise RunError(f"{path} is missing, so the model shape is unknown; is {run_dir} a run folder?")
    try:
        config = yaml.safe_load(path.read_text())
        preset, block_size, init_from = config["preset"], config.get("block_size"), config.get("init_from") or ""
        return model_shape(preset, block_size, init_from, *(config.get(name) for name in SHAPE_FIELDS))
    except (yaml.YAMLError, TypeError, KeyError) as err:  # unreadable, or no preset
        raise RunError(f"{path}: {err}") from None
    except ValueError as err:  # a bad shape, or the folder the run started from moved or deleted since
        export = Path(run_dir) / EXPORT_DIR
        if not init_from:
            raise RunError(f"{path}: {err}") from None
        if (export / "config.json").is_file():  # the run's own export: the same shape
            return model_shape(preset, None, str(export))
        raise RunError(
            f"{path}: {str(err).split('; ')[0]}: the run's model shape comes from there; put it back (or, once the "
            "run has finished, its export/ stands in for it)"
        ) from None


def export_step(export: Path) -> int | None:
    """The optimizer step whose weights an export holds, as it recorded it; None for an export made before it did."""
    try:
        step = json.loads((export / EXPORT_STEP_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def checkpoint_engine(checkpoint: str | Path) -> str | None:
    """Which kind of engine wrote an accelerator.save_state folder: "DDP" (one process or DDP: the whole model),
    "FSDP" (sharded state dicts) or "DeepSpeed" (ZeRO partitions); None when it holds no model."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "model.safetensors").is_file():
        return "DDP"
    if (checkpoint / _FSDP_SHARDS).is_dir():
        return "FSDP"
    return "DeepSpeed" if (checkpoint / _ZERO_TAG).is_dir() else None


def zero_layout(checkpoint: str | Path) -> tuple[str, int]:
    """(the ZeRO stages that wrote a DeepSpeed checkpoint, "3" or "1/2", and on how many processes), from its files:
    ZeRO-3 saves each rank's part of the model (zero_pp_rank_R_mp_rank_00_model_states.pt), stages 1 and 2 the whole
    model once (mp_rank_00_model_states.pt); every stage saves each rank's optimizer partition."""
    tag = Path(checkpoint) / _ZERO_TAG
    ranks = len(list(tag.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt")))
    return ("3" if any(tag.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")) else "1/2"), ranks


def merge_shards(folder: str | Path) -> dict:
    """A torch.distributed.checkpoint folder (every rank's shards) as one state dict of whole tensors on the CPU, as
    saved (accelerate's FSDP2 saves: {"model": ...} in pytorch_model_fsdp_0/, {"optimizer": ...} in optimizer_0/).
    Works on one process, without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder, Path(tmp) / "merged.pt")
        return torch.load(Path(tmp) / "merged.pt", map_location="cpu", weights_only=True)


def checkpoint_weights(checkpoint: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """(the full model state dict of an accelerator.save_state folder from any engine, on the CPU; how it was read).
    Keys keep what the saving wrapper added (see load_checkpoint)."""
    checkpoint = Path(checkpoint)
    engine = checkpoint_engine(checkpoint)
    try:
        if engine == "DDP":
            return load_file(str(checkpoint / "model.safetensors")), "model.safetensors"
        if engine == "FSDP":
            merged = merge_shards(checkpoint / _FSDP_SHARDS)["model"]
            return merged, "FSDP shards merged with torch's dcp_to_torch_save"
    except Exception as err:  # safetensors' SafetensorError, torch's CheckpointException, OSError: a damaged file
        said = " ".join(str(err).split())[:300]
        raise RunError(f"{checkpoint} does not load ({type(err).__name__}: {said}): a file of it is damaged") from None
    if engine == "DeepSpeed":
        quiet_deepspeed()
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise RunError(
                f"{checkpoint} is a DeepSpeed ZeRO checkpoint: install deepspeed (pip install .[deepspeed]) to "
                "gather it, or use the run's export/ (--model RUN/export)"
            ) from None
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines, away from a CLI's output
            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=_ZERO_TAG)
        return state, "ZeRO partitions gathered with DeepSpeed's zero_to_fp32: the fp32 master weights"
    raise RunError(
        f"{checkpoint} holds no model weights (model.safetensors, {_FSDP_SHARDS}/ or {_ZERO_TAG}/); "
        "give a checkpoints/step-NNNNNNNN folder of a run"
    )


def file_sha256(path: Path) -> str:
    """sha256 over the sha256 of each 64 MiB chunk: a multi-GB file hashes on several cores."""
    size = path.stat().st_size

    def chunk(offset: int) -> bytes:
        digest, left = hashlib.sha256(), min(_CHUNK, size - offset)
        with path.open("rb") as f:
            f.seek(offset)
            while left > 0 and (piece := f.read(min(left, _READ))):
                digest.update(piece)
                left -= len(piece)
        return digest.digest()

    with ThreadPoolExecutor(_THREADS) as pool:
        return hashlib.sha256(b"".join(pool.map(chunk, range(0, max(size, 1), _CHUNK)))).hexdigest()


def manifest_damage(folder: Path, wanted: Callable[[str], bool] = lambda name: True) -> str | None:
    """What is wrong with the files of a checkpoint that its manifest lists and `wanted` picks (by relative path): one
    missing, of another size or hash than when saved. None: they match, or the folder has no manifest (saved before
    manifests existed)."""
    if not (folder / MANIFEST).is_file():
        return None
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        files = {name: (int(f["bytes"]), str(f["sha256"])) for name, f in listed.items() if wanted(name)}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} is unreadable"
    for name, (size, _) in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {size:,} when saved"
    for name, (_, digest) in files.items():
        if file_sha256(folder / name) != digest:
            return f"{name} does not match its sha256 when saved"
    return None


def _holds_weights(name: str) -> bool:
    """Whether a checkpoint's file (relative path) is one checkpoint_weights reads, of any engine: the reader hashes
    those alone (ZeRO's fp32 weights are in its optimizer partitions, under the same tag)."""
    return name == "model.safetensors" or name.split("/")[0] in (_FSDP_SHARDS, _ZERO_TAG)


def checkpoint_path(run_dir: str | Path, checkpoint: str | Path) -> Path:
    """A checkpoint given by path, or by its name in the run's checkpoints/ (step-NNNNNNNN), as a path."""
    run_dir, path = Path(run_dir), Path(checkpoint)
    if not path.is_dir() and (run_dir / "checkpoints" / path).is_dir():
        return run_dir / "checkpoints" / path
    return path


def load_checkpoint(run_dir: str | Path, checkpoint: str | Path) -> tuple[GPT, str]:
    """(GPT of the run's shape with a checkpoint's weights, on the CPU in train mode; where they came from).
    `checkpoint`: a path, or a name in the run's checkpoints/."""
    run_dir, checkpoint = Path(run_dir), checkpoint_path(run_dir, checkpoint)
    if not checkpoint.is_dir():
        found = [p.name for p in list_checkpoints(run_dir)]
        raise RunError(f"checkpoint {checkpoint} does not exist; {run_dir} has {', '.join(found) or 'none'}")
    model = GPT(run_model_config(run_dir))
    try:
        if damage := manifest_damage(checkpoint, _holds_weights):  # a flipped byte loads silently otherwise
            raise RunError(f"checkpoint {checkpoint} is damaged ({damage})")
        weights, how = checkpoint_weights(checkpoint)
    except RunError as err:
        others = [p.name for p in list_checkpoints(run_dir) if p.resolve() != checkpoint.resolve()]
        advice = f"give another of its checkpoints: {', '.join(others)}" if others else "it is the run's only one"
        raise RunError(f"{err}; {advice}") from None
    state = plain_state_dict(weights)
    if model.config.vocab_size == REAL_VOCAB_SIZE:  # runs started with --init-from before it kept a folder's 50,257
        state = real_vocab_rows(state)  # ids saved them padded
    mismatch = f"{checkpoint} does not fit the model that {run_dir / CONFIG_FILE} describes"
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        raise RunError(f"{mismatch}: {str(err).splitlines()[-1].strip()}") from None
    # Checkpoints store a tied parameter (the lm_head and the token embedding) once, under either name.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing = [k for k in missing if k not in params or id(params[k]) not in loaded]
    if missing or unexpected:
        raise RunError(f"{mismatch}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model, f"checkpoint {checkpoint} ({how})"


def plain_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """state_dict under our GPT's own keys: without DDP's `module.` prefix and torch.compile's `_orig_mod.` (a prefix
    where the whole model is compiled, inside the key of each compiled block under regional compilation, which
    `accelerate config` offers)."""

    def plain(key: str) -> str:
        parts = [part for part in key.split(".") if part != "_orig_mod"]
        while parts[0] == "module":
            parts.pop(0)
        return ".".join(parts)

    return {plain(key): value for key, value in state_dict.items()}
