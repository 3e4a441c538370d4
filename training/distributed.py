"""Building the Accelerator: the one place that adapts the launch YAML's engine to the machine."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType, InitProcessGroupKwargs
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor


def _launched_with(engine: str) -> bool:
    """Whether `accelerate launch` selected FSDP or DEEPSPEED from the YAML (it says so in the environment)."""
    return os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true"


def build_accelerator(*, micro_batch_size: int, grad_clip: float, **kwargs: Any) -> Accelerator:
    """An Accelerator for the launch YAML's engine (DDP, FSDP2 or DeepSpeed ZeRO).

    micro_batch_size and grad_clip are the training config's; DeepSpeed must know them before prepare()
    (our loader does not go through prepare, and DeepSpeed clips inside its own step).

    With CUDA this is a plain Accelerator. Without it, accelerate would quietly drop FSDP and DeepSpeed
    YAMLs to DDP (`cpu=True`) or to one process, so the CPU twins of the GPU configs get real sharding over gloo:
    - DeepSpeed: gloo named as the process-group backend (deepspeed.comm initializes it), no `cpu=True`;
    - FSDP: the gloo CPU state accelerate builds for `cpu=True`, presented as MULTI_GPU so that the
      Accelerator applies the FSDP plugin to it (the device stays the CPU).
    """
    if not torch.cuda.is_available():
        if _launched_with("DEEPSPEED"):
            kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []), InitProcessGroupKwargs(backend="gloo")]
        elif _launched_with("FSDP"):
            state = PartialState(cpu=True)
            if state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.MULTI_GPU
        else:
            kwargs["cpu"] = True  # a MULTI_GPU YAML (accelerate's torchrun launcher) runs DDP over gloo
    accelerator = Accelerator(**kwargs)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _set_deepspeed_values(accelerator, train_micro_batch_size_per_gpu=micro_batch_size, gradient_clipping=grad_clip)
    return accelerator


def _set_deepspeed_values(accelerator: Accelerator, **values: float) -> None:
    """Fill the DeepSpeed config's 'auto' (or missing) entries with the training config's values; a YAML or
    DeepSpeed JSON that sets one of them differently is an error, since the training config owns them."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    for key, value in values.items():
        if ds_config.get(key, "auto") == "auto":
            ds_config[key] = value
        elif ds_config[key] != value:
            raise ValueError(
                f"the DeepSpeed config sets {key}={ds_config[key]} but the training config says {value}; "
                f"set it in the training config and leave it 'auto' (or out) in the DeepSpeed config"
            )


def clip_grad_norm(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to max_norm (0: no clipping) and return their global norm before clipping, as a plain
    scalar tensor on the device whatever the engine: FSDP2 returns a replicated DTensor, and DeepSpeed, which
    clips inside its own step (at the gradient_clipping set by build_accelerator), a float."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    if isinstance(norm, DTensor):
        return norm.full_tensor()
    return torch.as_tensor(norm, dtype=torch.float32, device=accelerator.device)


def enable_generate(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Let the prepared model's generate() run under FSDP2, which gathers its sharded parameters only around
    forward(); a no-op for the other engines. Call it once, after prepare(). With sharded weights (FSDP2,
    ZeRO-3) generate() then gathers them with collectives, so every rank must call it, not just the main one."""
    raw = accelerator.unwrap_model(model, keep_torch_compile=False)
    if isinstance(raw, FSDPModule):
        register_fsdp_forward_method(raw, "generate")
