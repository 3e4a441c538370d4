"""The start-up check of the transformers export a run writes at its end (modeling.hf_export.check_export), and its
run in a process of its own, which a run on a GPU starts on its main process while the rest of its start-up goes on.

The check takes 6-9 s on a fresh GPU machine (transformers' import from a cold disk, the tokenizer's vocab and
merges, derived on a machine's first run and read from the cache after it, a one-layer export written and loaded
back; 2.4 s on a warm 2-core Zen 4): in a process of its own, started before the Accelerator, it overlaps CUDA's
start and the data, model and prepare() phases instead of adding to them, on cores the start-up leaves idle (started
after the Accelerator, the run still waited 4.3 s for it on a fresh H200). A
process, not a thread: the check builds models, which draw from the global generator the run's init uses, and
imports torch's and transformers' modules while the run imports its own. A run on the CPU checks in its own
process: its cores are the run's (a child cost its start-up 3 s more on the Zen 4).

    python -m training.export_check '{"n_layer": 12, ...}'   # the child: exit 1 and the reason as its last line
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from data_prep.tokenizer import gpt2_vocab_and_merges
from modeling.config import GPTConfig
from training.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def export_problem(model_config: GPTConfig) -> str | None:
    """Why the export would fail ("ExceptionType: message"), or None where check_export passes."""
    try:
        from modeling.hf_export import check_export  # imports transformers (~3 s)

        check_export(model_config, gpt2_vocab_and_merges())
    except Exception as err:  # a missing package, a shape GPT-2 lacks, an unwritable temp folder: all stop the run
        return f"{type(err).__name__}: {' '.join(str(err).split())}"  # on one line, as the run's error is
    return None


def export_failure(reason: str) -> ConfigError:
    return ConfigError(
        f"the export at the end of this run would fail ({reason}); fix that, or train without it: --export-hf false"
    )


class ExportCheck:
    """export_problem(model_config) running in a child process from construction; verdict() waits for it."""

    def __init__(self, model_config: GPTConfig) -> None:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # run from source too
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "training.export_check", json.dumps(dataclasses.asdict(model_config))],
            # a one-layer model on the CPU: no cores to speak of, and no GPU (its memory is the run's to measure)
            env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # a Ctrl-C at the terminal is the run's to handle, not this check's
        )  # fmt: skip
        atexit.register(self._proc.kill)  # a run that stops before the verdict leaves no check behind

    @staticmethod
    def expected_here() -> bool:
        """Whether this process will be its launch's main process on a CUDA GPU, read before the Accelerator exists
        from what the launcher set (RANK; ACCELERATE_USE_CPU, a launch YAML's use_cpu) and torch's CUDA. The run
        corrects a wrong read once its Accelerator is built."""
        import torch
        from accelerate.utils import parse_flag_from_env

        return (
            os.environ.get("RANK", "0") == "0"
            and not parse_flag_from_env("ACCELERATE_USE_CPU")
            and torch.cuda.is_available()
        )

    def cancel(self) -> None:
        """Stop the check unread: the run checks in its own process, or not at all."""
        self._proc.kill()
        self._proc.communicate()

    def verdict(self) -> None:
        """Wait for the check; export_failure's ConfigError where the export would fail."""
        out, err = self._proc.communicate()
        if self._proc.returncode:  # the reason on stdout; a crash's own last words on stderr
            lines = out.strip().splitlines() or err.strip().splitlines()
            raise export_failure(lines[-1] if lines else f"its check ended with exit status {self._proc.returncode}")


def main(argv: list[str]) -> int:
    problem = export_problem(GPTConfig(**json.loads(argv[0])))
    if problem:
        print(problem)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
