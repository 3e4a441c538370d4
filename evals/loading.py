"""Load a trained model for evaluation or sampling: from a run folder's checkpoint or from an HF-format export."""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file

from evals import EvalError
from modeling.config import GPTConfig
from modeling.gpt import GPT
from training.checkpoint import list_checkpoints
from training.config import ConfigError, TrainConfig, load_yaml

_WRAPPER_PREFIXES = ("_orig_mod.", "module.")  # torch.compile and DDP wrappers' key prefixes


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--run / --model / --checkpoint: where the model to evaluate or sample from comes from."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run folder (newest checkpoint, else its export/)")
    source.add_argument("--model", help="HF-format export folder (e.g. runs/x/export)")
    parser.add_argument("--checkpoint", help="with --run: a checkpoints/step-NNNNNNNN folder instead of the newest")


def load_model_from_args(args: argparse.Namespace) -> tuple[GPT, str]:
    """The model named by `add_model_args`' flags, and where it came from."""
    if args.checkpoint and not args.run:
        raise EvalError("--checkpoint needs --run (the run folder holds the model's config.yaml)")
    return load_model(args.run, args.checkpoint, args.model)


def load_model(
    run: str | Path | None = None, checkpoint: str | Path | None = None, export: str | Path | None = None
) -> tuple[GPT, str]:
    """(GPT in eval mode on the CPU, a description of where it came from).

    Give `export` (an HF-format folder), or `run`: its `checkpoint` (a checkpoints/step-N folder) if given,
    else its newest checkpoint, else its export/ folder.
    """
    if (run is None) == (export is None):
        raise EvalError("give either a run folder (--run) or an HF-format export folder (--model), not both")
    if export is not None:
        model, source = _from_export(Path(export)), f"export {export}"
    else:
        run = Path(run)
        if not run.is_dir():
            raise EvalError(f"run folder {run} does not exist")
        if checkpoint is None:
            found = list_checkpoints(run)
            if found:
                checkpoint = found[-1]
            elif (run / "export").is_dir():
                return _from_export(run / "export").eval(), f"export {run / 'export'}"
            else:
                raise EvalError(
                    f"run folder {run} has no checkpoint (checkpoints/step-NNNNNNNN/) and no export/ folder: "
                    "train it first (checkpoint_interval > 0 or let it finish), or pass --checkpoint / --model"
                )
        model, source = _from_checkpoint(run, Path(checkpoint)), f"checkpoint {checkpoint}"
    return model.eval(), source


def run_model_config(run: Path) -> GPTConfig:
    """The model shape a run trained: its config.yaml's preset, with its block_size override if any."""
    path = run / "config.yaml"
    if not path.is_file():
        raise EvalError(f"{path} is missing, so the model shape is unknown; is {run} a run folder?")
    try:
        return TrainConfig(**load_yaml(path)).model_config()
    except (ConfigError, ValueError) as err:
        raise EvalError(f"{path}: {err}") from None


def _from_checkpoint(run: Path, checkpoint: Path) -> GPT:
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        raise EvalError(f"{weights} does not exist; --checkpoint takes a checkpoints/step-NNNNNNNN folder")
    model = GPT(run_model_config(run))
    state = {_strip_prefixes(k): v for k, v in load_file(str(weights)).items()}
    mismatch = f"{weights} does not fit the model that {run / 'config.yaml'} describes"
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        raise EvalError(f"{mismatch}: {str(err).splitlines()[-1].strip()}") from None
    # save_state stores a tied parameter (the lm_head and the token embedding) once, under either name.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[k]) for k in state if k in params}
    missing = [k for k in missing if k not in params or id(params[k]) not in loaded]
    if missing or unexpected:
        raise EvalError(f"{mismatch}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model


def _from_export(folder: Path) -> GPT:
    if not (folder / "config.json").is_file():
        raise EvalError(f"{folder} is not an HF-format export (no config.json); see the run's export/ folder")
    from modeling.hf_export import load_hf  # imports transformers: seconds that checkpoint loads do without

    try:
        return load_hf(folder)
    except (OSError, ValueError) as err:  # unreadable files, or a GPT-2 shape our GPT cannot take
        raise EvalError(f"cannot load the export {folder}: {err}") from None


def _strip_prefixes(key: str) -> str:
    while key.startswith(_WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key
