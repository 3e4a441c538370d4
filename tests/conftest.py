"""Shared data fixtures (the embedded corpus is downloaded once into the user cache, then offline)."""

from pathlib import Path

import pytest

from data_prep.prepare import prepare

# Four plays of the embedded corpus; with val_fraction 0.1 Twelfth Night is the val book.
BOOKS_SOURCE = "default:hamlet,macbeth,tempest,twelfth_night"


@pytest.fixture(scope="session")
def prepared_books(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared data dir: ~117k train tokens in 3 shards, ~37k val tokens in 1 shard. Read-only."""
    out = tmp_path_factory.mktemp("prepared") / "books"
    prepare(BOOKS_SOURCE, out, shard_tokens=40_000, val_fraction=0.1)
    return out
