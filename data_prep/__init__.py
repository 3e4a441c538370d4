"""Data preparation: book sources -> GPT-2 tokens -> uint16 shards, and the training loader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class DataPrepError(RuntimeError):
    """A problem with the inputs or the prepared data, worded so the user knows what to do."""


def ensure_default_corpus(data_dir: str | Path, log: Callable[[str], None] = print) -> None:
    """Prepare the embedded default corpus into data_dir unless a prepared corpus (its manifest) is there."""
    if (Path(data_dir) / "manifest.json").exists():
        return
    from data_prep.prepare import prepare  # imports `datasets`, which only building shards needs

    log(f"{data_dir} has no manifest: preparing the default corpus there")
    prepare("default", data_dir)
