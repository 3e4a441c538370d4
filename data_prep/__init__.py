"""Data preparation: book sources -> GPT-2 tokens -> uint16 shards, and the training loader."""


class DataPrepError(RuntimeError):
    """A problem with the inputs or the prepared data, worded so the user knows what to do."""
