"""Data preparation: book sources -> GPT-2 tokens -> uint16 shards, and the training loader."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Number = TypeVar("Number", int, float)


class DataPrepError(RuntimeError):
    """A problem with the inputs or the prepared data, worded so the user knows what to do."""


def ensure_default_corpus(data_dir: str | Path, log: Callable[[str], None] = print) -> None:
    """Prepare the embedded default corpus into data_dir unless a prepared corpus (its manifest) is there."""
    if (Path(data_dir) / "manifest.json").exists():
        return
    from data_prep.prepare import prepare  # imports `datasets`, which only building shards needs

    log(f"{data_dir} has no manifest: preparing the default corpus there")
    prepare("default", data_dir)


def number_arg(
    expected: str, valid: Callable[[float], bool], must_be: str, parse: Callable[[str], Number] = float
) -> Callable[[str], Number]:
    """The one argparse type of the entry points' number flags (the benchmarks' --tokens, --peak-tflops, --p-target;
    every count through at_least): argparse's one line naming the flag, "expected EXPECTED, got 'x'" for text that
    parse() does not take and "must be MUST_BE, got x" for a number where valid() is false (nan included), before
    any work (out of range, each was a traceback or a table of nonsense after it)."""

    def parse_arg(text: str) -> Number:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must be {must_be}, got {text}")
        return value

    return parse_arg


def at_least(minimum: int) -> Callable[[str], int]:
    """number_arg for a count: a whole number of at least `minimum`."""
    return number_arg("a whole number", lambda value: value >= minimum, f"at least {minimum}", int)
