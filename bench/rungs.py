"""The ladder's rungs: rungs 0-10 as a recipe and each rung's change to it, and rung 11, train_accel.py's own
step under the launch YAML. Each builds a Trainer: one optimizer step on a batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import TorchDynamoPlugin
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from modeling.config import PADDED_VOCAB_SIZE, REAL_VOCAB_SIZE, GPTConfig
from modeling.gpt import GPT
from modeling.reference import GELU, LayerNorm, MultiHeadAttention, ReferenceGPT
from modeling.runtime import set_up_compute
from training.config import TrainConfig
from training.distributed import TRAINED_BACKENDS
from training.metrics import dtype_name
from training.optim import optimizer_for
from training.step import Trainer as StepTrainer

REPO = Path(__file__).resolve().parents[1]
TRAIN = TrainConfig()  # lr, betas, weight decay, clip and seed of the project's default run
StepFn = Callable[[Tensor, Tensor], Tensor]


# --- rungs 0-10: a recipe, and each rung's change to it ---------------------------------------------------------


Edit = Callable[[nn.Module], None]  # an in-place change to the built model


def reference_gpt(config: GPTConfig, vocab_size: int) -> ReferenceGPT:
    return ReferenceGPT(config, vocab_size=vocab_size)


def our_gpt(config: GPTConfig, vocab_size: int) -> GPT:
    return GPT(dataclasses.replace(config, vocab_size=vocab_size))


def plain_adamw(groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    betas = (TRAIN.beta1, TRAIN.beta2)
    return torch.optim.AdamW(groups, lr=TRAIN.lr, betas=betas, eps=1e-8, foreach=False, fused=False)


def fused_adamw(groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    return optimizer_for(TRAIN, groups, device.type)


@dataclass(frozen=True)
class Recipe:
    """What rungs 0-10 train with; ladder_trainer builds it. Each rung's change is a function of the recipe
    before it, written in its RUNGS row."""

    model: Callable[[GPTConfig, int], nn.Module] = reference_gpt  # (shape, vocab size) -> model
    edits: tuple[Edit, ...] = ()  # applied in order to the built model
    vocab_size: int = REAL_VOCAB_SIZE
    optimizer: Callable[[list[dict], torch.device], torch.optim.Optimizer] = plain_adamw
    autocast: torch.dtype | None = None
    tf32: bool = False  # CUDA only
    pin_memory: bool = False  # CUDA only
    compile: bool = False
    largest_batch: bool = False  # rung 10: search the micro-batch

    def edit(self, edit: Edit) -> Recipe:
        return dataclasses.replace(self, edits=(*self.edits, edit))

    def build_model(self, config: GPTConfig) -> nn.Module:
        model = self.model(config, self.vocab_size)
        for edit in self.edits:
            edit(model)
        return model


class OnTheFlyMaskAttention(nn.Module):
    """The reference attention (separate q/k/v, unfused scores-softmax-weighted sum) with the causal mask made per
    call by SDPA's math kernel (is_causal) instead of read from a stored (T, T) buffer."""

    def __init__(self, att: MultiHeadAttention) -> None:
        super().__init__()
        self.num_heads, self.head_dim = att.num_heads, att.head_dim
        self.W_query, self.W_key, self.W_value, self.out_proj = att.W_query, att.W_key, att.W_value, att.out_proj
        self.dropout = att.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2) for w in (
            self.W_query, self.W_key, self.W_value))  # fmt: skip
        with sdpa_kernel(SDPBackend.MATH):  # the fused (flash) kernel is rung 7's change
            ctx = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout.p if self.training else 0.0, is_causal=True
            )
        return self.out_proj(ctx.transpose(1, 2).contiguous().view(b, T, -1))


@torch.no_grad()
def native_layer_norm(ln: LayerNorm) -> nn.LayerNorm:
    native = nn.LayerNorm(ln.scale.numel(), eps=ln.eps)
    native.weight.copy_(ln.scale)
    native.bias.copy_(ln.shift)
    return native


def replace_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[Any], nn.Module]) -> None:
    """Swap every submodule of type `kind` for make(it), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


def on_the_fly_mask(model: nn.Module) -> None:
    replace_modules(model, MultiHeadAttention, OnTheFlyMaskAttention)


def native_norm_gelu(model: nn.Module) -> None:
    replace_modules(model, LayerNorm, native_layer_norm)
    replace_modules(model, GELU, lambda _: nn.GELU(approximate="tanh"))


def cuda_only(why: str) -> Callable[[torch.device], str | None]:
    return lambda device: None if device.type == "cuda" else f"n/a on {device.type}: {why}"


def multi_device_only(device: torch.device) -> str | None:
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if count < 2:
        return f"n/a: one {device.type} device (DDP needs several)"
    return (
        f"n/a in one process: compare tokens_per_sec_per_device of train_accel.py launched on {count} devices "
        "(e.g. accelerate_configs/8xh100.yaml) with rung 11"
    )


class Role(str, Enum):
    """What a row is: the targets compare the full recipe with the baseline and the peer by role, not label."""

    BASELINE = "baseline"
    RUNG = "rung"
    FULL_RECIPE = "full recipe"
    PEER = "peer"


@dataclass(frozen=True)
class Rung:
    index: int
    name: str
    change: str
    apply: Callable[[Recipe], Recipe]  # this rung's change to the recipe of the rung before
    unavailable: Callable[[torch.device], str | None] = lambda device: None  # why it cannot apply, or None
    role: Role = Role.RUNG


same = lambda recipe: recipe
# Rung 11 is no recipe: it is train_accel.py's own step (full_recipe_trainer), whatever rungs 0-10 did.
RUNGS = (
    Rung(0, "baseline", "ReferenceGPT: fp32, stored mask, hand-written LayerNorm/GELU, vocab 50,257, "
         "plain AdamW (foreach=False, fused=False), eager", same, role=Role.BASELINE),
    Rung(1, "mask on the fly", "causal mask made per call (is_causal, SDPA math kernel) instead of the stored "
         "(T, T) buffer", lambda r: r.edit(on_the_fly_mask)),
    Rung(2, "TF32", "TF32 matmuls and convolutions", lambda r: dataclasses.replace(r, tf32=True),
         cuda_only("TF32 is an NVIDIA tensor-core format")),
    Rung(3, "fused AdamW", "training.optim.build_optimizer: AdamW(fused=True)",
         lambda r: dataclasses.replace(r, optimizer=fused_adamw)),
    Rung(4, "pinned memory", "TokenLoader(pin_memory=True, 2 workers) + non_blocking copies",
         lambda r: dataclasses.replace(r, pin_memory=True), cuda_only("pinning only speeds host-to-GPU copies")),
    Rung(5, "bf16 autocast", "torch.autocast(bfloat16), fp32 master weights",
         lambda r: dataclasses.replace(r, autocast=torch.bfloat16)),
    Rung(6, "native LayerNorm/GELU", "nn.LayerNorm and nn.GELU(tanh) instead of the hand-written ones",
         lambda r: r.edit(native_norm_gelu)),
    Rung(7, "SDPA flash attention", "our GPT: fused qkv + SDPA(is_causal), tied head; loss still F.cross_entropy "
         "on the full logits", lambda r: dataclasses.replace(r, model=our_gpt, edits=())),
    Rung(8, "torch.compile", "torch.compile of model + loss", lambda r: dataclasses.replace(r, compile=True)),
    Rung(9, "vocab 50,304", "embedding and head padded to a multiple of 64",
         lambda r: dataclasses.replace(r, vocab_size=PADDED_VOCAB_SIZE)),
    Rung(10, "largest micro-batch", "accelerate find_executable_batch_size from the cap down, then the fastest "
         "micro-batch of base..cap kept", lambda r: dataclasses.replace(r, largest_batch=True)),
    Rung(11, "full recipe", "train_accel.py's train_step at the base micro-batch: accelerate-prepared GPT with the "
         "fused linear-CE loss, fused AdamW, launch YAML's precision and compile", same, role=Role.FULL_RECIPE),
    Rung(12, "DDP scaling", "data parallel over all devices", same, multi_device_only),
)  # fmt: skip


class PlainLoss(nn.Module):
    """Model plus the seed's loss, F.cross_entropy over the full logits, as one module so that torch.compile sees
    both (as in build-nanogpt, whose forward computes the loss)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        if isinstance(self.model, ReferenceGPT):
            return self.model.loss(x, y)
        logits, _ = self.model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@dataclass
class Trainer:
    step: StepFn  # one optimizer step on a batch; returns the detached loss
    model: nn.Module  # the raw model, for the FLOP count
    compiled: bool
    micro_batch_size: int
    precision: str  # "bf16" or "fp32": the matmul dtype, whose peak MFU is taken against
    tf32: bool = False  # TF32 matmuls for this row only (a global flag: set and reset around each row)
    pin_memory: bool = False
    loader_workers: int = 0  # pinning happens in the loader's pin thread only with workers


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """torch's TF32 flags for one row, restored afterwards, so no row inherits another's setting."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def ladder_trainer(
    recipe: Recipe, config: GPTConfig, device: torch.device, micro_batch_size: int, backend: str
) -> Trainer:
    """Rungs 0-10: the recipe's model, loss, autocast and AdamW in a plain training step."""
    model = recipe.build_model(config)
    if isinstance(model, GPT):
        groups = model.optimizer_groups(TRAIN.weight_decay)
    else:
        groups = [{"params": list(model.parameters()), "weight_decay": TRAIN.weight_decay}]  # as the book does
    model.to(device)
    loss_fn: nn.Module = PlainLoss(model)
    if recipe.compile:
        loss_fn = torch.compile(loss_fn, backend=backend, dynamic=False)  # rung 10 recompiles per batch shape
    optimizer = recipe.optimizer(groups, device)
    params = list(model.parameters())

    def step(x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast(device.type, dtype=recipe.autocast or torch.float32, enabled=recipe.autocast is not None):
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, TRAIN.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    cuda = device.type == "cuda"
    pin = recipe.pin_memory and cuda
    precision = "fp32" if recipe.autocast is None else "bf16"
    return Trainer(step, model, recipe.compile, micro_batch_size, precision, recipe.tf32 and cuda, pin, 2 if pin else 0)


def launch_config(path: Path) -> dict[str, Any]:
    """The launch YAML as `accelerate launch` reads it (accelerate's own config loader); where there is none, or
    accelerate's loader rejects it, one `error:` line (the benchmarks' --accelerate-config) instead of a traceback."""
    if not path.is_file():
        raise SystemExit(f"error: --accelerate-config {path}: no such file; give a launch YAML (accelerate_configs/)")
    try:
        return load_config_from_file(str(path)).to_dict()
    except (ValueError, TypeError, yaml.YAMLError) as err:  # a value accelerate lacks, a key it does not know
        raise SystemExit(
            f"error: --accelerate-config {path}: accelerate cannot read it ({type(err).__name__}: "
            f"{' '.join(str(err).split())}); write one with `accelerate config`, or start from accelerate_configs/"
        ) from err


def checked_launch(path: Path, device: torch.device, backend_override: str | None = None) -> dict[str, Any]:
    """A benchmark's launch YAML (launch_config: rung 11's, bench.time_to_loss's), checked before anything is made or
    measured: fp16 on a CPU is one `error:` line, since accelerate leaves it in fp32 (rung 11 would be fp32 under an
    fp16 label, beside a peer that autocasts to fp16 itself); so is a compile backend train_accel.py refuses
    (training.distributed.TRAINED_BACKENDS), unless `backend_override` replaces it."""
    launch = launch_config(path)
    if device.type == "cpu" and launch.get("mixed_precision") == "fp16":
        raise SystemExit(
            f"error: --accelerate-config {path} asks for mixed_precision: fp16, which accelerate does not apply on a "
            "CPU: give accelerate_configs/cpu_bf16.yaml or cpu.yaml"
        )
    backend = dynamo_backend(launch, backend_override).upper()
    if backend not in TRAINED_BACKENDS:
        raise SystemExit(
            f"error: --accelerate-config {path} asks for dynamo_backend: {backend}, which train_accel.py does not "
            "train with: give a YAML with dynamo_backend INDUCTOR or NO (accelerate_configs/)"
        )
    return launch


# The compile backends rung 11's step may be given in place of its YAML's (a benchmark's --dynamo-backend): those
# train_accel.py trains with
STEP_BACKENDS = tuple(backend.lower() for backend in TRAINED_BACKENDS)


def dynamo_backend(launch: dict[str, Any], override: str | None) -> str:
    return override or str((launch.get("dynamo_config") or {}).get("dynamo_backend", "no")).lower()


def compile_backend(launch: dict[str, Any], override: str | None) -> str:
    """The backend of rungs 8-10 and the compiled peer: rung 11's, or inductor where the launch YAML compiles nothing
    (those rows always compile)."""
    backend = dynamo_backend(launch, override)
    return "inductor" if backend == "no" else backend


def full_recipe_trainer(
    config: GPTConfig,
    device: torch.device,
    micro_batch_size: int,
    launch: dict[str, Any],
    backend_override: str | None,
    optimizer: str = "adamw",
) -> Trainer:
    """Rung 11: train_accel.py's model, optimizer (AdamW, as the peers train, so that the ladder compares like
    steps; or "muon", TrainConfig's default) and train_step under the launch YAML's precision and compile, with its
    TF32 setting and its loader (pinned on CUDA, TrainConfig's workers)."""
    dynamo = launch.get("dynamo_config") or {}
    backend = dynamo_backend(launch, backend_override)
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=launch.get("mixed_precision", "no"),
        dynamo_plugin=TorchDynamoPlugin(
            backend=backend.upper(),
            mode=dynamo.get("dynamo_mode"),
            fullgraph=dynamo.get("dynamo_use_fullgraph"),
            dynamic=dynamo.get("dynamo_use_dynamic"),
            use_regional_compilation=dynamo.get("dynamo_use_regional_compilation"),  # the GPU YAMLs': per block
        ),
    )
    set_up_compute(accelerator.device)  # as build_accelerator does for train_accel.py
    model = GPT(config)
    groups = model.optimizer_groups(TRAIN.weight_decay, muon=optimizer == "muon")
    built = optimizer_for(TRAIN, groups, device.type, accelerator.mixed_precision)
    prepared, built = accelerator.prepare(model, built)
    tokens_per_step = micro_batch_size * config.block_size
    trainer = StepTrainer(accelerator, prepared, built, grad_clip=TRAIN.grad_clip, tokens_per_step=tokens_per_step)

    def step(x: Tensor, y: Tensor) -> Tensor:
        return trainer.train_step(iter([(x, y)])).loss

    cuda = device.type == "cuda"
    precision = dtype_name(accelerator.mixed_precision)
    return Trainer(step, model, backend != "no", micro_batch_size, precision, cuda, cuda, TRAIN.num_workers)
