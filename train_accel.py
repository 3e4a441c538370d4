"""Pretrain a GPT-2-class model on books with Hugging Face Accelerate.

    accelerate launch --config_file accelerate_configs/4xa100.yaml train_accel.py [--config configs/x.yaml] [--flags]

Precision (bf16), torch.compile and DDP/FSDP/DeepSpeed come from the accelerate YAML; everything else from
training.config.TrainConfig (defaults < --config file < flags; `--print-config` shows the result).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, redirect_stdout
from typing import TextIO

from torch.distributed.elastic.multiprocessing.errors import record
from tqdm.auto import tqdm
from tqdm.contrib import DummyTqdmFile

from data_prep import DataPrepError
from evals import EvalError
from modeling.disk import DiskFull
from modeling.runtime import exit_process, finish, lost_peer, report_error
from training.checkpoint import CheckpointError, save_checkpoint
from training.compile_cache import compile_disk_full_reported
from training.config import ConfigError, parse_config, print_config_yaml
from training.export import ExportError
from training.hub import HubError
from training.loop import Run, TrainMetrics, due, evaluate, setup, trainer_for, write_outputs, write_sample
from training.metrics import StartupClock, close_trackers
from training.runlock import RunFolderInUse
from training.signals import (
    StopRequest,
    Terminated,
    grace_period_line,
    ignore_further_stops,
    pid1_drops_sigterm_line,
    stop_at_once_on_sigterm,
    stop_with_the_launcher,
)
from training.step import TrainingAborted, is_out_of_memory


class ProgressLines:
    """The progress bar where no terminal shows it: a log file, and SLURM's job output, `docker logs` and nohup,
    which take stdout and stderr together. tqdm redraws its bar there by carriage returns, and the run's lines
    landed on the bar's text; this prints tqdm's figures as a line of their own at each log step instead."""

    FORMAT = "step {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, total: int, initial: int, file: TextIO) -> None:
        self.total, self.n, self.initial, self.file = total, initial, initial, file
        self.started = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix(self, **postfix: str) -> None:
        shown = ", ".join(f"{k}={postfix[k]}" for k in sorted(postfix))  # in tqdm's order
        line = tqdm.format_meter(self.n, self.total, time.monotonic() - self.started, initial=self.initial,
                                 postfix=shown, bar_format=self.FORMAT)  # fmt: skip
        print(line, file=self.file, flush=True)


@contextmanager
def progress_bar(total: int, initial: int, shown: bool) -> Iterator[tqdm | ProgressLines]:
    """The run's progress bar. Where stdout is a terminal the bar is drawn there, and the lines the run prints while it
    is up go above it (tqdm clears the bar, writes the line, draws the bar again) instead of onto the bar's line; and
    no pipe between the two streams reorders them (accelerate 1.16's one-process launcher, `make train`'s, passes
    stderr through one of its own, where tqdm would also draw a 10-character bar). Elsewhere the progress goes to
    stderr, so that a redirected stdout, a log, holds the run's lines alone: as a bar where stderr is a terminal, as
    lines where it is not (ProgressLines)."""
    on_stdout = shown and sys.stdout.isatty()
    if shown and not on_stdout and not sys.stderr.isatty():
        yield ProgressLines(total, initial, sys.stderr)
        return
    file = sys.stdout if on_stdout else sys.stderr
    above = redirect_stdout(DummyTqdmFile(sys.stdout)) if on_stdout else nullcontext()
    with tqdm(total=total, initial=initial, disable=not shown, file=file) as bar, above:
        yield bar


def fit(run: Run) -> bool:
    """Train to run.total_steps; False when a signal stopped the run (after saving a checkpoint)."""
    cfg, accelerator, progress = run.cfg, run.accelerator, run.progress
    run.startup.mark()
    if progress.step >= run.total_steps:  # a finished run launched again
        longer = "--time-budget-minutes 0 and a higher --max-steps" if progress.total_steps else "raise --max-steps"
        at = f"{progress.step} of {run.total_steps}"
        if progress.step > run.total_steps:  # launched with fewer steps than it took
            at = f"{progress.step}, past the {run.total_steps} this launch plans"
        accelerator.print(f"the run is at step {at}: nothing to train (to go on, {longer} or --max-tokens; to start "
                          "afresh, --resume never)")  # fmt: skip
    # a resumed run's checkpoint step: its sample, where a kill after the save left it out
    if run.resample and due(cfg.sample_interval, progress.step, run.is_last(progress.step)):
        write_sample(run, progress.step)
    if cfg.eval_interval and progress.step == 0:  # the starting point of the val curve
        accelerator.log(evaluate(run), step=0)
        run.startup.lap("step0_eval")
    stop = StopRequest()
    trainer = trainer_for(run, stop)
    metrics = TrainMetrics(run)
    batches = iter(run.train_loader)
    save_timed = False  # the first save of this launch is timed: what a stop costs
    # a with block: an error or a stop closes the bar before its line is printed, so that line stays the last on screen
    # no bar for a finished run launched again: it has nothing to show
    shown = accelerator.is_local_main_process and progress.step < run.total_steps
    with progress_bar(run.total_steps, progress.step, shown) as bar:
        while progress.step < run.total_steps:
            metrics.step_started()
            with compile_disk_full_reported():  # a step may compile (the first does, under a compiling YAML)
                out = trainer.train_step(batches)
            ran = progress.step + (not trainer.settled)  # the step just run (counted once its verdict is read)
            # Read the step's verdict now only when something happens after it (or it is the first, which is timed).
            if not (metrics.first or trainer.stopping or run.wants(ran)):
                metrics.step_finished(ran)
                continue
            if not trainer.settle():
                continue  # non-finite gradients: update skipped (trainer.settle reported it)
            metrics.step_finished(progress.step)
            if run.budget_due(progress.step) and metrics.step_seconds:
                metrics.decide_budget()  # the time budget's step count: run.total_steps from here on
                bar.total = run.total_steps
            step, last = progress.step, run.is_last(progress.step)
            bar.update(step - bar.n)

            # a stop between log steps logs its step too: the model card counts the steps the checkpoint took
            if metrics.due(step) or trainer.stopping:
                row = metrics.log(step, out)
                speed = {}  # none yet when a run's (or a resume's) first step, which compiles, is all it has timed
                if "tokens_per_sec" in row:
                    speed = {"tok_s": f"{row['tokens_per_sec']:,.0f}", "mfu": f"{row['mfu']:.1%}"}
                bar.set_postfix(loss=f"{row['train_loss']:.3f}", **speed)
            val_loss = None
            if due(cfg.eval_interval, step, last):
                evals = evaluate(run)
                accelerator.log(evals, step=step)
                accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
                val_loss = evals["val_loss"]
            before_decay = run.before_decay(step)  # a longer run branches off there: a resume going back up names it
            if due(cfg.checkpoint_interval, step, last) or last or trainer.stopping or before_decay:
                meta = {
                    "step": step, "tokens_seen": progress.tokens_seen, "val_loss": val_loss,
                    "data": run.manifest.content_digest,  # what val_loss was measured on: other data, another best
                    "before_decay": before_decay,
                }  # fmt: skip
                save_started = time.perf_counter()
                saved = save_checkpoint(
                    accelerator, run.run_dir, step, cfg.keep_checkpoints, meta, run.checkpoint_bytes
                )
                if not save_timed:
                    accelerator.print(grace_period_line(time.perf_counter() - save_started, metrics.last_step_s))
                    save_timed = True
            if due(cfg.sample_interval, step, last):  # after the save: a sample that fails loses no training
                write_sample(run, step)
            if trainer.stopping and not last:
                break
        else:
            # the handler stays: a stop from here on lets the outputs be written whole, which the last save allows
            stop.then = "training is done and saved; writing its outputs (export, model card, Hub push), then exiting"
            return True
    close_trackers(accelerator)  # W&B's closing summary before the line below
    # After the bar's last refresh and on its stream, so this line stays the last on screen: a launcher may pipe
    # stderr through itself while stdout goes straight out (accelerate >= 1.16's one-process launcher does). On every
    # machine: one whose launcher got no signal would otherwise end on the save's line, as if the run had finished.
    if accelerator.is_local_main_process:
        stopped = f"stopped at step {step} by a signal; checkpoint {saved}. To continue, run the same command"
        print(stopped, file=sys.stderr, flush=True)
    return False


def main() -> None:
    startup = StartupClock()  # from the process's start: the imports count too
    stop_with_the_launcher()  # before any work: a launcher stopped during setup stops this process too
    # Ctrl-C interrupts the start-up (the train loop then takes it over: training.signals.StopRequest), also where a
    # launcher was started with the key ignored, which its children inherit (`make train`: its launcher would die of
    # it with a traceback)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stop_at_once_on_sigterm()  # docker stop, a SLURM preemption or the launcher's death during the start-up: one line
    cfg, print_only = parse_config()
    if print_only:
        print(print_config_yaml(cfg), end="")
        return
    pid1_drops_sigterm = pid1_drops_sigterm_line()
    if pid1_drops_sigterm and os.environ.get("LOCAL_RANK", "0") == "0":  # one line per machine (each its container)
        print(pid1_drops_sigterm, file=sys.stderr, flush=True)
    run = setup(cfg, startup)  # accelerator, data, model, optimizer, schedule, prepare(), resume
    try:
        if fit(run):
            write_outputs(run)  # loss.png, export/ with its model card, the Hub push
    except BaseException:
        close_trackers(run.accelerator, failed=True)  # before the error's line, which stays the last on screen
        raise
    finish(run.accelerator)


# Bad input and aborted runs end with one line on stderr (what was wrong, what to do), not a traceback.
USER_ERRORS = (
    ConfigError, DataPrepError, EvalError, HubError, ExportError, TrainingAborted, RunFolderInUse, CheckpointError,
    DiskFull, FileNotFoundError, NotADirectoryError,
)  # fmt: skip


@record  # an unexpected exception's traceback goes to torchelastic's error file, which the launcher's summary shows
def run_main() -> None:
    try:
        try:
            main()
        finally:
            ignore_further_stops()  # what follows is the exit: its one line, then the interpreter's teardown
    except IsADirectoryError as err:  # a folder where a run's file goes (samples.txt, loss.png: renamed onto)
        report_error(
            f"error: {err.filename2 or err.filename} is a folder where this run writes a file: move it aside, then run "
            "the same command again"
        )
        exit_process(1)
    except USER_ERRORS as err:
        report_error(f"error: {err}")
        exit_process(1)
    except KeyboardInterrupt as err:  # at start-up, or a second Ctrl-C in training (training.signals.StopRequest)
        # a message of its own where the interrupted work says what it kept (data_prep.prepare.PreparationInterrupted)
        # Terminated: SIGTERM (also where the preparation of the default corpus said what it kept, its own line)
        terminated = isinstance(err, Terminated) or isinstance(err.__context__, Terminated)
        said = "SIGTERM received during the start-up" if terminated else "interrupted"
        plain = f"{said}: nothing more was saved; the same command continues from the run's last checkpoint, if any"
        report_error(str(err) or plain)
        exit_process(143 if terminated else 130)  # 128 + the signal's number, as a shell reports it
    except RuntimeError as err:
        # another machine's process gone mid-collective: gloo's traceback on this one named neither what nor what next
        if gone := lost_peer(err):
            report_error(
                f"error: lost the connection to another process of this run ({gone}): its machine's output says why it "
                "stopped; once every machine is up again, run the same command on each to continue from the newest "
                "checkpoint"
            )
            exit_process(1)
        if not is_out_of_memory(err):  # where one process could not halve its micro-batch (training.step)
            raise
        report_error(
            f"error: out of memory ({str(err).splitlines()[0]}); lower --micro-batch-size (total_batch_tokens stays, "
            "accumulation grows) or find the largest that fits with `python -m bench.ladder`"
        )
        exit_process(1)


if __name__ == "__main__":
    run_main()
