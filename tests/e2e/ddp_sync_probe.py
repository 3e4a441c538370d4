"""Launched by test_ddp_compile.py: the run's own setup() and train_step, with a DDP comm hook that records each
gradient all-reduce (and still performs it) and whether it came at a micro-batch that should only accumulate.

Prints one JSON line on the main process: the number of graphs dynamo compiled, the per-step losses (mean over
ranks) and, per optimizer step, the number of all-reduces and how many of them came while
accelerator.sync_gradients was False (no_sync lost)."""

import gc
import json

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from modeling.runtime import finish
from training.config import parse_config
from training.loop import setup, trainer_for


def main() -> None:
    cfg, _ = parse_config()
    run = setup(cfg)  # builds the sampler (generation_model) as every training run does
    accelerator = run.accelerator
    calls: list[bool] = []  # one entry per all-reduce: sync_gradients at the time
    # The DDP wrapper the run built, found by type: wherever the compile wrapper's _orig_mod points now. Compiled per
    # block, the prepared model is a shallow copy of the DDP wrapper (accelerate's compile_regions): one reducer.
    ddps = list({id(o.reducer): o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)}.values())
    for ddp in ddps:
        # DDP checks the hook's annotations
        def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            calls.append(accelerator.sync_gradients)
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(None, hook)
    trainer = trainer_for(run, stop=False)
    batches = iter(run.train_loader)
    losses, per_step = [], []
    for _ in range(run.total_steps):
        before = len(calls)
        out = trainer.train_step(batches)
        assert trainer.settle(), "non-finite step"
        losses.append(accelerator.reduce(out.loss, "mean").item())
        step_calls = calls[before:]
        per_step.append({"all_reduces": len(step_calls), "while_accumulating": step_calls.count(False)})
    if accelerator.is_main_process:
        graphs = counters["stats"]["unique_graphs"]  # dynamo's: 0 where the launch compiled nothing
        print(json.dumps({"ddp_modules": len(ddps), "graphs": graphs, "losses": losses, "steps": per_step}), flush=True)
    finish(accelerator)


if __name__ == "__main__":
    main()
