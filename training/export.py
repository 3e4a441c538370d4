"""Write a transformers export (GPT2LMHeadModel + GPT-2 tokenizer) of any checkpoint of a run, from any engine:
DDP, FSDP2 shards or DeepSpeed ZeRO-2/3 partitions are gathered on this one process (see modeling.runs).

    python -m training.export runs/x [--checkpoint step-00000400] [--out DIR]

Default: the newest checkpoint, into runs/x/export-step-NNNNNNNN/; the run's own export/ (its final weights)
is never overwritten, and a folder that exists is refused rather than replaced.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from data_prep.tokenizer import gpt2_vocab_and_merges
from modeling.disk import DiskFull, cannot_write, disk_full_reported
from modeling.runs import (
    RunError,
    checkpoint_path,
    checkpoint_step,
    is_checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    named,
    run_of_checkpoint,
)


class ExportError(RuntimeError):
    """The end of a run could not write its export; the message names the command that does it from the run folder."""


def export_checkpoint(run_dir: str | Path, checkpoint: str | None = None, out: str | Path | None = None) -> Path:
    """Export `checkpoint` (a step-NNNNNNNN name in the run's checkpoints/ or a path; default the newest) to `out`
    (default RUN/export-<checkpoint name>), written whole or not at all (modeling.hf_export.export_hf)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"run folder {run_dir} {'is a file' if run_dir.exists() else 'does not exist'}")
    if (run := run_of_checkpoint(run_dir)) is not None:  # its config.yaml made it look like a run folder
        raise RunError(
            f"{run_dir} is a checkpoint of the run {run}, not a run folder: give python -m training.export "
            f"{shlex.quote(str(run))} --checkpoint {named(run_dir).name}"
        )
    found = list_checkpoints(run_dir)
    if checkpoint is None and not found:
        raise RunError(f"{run_dir} has no checkpoint (checkpoints/step-NNNNNNNN/) to export")
    path = found[-1] if checkpoint is None else checkpoint_path(run_dir, checkpoint)
    out = Path(out) if out is not None else run_dir / f"export-{path.name}"
    if out.exists():
        raise RunError(f"{out} already exists; remove it or choose another --out")
    if (run_dir / "checkpoints").resolve() in out.resolve().parents:
        raise RunError(f"{out} is in the run's checkpoints/, where a resume takes it for one; choose another --out")
    if (why := cannot_write(out)) is not None:  # before loading the checkpoint, not after
        raise RunError(f"cannot write {out}: {why}; choose another --out")
    model, source = load_checkpoint(run_dir, path)
    from modeling.hf_export import export_hf  # imports transformers (~3 s)

    with disk_full_reported(out, f"{path} is untouched and nothing of the export is left"):
        step = checkpoint_step(path) if is_checkpoint_dir(path) else None  # a copy named otherwise
        export_hf(model, out, gpt2_vocab_and_merges(), step)
    print(f"{source} -> {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="run folder (with config.yaml and checkpoints/)")
    parser.add_argument("--checkpoint", help="step-NNNNNNNN (in the run's checkpoints/) or a path; default: newest")
    parser.add_argument("--out", help="export folder to create (default: RUN/export-step-NNNNNNNN)")
    args = parser.parse_args(argv)
    try:
        export_checkpoint(args.run, args.checkpoint, args.out)
    except (RunError, DiskFull) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
