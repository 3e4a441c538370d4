"""micro_batch_size auto: the largest micro-batch that fits the device with headroom and divides the step's tokens.

On CUDA the choice comes from training.memory_table's estimate (weights, gradients and optimizer state for the
launch's engine, the activations, and the full logits where the loss takes them: modeling.fused_ce) against the
memory free on the device at start-up, not from a probe of real steps (accelerate's find_executable_batch_size): a
probe compiles a graph per size tried, tens of seconds each on a GPU, where the estimate costs nothing. An estimate
that is short is still caught: one process that runs out of memory redoes the step in smaller slices
(training.step.Trainer). Elsewhere (CPU, MPS) auto is the CPU default, without a probe.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, DynamoBackend

from modeling.config import GPTConfig
from modeling.fused_ce import takes_full_logits
from training.config import grad_accum_steps
from training.memory_table import GIB, activation_bytes, param_counts, state_bytes

GPU_CAP = 64  # llm.c's and modded-nanogpt's micro-batch at GPT-2 124M, T 1024, on an H100
CPU_DEFAULT = 8  # the CPU run configs' (configs/cpu_small.yaml, configs/tiny_cpu.yaml)
# What the estimate misses (allocator fragmentation, autocast's bf16 weight copies, compiled kernels' workspaces):
# on the H100 at gpt2-124m, DDP, B16 and B32, the peak was 1.18-1.21x the estimate (BENCHMARKS.md, "GPU").
ESTIMATE_FACTOR = 1.25
HEADROOM = 0.9  # the share of the free memory the estimated peak may take


def largest_micro_batch(sequences: int, cap: int, fits: Callable[[int], bool] = lambda _: True) -> int:
    """The largest power of two <= cap that divides `sequences` (a step's sequences per process: total_batch_tokens
    / (block_size × processes)) and fits; 1 when no larger one does."""
    size = 1
    while size * 2 <= cap and sequences % (size * 2) == 0 and fits(size * 2):
        size *= 2
    return size


def engine_name(accelerator: Accelerator) -> str:
    """The training.memory_table engine of the launch: DDP (or one process), FSDP2, ZeRO-2 or ZeRO-3."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return "FSDP2"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "ZeRO-3" if accelerator.state.deepspeed_plugin.zero_stage == 3 else "ZeRO-2"
    return "DDP"


def process_state_bytes(config: GPTConfig, engine: str, processes: int, muon: bool) -> float:
    """A process's weights, gradients and optimizer state (training.memory_table; under Muon where `muon`)."""
    params, muon_count = param_counts(config)
    return state_bytes(params, engine, processes, muon_count if muon else 0)["total"]


def estimated_peak_bytes(
    config: GPTConfig, micro_batch: int, states: float, checkpointed: bool, full_logits: bool
) -> float:
    """A process's estimated peak memory in training: its `states` (process_state_bytes), the activations and, where the
    loss takes them, the full bf16 logits, times ESTIMATE_FACTOR."""
    logits = micro_batch * config.block_size * config.vocab_size * 2 if full_logits else 0
    return ESTIMATE_FACTOR * (states + activation_bytes(config, micro_batch, checkpointed) + logits)


def resolve_micro_batch(
    accelerator: Accelerator, config: GPTConfig, total_batch_tokens: int, checkpointed: bool, muon: bool
) -> tuple[int, str]:
    """micro_batch_size auto for this launch (`muon`: its optimizer is the default Muon + AdamW, else AdamW): the
    size, the same on every process (the smallest of their picks), and how it was chosen, in words."""
    processes = accelerator.num_processes
    sequences = grad_accum_steps(total_batch_tokens, 1, config.block_size, processes)
    device = accelerator.device
    if device.type != "cuda":
        size = largest_micro_batch(sequences, CPU_DEFAULT)
        return size, f"the CPU default on {device.type}, not probed"
    free, total = torch.cuda.mem_get_info(device)
    engine = engine_name(accelerator)
    compiled = accelerator.state.dynamo_plugin.backend != DynamoBackend.NO
    states = process_state_bytes(config, engine, processes, muon)  # one meta-device model a launch, not one a size

    def peak(size: int) -> float:
        logits_bytes = size * config.block_size * config.vocab_size * 2
        full = takes_full_logits("cuda", compiled, logits_bytes, total)
        return estimated_peak_bytes(config, size, states, checkpointed, full)

    mine = largest_micro_batch(sequences, GPU_CAP, lambda size: peak(size) <= HEADROOM * free)
    size = int(accelerator.gather(torch.tensor([mine], device=device)).min())
    return size, f"fits: an estimated {peak(size) / GIB:.1f} of {free / GIB:.1f} GiB free, {engine}, cap {GPU_CAP}"
