"""The GPT-2 model (gpt.py), its shapes (config.py), the seed baseline (reference.py) and the transformers
conversion (hf_export.py, imported on its own since it pulls in transformers)."""

import modeling.malloc  # noqa: F401  first: it sets torch's huge-page default before any CPU allocation
from modeling.config import PRESETS, REAL_VOCAB_SIZE, GPTConfig, get_preset
from modeling.gpt import GPT

__all__ = ["GPT", "GPTConfig", "PRESETS", "REAL_VOCAB_SIZE", "get_preset"]
