"""Pretrain a GPT-2-class model on books with Hugging Face Accelerate.

    accelerate launch --config_file accelerate_configs/4xa100.yaml train_accel.py [--config configs/x.yaml] [--flags]

Precision (bf16), torch.compile and DDP/FSDP/DeepSpeed come from the accelerate YAML; everything else from
training.config.TrainConfig (defaults < --config file < flags; `--print-config` shows the result).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from data_prep import DataPrepError
from data_prep.loader import TokenLoader, load_manifest
from data_prep.tokenizer import get_encoding
from evals import EvalError
from evals.data import load_examples
from evals.plot import plot_evals
from evals.runner import evaluate_tasks, parse_tasks
from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from training.checkpoint import TrainProgress, ensure_writable, list_checkpoints, resolve_resume, save_checkpoint
from training.config import DEFAULT_DATA_DIR, ConfigError, TrainConfig, config_to_yaml, grad_accum_steps, parse_config
from training.distributed import build_accelerator, clip_grad_norm, finish, generation_model
from training.hub import HubError, push, require_token, write_model_card
from training.metrics import (
    JSONLTracker,
    cpu_precision_hint,
    memory_stats,
    peak_tflops,
    plot_losses,
    precision_name,
)
from training.optim import build_optimizer, build_scheduler
from training.signals import StopRequest


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_loader: TokenLoader, cfg: TrainConfig, accelerator: Accelerator) -> dict:
    """Val loss over the first `eval_batches` val micro-batches of every rank (a fixed set, so evals compare),
    plus the `eval_tasks` benchmark scores; the same numbers on every rank."""
    model.eval()
    losses = []
    for _, (x, y) in zip(range(cfg.eval_batches), val_loader):
        _, loss = model(x.to(accelerator.device), y.to(accelerator.device))
        losses.append(loss)
    model.train()
    metrics = {"val_loss": accelerator.reduce(torch.stack(losses).mean(), "mean").item()}
    if cfg.eval_tasks:
        metrics.update(evaluate_tasks(model, accelerator, cfg.eval_tasks, cfg.eval_limit, get_encoding()))
    return metrics


def main() -> None:
    t_main = time.perf_counter()
    cfg, print_only = parse_config()
    if print_only:
        print(config_to_yaml(cfg), end="")
        return
    run_dir = Path(cfg.out_dir)
    ensure_writable(run_dir)
    if cfg.push_to_hub:
        require_token()  # fail now, not after days of training
    model_config = get_preset(cfg.preset)
    if cfg.block_size is not None:
        if cfg.block_size > model_config.block_size:
            raise ConfigError(
                f"block_size={cfg.block_size} exceeds the {cfg.preset} preset's {model_config.block_size} positions"
            )
        model_config = dataclasses.replace(model_config, block_size=cfg.block_size)
    block_size = model_config.block_size

    # Accelerator: precision, compile and distribution come from the launch YAML.
    trackers = [t.strip() for t in cfg.trackers.split(",") if t.strip()]
    accelerator = build_accelerator(
        micro_batch_size=cfg.micro_batch_size,
        grad_clip=cfg.grad_clip,
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, not micro-steps × processes
        log_with=[JSONLTracker(run_dir), *trackers],
        project_dir=str(run_dir),
    )
    world_size = accelerator.num_processes
    grad_accum = grad_accum_steps(cfg.total_batch_tokens, cfg.micro_batch_size, block_size, world_size)
    accelerator.gradient_accumulation_steps = grad_accum
    device = accelerator.device
    set_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere+; no effect on CPU
    torch.backends.cudnn.allow_tf32 = True

    # Data: prepared shards are the contract with data_prep; the default corpus is prepared on first use.
    if cfg.data_dir == DEFAULT_DATA_DIR and not (Path(cfg.data_dir) / "manifest.json").exists():
        with accelerator.main_process_first():
            if accelerator.is_main_process:
                from data_prep.prepare import prepare  # imports `datasets`, needed only to build shards

                accelerator.print(f"{cfg.data_dir} has no manifest: preparing the default corpus there")
                prepare("default", cfg.data_dir)
    manifest = load_manifest(cfg.data_dir)
    if cfg.eval_tasks:  # provision and verify benchmark data now, not at the first eval
        with accelerator.local_main_process_first():
            for task in parse_tasks(cfg.eval_tasks):
                load_examples(task, cfg.eval_limit)
    if manifest.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"{cfg.data_dir} was tokenized with a {manifest.vocab_size}-id vocabulary but the {cfg.preset} model "
            f"has {model_config.vocab_size} embeddings; prepare the data with the GPT-2 tokenizer"
        )
    loader_args = dict(rank=accelerator.process_index, world_size=world_size, seed=cfg.seed)
    train_loader = TokenLoader(
        cfg.data_dir, "train", block_size, cfg.micro_batch_size, **loader_args,
        num_workers=cfg.num_workers, pin_memory=device.type == "cuda",
    )  # fmt: skip
    val_loader = TokenLoader(
        cfg.data_dir, "val", block_size, cfg.micro_batch_size, **loader_args, shuffle=False, infinite=False
    )

    # Model, optimizer, schedule, then one prepare() that applies the launch YAML's engine to them.
    model = GPT(model_config)
    param_groups = model.optimizer_groups(cfg.weight_decay)
    optimizer = build_optimizer(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), device_type=device.type)
    total_steps = cfg.total_steps()
    scheduler = build_scheduler(
        optimizer, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio
    )
    flops_per_token = model.flops_per_token()
    num_params = model.num_params()  # before prepare(): ZeRO-3 leaves each rank's parameters empty
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    sampler = generation_model(accelerator, model)
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress, train_loader)

    # Resume: model, optimizer, schedule, RNG, counters and the exact data position, as one unit.
    resume_from = resolve_resume(cfg.resume, run_dir)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        accelerator.print(f"resumed from {resume_from} at step {progress.step}")

    peak, peak_source = peak_tflops(device, accelerator.mixed_precision, cfg.peak_tflops)
    if device.type == "cpu" and cfg.peak_tflops is None and accelerator.is_main_process:
        hint = cpu_precision_hint(accelerator.mixed_precision, peak)  # fp32 or bf16: which is faster here?
        if hint:
            accelerator.print(hint)
    run_info = {
        **dataclasses.asdict(cfg),
        "grad_accum_steps": grad_accum,
        "world_size": world_size,
        "mixed_precision": accelerator.mixed_precision,
        "dynamo_backend": str(accelerator.state.dynamo_plugin.backend),
        "params": num_params,
        "peak_tflops_per_device": peak,
        "peak_tflops_source": peak_source,
    }
    accelerator.init_trackers("bookgpt", config={k: v for k, v in run_info.items() if v is not None})
    if accelerator.is_main_process:
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    accelerator.print(
        f"{cfg.preset}: {run_info['params']:,} params | {world_size} process(es) on {device.type}, "
        f"{precision_name(accelerator.mixed_precision)}, dynamo {run_info['dynamo_backend']} | "
        f"{cfg.micro_batch_size} × {block_size} tokens × {grad_accum} accumulation × {world_size} = "
        f"{cfg.total_batch_tokens:,} tokens/step | {total_steps} steps | "
        f"{manifest.num_tokens('train'):,} train tokens ({len(train_loader)} micro-batches/epoch/rank) | "
        f"MFU against {peak:.3g} TFLOP/s per device ({peak_source}) | "
        + ", ".join(f"{len(g['params'])} tensors {g['name']} (wd {g['weight_decay']})" for g in param_groups)
    )

    if cfg.eval_interval and progress.step == 0:  # the starting point of the val curve
        accelerator.log(evaluate(model, val_loader, cfg, accelerator), step=0)
    stop = StopRequest()
    train_iter = iter(train_loader)
    bar = tqdm(total=total_steps, initial=progress.step, disable=not accelerator.is_local_main_process)
    train_time, steps_timed = 0.0, 0  # training time since the last log; evals, samples and saves excluded
    start_step = progress.step
    bad_steps = 0  # consecutive steps skipped for non-finite gradients
    while progress.step < total_steps:
        t_step = time.perf_counter()
        # One optimizer step = grad_accum micro-batches; accumulate() skips the DDP all-reduce until the last.
        loss_sum = torch.zeros((), device=device)
        for _ in range(grad_accum):
            x, y = next(train_iter)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with accelerator.accumulate(model):
                _, loss = model(x, y)
                accelerator.backward(loss)
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm(accelerator, model, cfg.grad_clip)
        progress.tokens_seen += cfg.total_batch_tokens
        # The one host sync per step: are the (all-reduced) gradients finite, and did any rank get a signal?
        status = torch.stack([~torch.isfinite(grad_norm), torch.tensor(bool(stop), device=device)]).float()
        nonfinite, stopping = (v > 0 for v in accelerator.reduce(status, "sum").tolist())
        if nonfinite:  # skip the update, keep the weights; abort when it keeps happening
            optimizer.zero_grad(set_to_none=True)
            bad_steps += 1
            accelerator.print(
                f"step {progress.step + 1}: non-finite loss/gradients, update skipped ({bad_steps} in a row)"
            )
            if bad_steps >= cfg.max_bad_steps:
                raise TrainingAborted(cfg.max_bad_steps, progress.step, list_checkpoints(run_dir))
            continue
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bad_steps = 0
        progress.step += 1
        bar.update(1)
        last = progress.step == total_steps
        if progress.step == start_step + 1:  # launch to first optimizer step: data, model build, compile
            accelerator.log({"time_to_first_step_s": time.perf_counter() - t_main}, step=progress.step)

        train_time += time.perf_counter() - t_step
        steps_timed += 1
        if progress.step % cfg.log_interval == 0 or last:
            train_loss = accelerator.reduce(loss_sum / grad_accum, "mean").item()
            tokens_per_sec = cfg.total_batch_tokens * steps_timed / train_time
            metrics = {
                "train_loss": train_loss,
                "lr": scheduler.get_last_lr()[0],
                "grad_norm": grad_norm.item(),
                "step_time_s": train_time / steps_timed,
                "tokens_per_sec": tokens_per_sec,
                "tokens_per_sec_per_device": tokens_per_sec / world_size,
                "mfu": flops_per_token * tokens_per_sec / (peak * 1e12 * world_size),
                "tokens_seen": progress.tokens_seen,
                "epoch": train_loader.epoch,
                **memory_stats(device),
            }
            accelerator.log(metrics, step=progress.step)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{metrics['mfu']:.1%}")
            train_time, steps_timed = 0.0, 0

        val_loss = None
        if cfg.eval_interval and (progress.step % cfg.eval_interval == 0 or last):
            evals = evaluate(model, val_loader, cfg, accelerator)
            accelerator.log(evals, step=progress.step)
            accelerator.print(f"step {progress.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in evals.items()))
            val_loss = evals["val_loss"]

        # Every rank samples: with sharded weights (FSDP2, ZeRO-3) generate() gathers them collectively.
        if cfg.sample_interval and (progress.step % cfg.sample_interval == 0 or last):
            write_sample(accelerator, sampler, cfg.sample_prompt, cfg.sample_tokens, run_dir, progress.step)

        if (cfg.checkpoint_interval and progress.step % cfg.checkpoint_interval == 0) or last or stopping:
            meta = {"step": progress.step, "tokens_seen": progress.tokens_seen, "val_loss": val_loss}
            saved = save_checkpoint(accelerator, run_dir, progress.step, cfg.keep_checkpoints, meta)
        if stopping and not last:
            accelerator.print(
                f"stopped at step {progress.step} by a signal; checkpoint {saved}. "
                f"To continue, run the same command with --resume auto"
            )
            finish(accelerator)
            return
    bar.close()

    # The run folder's deliverables: a transformers-loadable export with its model card, the loss curve.
    if accelerator.is_main_process:
        plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png")
        if cfg.eval_tasks:
            plot_evals(run_dir / "metrics.jsonl", run_dir / "evals.png")
    if cfg.export_hf:
        state_dict = accelerator.get_state_dict(model)  # full weights (gathered from shards): every rank calls it
        if accelerator.is_main_process:
            export_model = GPT(model_config)
            export_model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in state_dict.items()})
            export_hf(export_model, run_dir / "export", get_encoding())
            write_model_card(run_dir, cfg.push_to_hub or None)
    accelerator.print(f"run folder: {run_dir} (checkpoints: {len(list_checkpoints(run_dir))}, loss.png, export/)")
    if cfg.push_to_hub and accelerator.is_main_process:
        accelerator.print(f"pushed to {push(run_dir, cfg.push_to_hub)}")
    finish(accelerator)


@torch.no_grad()
def write_sample(
    accelerator: Accelerator, model: torch.nn.Module, prompt: str, tokens: int, run_dir: Path, step: int
) -> None:
    """Greedy-free sample (temperature 1, top-k 50) from the prompt, appended to samples.txt.
    model: the module from training.distributed.generation_model."""
    encoding = get_encoding()
    model.eval()
    idx = torch.tensor([encoding.encode(prompt)], device=accelerator.device)
    generator = torch.Generator(device=accelerator.device).manual_seed(step)
    with accelerator.autocast():
        out = model.generate(idx, tokens, temperature=1.0, top_k=50, generator=generator)
    model.train()
    text = encoding.decode(out[0].tolist())
    if accelerator.is_main_process:
        with (run_dir / "samples.txt").open("a") as f:
            f.write(f"--- step {step} ---\n{text}\n")
    accelerator.print(f"sample @ step {step}: {text!r}")


class TrainingAborted(RuntimeError):
    def __init__(self, bad_steps: int, step: int, checkpoints: list[Path]) -> None:
        last_good = str(checkpoints[-1]) if checkpoints else None
        super().__init__(
            f"non-finite loss/gradients in {bad_steps} consecutive steps after step {step}; aborting. "
            f"Last good checkpoint: {last_good or 'none yet'}. Lower --lr or raise --warmup-steps"
            + (f", then continue with --resume {last_good}" if last_good else "")
        )


# Bad input and aborted runs end with one line on stderr (what was wrong, what to do), not a traceback.
USER_ERRORS = (ConfigError, DataPrepError, EvalError, HubError, TrainingAborted, FileNotFoundError, NotADirectoryError)

if __name__ == "__main__":
    try:
        main()
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except torch.OutOfMemoryError as err:
        print(
            f"error: out of memory ({str(err).splitlines()[0]}); lower --micro-batch-size (total_batch_tokens stays, "
            "accumulation grows) or find the largest that fits with `python -m bench.ladder`",
            file=sys.stderr,
        )
        sys.exit(1)
