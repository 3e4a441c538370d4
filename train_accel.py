"""Pretrain a GPT-2-class model on books with Hugging Face Accelerate.

    accelerate launch --config_file accelerate_configs/4xa100.yaml train_accel.py [--config configs/x.yaml] [--flags]

Precision (bf16), torch.compile and DDP/FSDP/DeepSpeed come from the accelerate YAML; everything else from
training.config.TrainConfig (defaults < --config file < flags; `--print-config` shows the result).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from data_prep.loader import TokenLoader, load_manifest
from data_prep.tokenizer import get_encoding
from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.hf_export import export_hf
from training.checkpoint import TrainProgress, list_checkpoints, resolve_resume, save_checkpoint
from training.config import ConfigError, config_to_yaml, grad_accum_steps, parse_config
from training.metrics import JSONLTracker, memory_stats, peak_tflops, plot_losses
from training.optim import build_optimizer, build_scheduler


@torch.no_grad()
def evaluate(model: torch.nn.Module, val_loader: TokenLoader, batches: int, accelerator: Accelerator) -> float:
    """Mean val loss over the first `batches` val micro-batches of every rank (a fixed set, so evals compare)."""
    model.eval()
    losses = []
    for _, (x, y) in zip(range(batches), val_loader):
        _, loss = model(x.to(accelerator.device), y.to(accelerator.device))
        losses.append(loss)
    model.train()
    return accelerator.reduce(torch.stack(losses).mean(), "mean").item()


def main() -> None:
    t_main = time.perf_counter()
    cfg, print_only = parse_config()
    if print_only:
        print(config_to_yaml(cfg), end="")
        return
    run_dir = Path(cfg.out_dir)
    model_config = get_preset(cfg.preset)
    if cfg.block_size is not None:
        if cfg.block_size > model_config.block_size:
            raise ConfigError(
                f"block_size={cfg.block_size} exceeds the {cfg.preset} preset's {model_config.block_size} positions"
            )
        model_config = dataclasses.replace(model_config, block_size=cfg.block_size)
    block_size = model_config.block_size

    # Accelerator: precision, compile and distribution come from the launch YAML. cpu= lets a MULTI_GPU YAML
    # (torchrun, N processes) run real gloo DDP on a machine without CUDA.
    use_cpu = not torch.cuda.is_available()
    world_size = PartialState(cpu=use_cpu).num_processes
    grad_accum = grad_accum_steps(cfg.total_batch_tokens, cfg.micro_batch_size, block_size, world_size)
    trackers = [t.strip() for t in cfg.trackers.split(",") if t.strip()]
    accelerator = Accelerator(
        cpu=use_cpu,
        gradient_accumulation_steps=grad_accum,
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps, not micro-steps × processes
        log_with=[JSONLTracker(run_dir), *trackers],
        project_dir=str(run_dir),
    )
    device = accelerator.device
    set_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls on Ampere+; no effect on CPU
    torch.backends.cudnn.allow_tf32 = True

    # Data: prepared shards are the contract with data_prep; the default corpus is prepared on first use.
    if not (Path(cfg.data_dir) / "manifest.json").exists():
        with accelerator.main_process_first():
            if accelerator.is_main_process:
                from data_prep.prepare import prepare  # imports `datasets`, needed only to build shards

                accelerator.print(f"{cfg.data_dir} has no manifest: preparing source '{cfg.data_source}' there")
                prepare(cfg.data_source, cfg.data_dir)
    manifest = load_manifest(cfg.data_dir)
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
    optimizer = build_optimizer(
        model.optimizer_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), device_type=device.type
    )
    total_steps = cfg.total_steps()
    scheduler = build_scheduler(
        optimizer, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio
    )
    flops_per_token = model.flops_per_token()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress, train_loader)

    # Resume: model, optimizer, schedule, RNG, counters and the exact data position, as one unit.
    resume_from = resolve_resume(cfg.resume, run_dir)
    if resume_from is not None:
        accelerator.load_state(str(resume_from))
        accelerator.print(f"resumed from {resume_from} at step {progress.step}")

    peak, peak_source = peak_tflops(device, accelerator.mixed_precision, cfg.peak_tflops)
    run_info = {
        **dataclasses.asdict(cfg),
        "grad_accum_steps": grad_accum,
        "world_size": world_size,
        "mixed_precision": accelerator.mixed_precision,
        "dynamo_backend": str(accelerator.state.dynamo_plugin.backend),
        "params": accelerator.unwrap_model(model).num_params(),
        "peak_tflops_per_device": peak,
        "peak_tflops_source": peak_source,
    }
    accelerator.init_trackers("bookgpt", config={k: v for k, v in run_info.items() if v is not None})
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    accelerator.print(
        f"{cfg.preset}: {run_info['params']:,} params | {world_size} process(es) on {device.type}, "
        f"{accelerator.mixed_precision} precision, dynamo {run_info['dynamo_backend']} | "
        f"{cfg.micro_batch_size} × {block_size} tokens × {grad_accum} accumulation × {world_size} = "
        f"{cfg.total_batch_tokens:,} tokens/step | {total_steps} steps | "
        f"{manifest.num_tokens('train'):,} train tokens ({len(train_loader)} micro-batches/epoch/rank)"
    )

    if cfg.eval_interval and progress.step == 0:  # the starting point of the val curve
        accelerator.log({"val_loss": evaluate(model, val_loader, cfg.eval_batches, accelerator)}, step=0)
    train_iter = iter(train_loader)
    bar = tqdm(total=total_steps, initial=progress.step, disable=not accelerator.is_local_main_process)
    start_step = progress.step
    train_time, steps_timed = 0.0, 0  # training time since the last log; evals, samples and saves excluded
    first_step_s: float | None = None
    for step in range(start_step, total_steps):
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
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        progress.step += 1
        progress.tokens_seen += cfg.total_batch_tokens
        bar.update(1)
        last = progress.step == total_steps
        if step == start_step:
            first_step_s = time.perf_counter() - t_main

        if progress.step % cfg.log_interval == 0 or last:
            train_loss = accelerator.reduce(loss_sum / grad_accum, "mean").item()  # the one host sync per log
            train_time += time.perf_counter() - t_step
            steps_timed += 1
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
            if first_step_s is not None:  # launch to first optimizer step: data, model build, compile
                metrics["time_to_first_step_s"], first_step_s = first_step_s, None
            accelerator.log(metrics, step=progress.step)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_per_sec:,.0f}", mfu=f"{metrics['mfu']:.1%}")
            train_time, steps_timed = 0.0, 0
        else:
            train_time += time.perf_counter() - t_step
            steps_timed += 1

        if cfg.eval_interval and (progress.step % cfg.eval_interval == 0 or last):
            val_loss = evaluate(model, val_loader, cfg.eval_batches, accelerator)
            accelerator.log({"val_loss": val_loss}, step=progress.step)
            accelerator.print(f"step {progress.step}: val loss {val_loss:.4f}")

        if cfg.sample_interval and (progress.step % cfg.sample_interval == 0 or last) and accelerator.is_main_process:
            write_sample(accelerator, model, cfg.sample_prompt, cfg.sample_tokens, run_dir, progress.step)

        if (cfg.checkpoint_interval and progress.step % cfg.checkpoint_interval == 0) or last:
            save_checkpoint(accelerator, run_dir, progress.step, cfg.keep_checkpoints)
    bar.close()

    # The run folder's deliverables: a transformers-loadable export and the loss curve.
    if accelerator.is_main_process:
        if cfg.export_hf:
            export_dir = export_hf(
                accelerator.unwrap_model(model, keep_torch_compile=False), run_dir / "export", get_encoding()
            )
            accelerator.print(f"transformers export: {export_dir}")
        plot_losses(run_dir / "metrics.jsonl", run_dir / "loss.png")
        accelerator.print(f"run folder: {run_dir} (checkpoints: {len(list_checkpoints(run_dir))}, loss.png)")
    accelerator.end_training()


@torch.no_grad()
def write_sample(
    accelerator: Accelerator, model: torch.nn.Module, prompt: str, tokens: int, run_dir: Path, step: int
) -> None:
    """Greedy-free sample (temperature 1, top-k 50) from the prompt, appended to samples.txt."""
    encoding = get_encoding()
    raw = accelerator.unwrap_model(model, keep_torch_compile=False)
    raw.eval()
    idx = torch.tensor([encoding.encode(prompt)], device=accelerator.device)
    generator = torch.Generator(device=accelerator.device).manual_seed(step)
    with accelerator.autocast():
        out = raw.generate(idx, tokens, temperature=1.0, top_k=50, generator=generator)
    raw.train()
    text = encoding.decode(out[0].tolist())
    with (run_dir / "samples.txt").open("a") as f:
        f.write(f"--- step {step} ---\n{text}\n")
    accelerator.print(f"sample @ step {step}: {text!r}")


if __name__ == "__main__":
    main()
