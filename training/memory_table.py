"""Per-GPU memory of a model's training state (each preset's, or a shape of your own) under DDP, FSDP2, DeepSpeed
ZeRO-2 and ZeRO-3, as Markdown.

    python -m training.memory_table [--gpus 8] [--micro-batch-size 16] [--presets gpt2-774m,gpt2-1558m]
                                    [--optimizer adamw]
    python -m training.memory_table --n-layer 24 --n-head 16 --n-embd 1024 --block-size 2048   # your own shape
    python -m training.memory_table --config configs/gpt2_350m_pg19.yaml                      # a run config's

--n-layer, --n-head, --n-embd and --block-size set a shape over the preset as train_accel.py's do (over
train_accel.py's default preset unless --presets names others); --config sizes the model a run config names, at
its micro_batch_size (a number) and optimizer unless the flags give others.

Arithmetic from the parameter count, for the bf16 accelerate configs (8xh100*.yaml) and our optimizers:
- DDP: fp32 weights (bf16 autocast), fp32 gradients and the optimizer's fp32 state, all whole on every GPU: under
  the default recipe Muon's one momentum for the blocks' matrices (most of the parameters) and AdamW's two moments
  for the rest; under --optimizer adamw two moments for every parameter.
- FSDP2: the same fp32 weights, gradients and AdamW's moments (Muon needs whole matrices: the sharded engines train
  with AdamW), each split over the GPUs (bf16 is the compute copy).
- ZeRO-2 / ZeRO-3 (DeepSpeed bf16 mode): bf16 weights (whole / split) and bf16 gradients (split); the optimizer
  holds the fp32 master weights and both moments, split: the ZeRO paper's 2 + 2 + 12 bytes per parameter.
Not counted: transient buffers (FSDP2's all-gathered bf16 blocks, ZeRO-3's gathered layers, DDP's gradient
buckets, autocast's bf16 weight copies, the fused loss's fp32 head gradient), the CUDA context and allocator
fragmentation: budget a few GiB more. No engine shards activations: their column is an estimate (see
activation_bytes), the same for all four, without and with activation checkpointing
(`--activation-checkpointing true`); lower --micro-batch-size (accumulation keeps the batch) to cut it too.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from typing import Any

import torch

from data_prep import at_least
from modeling.config import PRESETS, GPTConfig
from modeling.gpt import GPT
from modeling.runs import SHAPE_FLAGS, shape_name
from training.config import ConfigError, TrainConfig, load_yaml

GIB = 2**30


@dataclass(frozen=True)
class State:
    """One part of the training state: bytes per parameter, and whether the engine splits it over the GPUs."""

    bytes_per_param: int
    sharded: bool

    def per_gpu(self, params: int, gpus: int) -> float:
        return self.bytes_per_param * params / (gpus if self.sharded else 1)


@dataclass(frozen=True)
class Engine:
    weights: State
    grads: State
    optimizer: State  # AdamW's exp_avg and exp_avg_sq (8 B), plus the fp32 master weights where kept apart (4 B)


MUON_SAVES = 4  # bytes a parameter: Muon keeps one fp32 momentum buffer where AdamW keeps two moments


ENGINES: dict[str, Engine] = {
    "DDP": Engine(weights=State(4, False), grads=State(4, False), optimizer=State(8, False)),
    "FSDP2": Engine(weights=State(4, True), grads=State(4, True), optimizer=State(8, True)),
    "ZeRO-2": Engine(weights=State(2, False), grads=State(2, True), optimizer=State(12, True)),
    "ZeRO-3": Engine(weights=State(2, True), grads=State(2, True), optimizer=State(12, True)),
}


def param_counts(config: GPTConfig) -> tuple[int, int]:
    """The model's parameter count (tied embedding counted once) and how many of them the default recipe gives Muon
    (the blocks' matrices: GPT.optimizer_groups), from the model built on the meta device: no memory, no init."""
    with torch.device("meta"):
        model = GPT(config)
    groups = model.optimizer_groups(0.0, muon=True)
    return model.num_params(), sum(p.numel() for group in groups if group["name"] == "muon" for p in group["params"])


def state_bytes(params: int, engine: str, gpus: int, muon: int = 0) -> dict[str, float]:
    """Bytes each GPU holds for weights, gradients and optimizer state, and their total; `muon` of the parameters
    under Muon (one process or DDP only), the rest under AdamW."""
    layout = ENGINES[engine]
    if muon and layout.optimizer.sharded:
        raise ValueError(f"{engine} shards each matrix and Muon needs whole ones: its runs train with AdamW")
    out = {name: getattr(layout, name).per_gpu(params, gpus) for name in ("weights", "grads", "optimizer")}
    out["optimizer"] -= MUON_SAVES * muon
    out["total"] = sum(out.values())
    return out


def activation_bytes(config: GPTConfig, micro_batch_size: int, checkpointed: bool = False) -> int:
    """Activations saved for backward per GPU, one micro-batch at full context: 36·T·B·C bytes per block.

    36 is what autograd saves per token and channel for our Block under bf16 autocast, measured with
    torch.autograd.graph.saved_tensors_hooks (Korthikanti et al. 2022 count 34 for an all-16-bit block; our
    residual stream and LayerNorm inputs stay fp32). SDPA's fused kernels keep no T×T scores and the fused loss
    no logits, so nothing grows with T² or the vocabulary (compiled on CUDA the loss takes the full logits:
    training.micro_batch adds them). With activation checkpointing each block keeps only
    its fp32 input (4·T·B·C), and backward holds one block's 36·T·B·C at a time while it recomputes it."""
    per_block = config.block_size * micro_batch_size * config.n_embd
    if checkpointed:
        return 4 * per_block * config.n_layer + 36 * per_block
    return 36 * per_block * config.n_layer


def markdown_table(models: dict[str, GPTConfig], gpus: int, micro_batch_size: int, optimizer: str = "muon") -> str:
    """The table's rows for each model, by the name its rows show."""
    optimizers = "Muon + AdamW under DDP, AdamW sharded" if optimizer == "muon" else "AdamW"
    lines = [
        f"Per-GPU memory (GiB) with {gpus} GPUs, bf16 mixed precision, {optimizers}; activations (estimated, the "
        f"same for every engine) at micro-batch {micro_batch_size} × full context.",
        "",
        "| model | params | engine | weights | grads | optimizer | states total | activations | checkpointed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, config in models.items():
        params, muon_count = param_counts(config)
        activations = activation_bytes(config, micro_batch_size) / GIB
        checkpointed = activation_bytes(config, micro_batch_size, checkpointed=True) / GIB
        muon = muon_count if optimizer == "muon" else 0
        for engine in ENGINES:
            b = state_bytes(params, engine, gpus, 0 if ENGINES[engine].optimizer.sharded else muon)
            lines.append(
                f"| {name} | {params / 1e6:,.1f}M | {engine} | {b['weights'] / GIB:.2f} | {b['grads'] / GIB:.2f} | "
                f"{b['optimizer'] / GIB:.2f} | {b['total'] / GIB:.2f} | {activations:.1f} | {checkpointed:.1f} |"
            )
    return "\n".join(lines)


def run_models(presets: list[str] | None, values: dict[str, Any], shape: dict[str, int]) -> dict[str, GPTConfig]:
    """The models to size, by name: each preset (None: the run config's, else train_accel.py's default) with the
    run config's `values` and then `shape` set over it, checked as training checks them (ConfigError, its line)."""
    models = {}
    for preset in presets or [values.get("preset", TrainConfig.preset)]:
        run = TrainConfig(**{**values, "preset": preset, **shape})  # its checks are the run's: one ConfigError line
        shape_fields = (getattr(run, name) for name in SHAPE_FLAGS)
        models[shape_name(run.init_from or run.preset, *shape_fields)] = run.model_config()
    return models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.memory_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gpus", type=at_least(1), default=8, help="GPUs sharing the model (the total over machines)")
    parser.add_argument(
        "--micro-batch-size",
        type=at_least(1),
        help=f"sequences per GPU per forward (default: --config's where it gives a number, else "
        f"{TrainConfig.micro_batch_size})",
    )
    parser.add_argument(
        "--presets",
        help="comma list of presets (default: all; with a shape flag or --config, train_accel.py's default preset or "
        "the run config's)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["muon", "adamw"],
        help=f"as train_accel.py's --optimizer (default: --config's, else {TrainConfig.optimizer})",
    )
    helps = {f.name: f.metadata["help"] for f in fields(TrainConfig)}
    for name in SHAPE_FLAGS:  # both spellings, as train_accel.py takes them
        parser.add_argument(f"--{name.replace('_', '-')}", f"--{name}", dest=name, type=int, help=helps[name])
    parser.add_argument("--config", help="a run-config YAML (train_accel.py's --config): size the model it names")
    args = parser.parse_args(argv)
    shape = {name: getattr(args, name) for name in SHAPE_FLAGS if getattr(args, name) is not None}
    presets = None
    if args.presets is not None or not (shape or args.config):
        presets = list(dict.fromkeys(p.strip() for p in (args.presets or ",".join(PRESETS)).split(",") if p.strip()))
        if not presets:  # each once, in order
            parser.error(f"--presets names no preset; give a comma list of: {', '.join(PRESETS)}")
    try:
        values = load_yaml(args.config) if args.config else {}
        models = run_models(presets, values, shape)
    except ConfigError as err:  # an unknown preset (naming the valid ones), a bad shape or run config: training's line
        sys.exit(f"error: {err}")
    micro_batch_size = values.get("micro_batch_size")  # auto is decided at start-up, from the GPU's free memory
    if args.micro_batch_size is not None or not isinstance(micro_batch_size, int):
        micro_batch_size = args.micro_batch_size or TrainConfig.micro_batch_size
    optimizer = args.optimizer or values.get("optimizer", TrainConfig.optimizer)
    print(markdown_table(models, args.gpus, micro_batch_size, optimizer))


if __name__ == "__main__":
    main()
