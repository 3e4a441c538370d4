"""Load a trained model for evaluation or sampling: from a run folder's checkpoint (any engine's) or from an
HF-format export."""

from __future__ import annotations

import argparse
from pathlib import Path

from evals import EvalError
from modeling.gpt import GPT
from modeling.runs import (
    CONFIG_FILE,
    EXPORT_DIR,
    RunError,
    list_checkpoints,
    load_checkpoint,
    named,
    names_a_hub_model,
    run_of_checkpoint,
)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--run / --model / --checkpoint: where the model to evaluate or sample from comes from."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="run folder (newest checkpoint, else its export/)")
    source.add_argument(
        "--model", help="HF-format export folder (e.g. runs/x/export), any transformers GPT-2 folder, or a Hub id: gpt2"
    )
    parser.add_argument(
        "--checkpoint", help="with --run: step-NNNNNNNN (in the run's checkpoints/) or a path; default: newest"
    )


def load_model_from_args(args: argparse.Namespace) -> tuple[GPT, str]:
    """The model named by `add_model_args`' flags, and where it came from."""
    if args.checkpoint and not args.run:
        raise EvalError("--checkpoint needs --run (the run folder holds the model's config.yaml)")
    return load_model(args.run, args.checkpoint, args.model)


def load_model(
    run: str | Path | None = None, checkpoint: str | Path | None = None, export: str | Path | None = None
) -> tuple[GPT, str]:
    """(GPT in eval mode on the CPU, a description of where it came from: which file, or how shards were merged).

    Give `export` (an HF-format folder, or a Hub id such as gpt2), or `run`: its `checkpoint` (a checkpoints/step-N
    folder, from DDP, FSDP2 or ZeRO) if given, else its newest checkpoint, else its export/ folder.
    """
    if (run is None) == (export is None):
        raise EvalError("give either a run folder (--run) or an HF-format export folder (--model), not both")
    if export is not None:
        what = "Hub model" if names_a_hub_model(str(export)) else "export"
        return _from_export(Path(export)).eval(), f"{what} {export}"
    run = Path(run)
    if not run.is_dir():
        raise EvalError(f"run folder {run} {'is a file' if run.exists() else 'does not exist'}")
    if (run / "config.json").is_file() and not (run / CONFIG_FILE).is_file():  # --run EXPORT, --model meant
        raise EvalError(f"{run} is an HF-format export, not a run folder: give --model {run}")
    if checkpoint is None and (hint := _checkpoint_hint(run)):
        raise EvalError(hint)
    if checkpoint is None:
        found = list_checkpoints(run)
        if not found and (run / EXPORT_DIR).is_dir():
            return _from_export(run / EXPORT_DIR).eval(), f"export {run / EXPORT_DIR}"
        if not found:
            raise EvalError(
                f"run folder {run} has no checkpoint (checkpoints/step-NNNNNNNN/) and no export/ folder: "
                "train it first (checkpoint_interval > 0 or let it finish), or pass --checkpoint / --model"
            )
        checkpoint = found[-1]
    try:
        model, source = load_checkpoint(run, checkpoint)
    except RunError as err:
        raise EvalError(str(err)) from None
    return model.eval(), source


def _checkpoint_hint(folder: Path) -> str | None:
    """Where `folder` is one of a run's checkpoints, how to name it; else None."""
    if (run := run_of_checkpoint(folder)) is None:
        return None
    name = named(folder).name  # step-NNNNNNNN, also where folder is . from inside it
    return f"{folder} is a checkpoint of the run {run}, not a run folder: give --run {run} --checkpoint {name}"


def _from_export(folder: Path) -> GPT:
    if not (folder / "config.json").is_file():
        if hint := _checkpoint_hint(folder):  # --model RUN/checkpoints/step-N
            raise EvalError(hint)
        if (folder / CONFIG_FILE).is_file():  # --model RUN, --run meant
            raise EvalError(
                f"{folder} is a run folder, not an HF-format export: give --run {folder} (its newest checkpoint, else "
                f"its export/), or --model {folder / EXPORT_DIR}"
            )
        if not names_a_hub_model(str(folder)):
            raise EvalError(f"{folder} is not an HF-format export (no config.json); see the run's export/ folder")
    from modeling.hf_export import load_hf  # imports transformers: seconds that checkpoint loads do without

    try:
        return load_hf(str(folder))
    except (OSError, ValueError) as err:  # unreadable files, no way to the Hub, or a shape our GPT cannot take
        if not names_a_hub_model(str(folder)):
            raise EvalError(f"cannot load the export {folder}: {err}") from None
        said = " ".join(str(err).split())  # transformers' messages run over several lines
        raise EvalError(
            f"cannot load {folder} from the Hub: {said} Where huggingface.co cannot be reached, download it where it "
            f"can (hf download {folder} --local-dir DIR) and give --model DIR"
        ) from None
