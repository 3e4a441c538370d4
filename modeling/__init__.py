"""The GPT-2 model (gpt.py), its shapes (config.py), the seed baseline (reference.py) and the transformers
conversion (hf_export.py): import each from its module. Nothing here imports torch, so the torch-free modules
(config, disk) serve data preparation without it."""

import modeling.malloc  # noqa: F401  first: it sets torch's huge-page default before any CPU allocation
