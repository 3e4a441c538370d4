"""Per-GPU memory of each preset's training state under DDP, FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, as Markdown.

    python -m training.memory_table [--gpus 8] [--micro-batch-size 16] [--presets gpt2-774m,gpt2-1558m]
                                    [--optimizer adamw]

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
from dataclasses import dataclass

import torch

from modeling.config import PRESETS, GPTConfig, get_preset
from modeling.gpt import GPT
from training.config import TrainConfig

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


def markdown_table(presets: list[str], gpus: int, micro_batch_size: int, optimizer: str = "muon") -> str:
    optimizers = "Muon + AdamW under DDP, AdamW sharded" if optimizer == "muon" else "AdamW"
    lines = [
        f"Per-GPU memory (GiB) with {gpus} GPUs, bf16 mixed precision, {optimizers}; activations (estimated, the "
        f"same for every engine) at micro-batch {micro_batch_size} × full context.",
        "",
        "| preset | params | engine | weights | grads | optimizer | states total | activations | checkpointed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for preset in presets:
        config = get_preset(preset)
        params, muon_count = param_counts(config)
        activations = activation_bytes(config, micro_batch_size) / GIB
        checkpointed = activation_bytes(config, micro_batch_size, checkpointed=True) / GIB
        muon = muon_count if optimizer == "muon" else 0
        for engine in ENGINES:
            b = state_bytes(params, engine, gpus, 0 if ENGINES[engine].optimizer.sharded else muon)
            lines.append(
                f"| {preset} | {params / 1e6:,.1f}M | {engine} | {b['weights'] / GIB:.2f} | {b['grads'] / GIB:.2f} | "
                f"{b['optimizer'] / GIB:.2f} | {b['total'] / GIB:.2f} | {activations:.1f} | {checkpointed:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m training.memory_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--gpus", type=int, default=8, help="GPUs sharing the model (the total over machines)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=TrainConfig.micro_batch_size, help="sequences per GPU per forward"
    )
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma list of presets (default: all)")
    parser.add_argument(
        "--optimizer", choices=["muon", "adamw"], default=TrainConfig.optimizer, help="as train_accel.py's --optimizer"
    )
    args = parser.parse_args(argv)
    if args.gpus < 1 or args.micro_batch_size < 1:
        parser.error("--gpus and --micro-batch-size must be >= 1")
    presets = list(dict.fromkeys(p.strip() for p in args.presets.split(",") if p.strip()))  # each once, in order
    if not presets:
        parser.error(f"--presets names no preset; give a comma list of: {', '.join(PRESETS)}")
    for preset in presets:
        try:
            get_preset(preset)
        except ValueError as err:
            parser.error(str(err))  # names the valid presets
    print(markdown_table(presets, args.gpus, args.micro_batch_size, args.optimizer))


if __name__ == "__main__":
    main()
