"""Building the Accelerator: the one place that adapts the launch YAML's engine to the machine."""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DistributedType,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    InitProcessGroupKwargs,
    broadcast_object_list,
    gather_object,
    get_int_from_env,
)

from data_prep import DataPrepError
from data_prep.manifest import Manifest, load_manifest
from modeling.device import accelerator_needs_cpu, quiet_deepspeed
from modeling.gpt import GPT, Block
from modeling.runtime import joined, set_up_compute
from training.compile_cache import check_build_tools, set_up_compile_cache
from training.config import ConfigError
from training.signals import one_process_launcher

T = TypeVar("T")


def _yaml_says(flag: str) -> bool:
    """Whether the environment `accelerate launch` sets from the YAML has `flag` "true" (as accelerate reads it)."""
    return os.environ.get(flag, "false").lower() == "true"


def _launched_with(engine: str) -> bool:
    """Whether `accelerate launch` selected FSDP or DEEPSPEED from the YAML (it says so in the environment)."""
    return _yaml_says(f"ACCELERATE_USE_{engine}")


def yaml_activation_checkpointing() -> bool:
    """Whether the launch YAML's fsdp_config says `fsdp_activation_checkpointing: true` (`accelerate config` asks).
    The run takes it as --activation-checkpointing true: the model recomputes each Block itself, as under every
    other engine, so `--micro-batch-size auto` sizes for it and config.yaml says so; fsdp_plugin turns accelerate's
    own wrapper off, which would checkpoint each Block a second time."""
    return _launched_with("FSDP") and _yaml_says("FSDP_ACTIVATION_CHECKPOINTING")


def no_gpu_note(device: torch.device) -> str | None:
    """A one-process launch for a GPU (the YAML's `use_cpu: false`, as 1xgpu.yaml and `accelerate config` on a GPU
    machine write it) that finds none trains on the CPU, a GPU recipe at a CPU's speed: said at once, with why (a
    CPU-only torch, or a CUDA torch that sees no GPU). accelerate's one-process launcher says use_cpu in
    ACCELERATE_USE_CPU; other launches (several processes, `python train_accel.py`) are left alone."""
    if device.type != "cpu" or os.environ.get("ACCELERATE_USE_CPU", "").lower() != "false":
        return None
    return f"note: the launch YAML is for a GPU (use_cpu: false), but {why_no_gpu()}: this run trains on the CPU"


def why_no_gpu() -> str:
    """Why torch finds no CUDA GPU here, and what to check (scripts/gpu_first_light.sh says it too)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch for the GPU)"
    return f"torch {torch.__version__} sees no GPU (check the driver with nvidia-smi, and CUDA_VISIBLE_DEVICES)"


# torch.compile's compiler, and dynamo's two debugging backends (graphs traced, then run eagerly)
TRAINED_BACKENDS = ("NO", "INDUCTOR", "EAGER", "AOT_EAGER")


def check_launch() -> None:
    """What `accelerate launch` read from the YAML (or its flags) that this project does not run: one ConfigError,
    at the start of setup, before anything is written."""
    if _launched_with("FSDP"):
        _check_fsdp_yaml()
    _check_gpu_count()
    _check_one_process_launcher()
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower()  # the YAML's use_cpu, as the one-process launcher says
    if precision == "fp16" and (use_cpu == "true" or accelerator_needs_cpu()):
        # accelerate autocasts to fp16 on GPUs only: on a CPU the run trained fp32 while its first line, logs and
        # model card said fp16; DeepSpeed's CPU accelerator refused it in prepare(), with a traceback on every rank
        if _launched_with("DEEPSPEED"):
            why = "which DeepSpeed does not run on a CPU"
        else:
            why = "which accelerate does not apply on a CPU: the run would train in fp32"
        if use_cpu == "false":
            why += f", and the YAML is for a GPU, but {why_no_gpu()}"
        raise ConfigError(
            f"the launch asks for mixed_precision: fp16, {why}; set mixed_precision: bf16 where this CPU's bf16 is "
            "fast (cpu_bf16.yaml; `python -m training.pick_cpu_config` names the faster YAML) or no (cpu.yaml), or "
            "pass --mixed_precision bf16 to accelerate launch"
        )
    # accelerate config offers every backend dynamo had; the others failed at prepare() (not in this torch:
    # onnxrt) or at the first step (not installed: tvm) with dynamo's traceback, or were never measured (cudagraphs)
    backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()
    if backend not in TRAINED_BACKENDS:
        raise ConfigError(
            f"the launch asks for dynamo_backend: {backend}, which this project does not train with: set "
            "dynamo_backend: INDUCTOR in the YAML (torch.compile's own compiler, which the project's YAMLs use) or "
            "NO, or pass --dynamo_backend inductor to accelerate launch"
        )
    # accelerate's fp8 swaps every Linear for Transformer Engine's, torchao's or MS-AMP's: weights of their own
    # tensor types, which the checkpoints (safetensors) cannot hold (torchao's run trained, then failed at its
    # first save) and whose numerics no test here covers
    if precision == "fp8":
        raise ConfigError(
            "the launch asks for mixed_precision: fp8 (accelerate's conversion of every Linear layer to FP8), which "
            "this project does not train or checkpoint: set mixed_precision: bf16 in the YAML (or pass "
            "--mixed_precision bf16 to accelerate launch); FP8 here is the head's matmul, --fp8-head true on Ada or "
            "Hopper GPUs"
        )


# One FSDP unit per Block (the model's _no_split_modules), where the launch names no wrap policy.
DEFAULT_WRAP = "TRANSFORMER_BASED_WRAP"


def _check_gpu_count() -> None:
    """A YAML for more GPUs than this machine has (the README's 4xa100.yaml on a machine of 2): accelerate gives
    each process the GPU of its local rank (cuda:LOCAL_RANK) and checks nothing, so the ranks past the last GPU die
    in accelerate with CUDA's "invalid device ordinal" (read from accelerate 1.15's code, not yet seen on a GPU:
    first light's `gpus` step launches it there). One line instead, from every rank alike. Without CUDA a MULTI_GPU
    YAML runs DDP over gloo on the CPU, any number of processes."""
    here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's: this machine's processes
    if not torch.cuda.is_available() or here <= (gpus := torch.cuda.device_count()):
        return
    machines = int(os.environ.get("WORLD_SIZE", here)) // here
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    raise ConfigError(
        f"the launch starts {here} processes on this machine, one per GPU, but it has {gpus} GPU(s){seen}: pass "
        f"--num_processes {gpus * machines} to accelerate launch (the total over all machines), use a YAML for "
        f"{gpus} GPU(s) (accelerate_configs/1xgpu.yaml for one), or write one for this machine with `accelerate config`"
    )


def _check_one_process_launcher() -> None:
    """accelerate's one-process launcher starts a YAML of distributed_type MULTI_CPU or NO, or any launch given
    --cpu, as one process whatever num_processes says (several only through mpirun), and sets MASTER_ADDR for a
    process group where num_processes or num_machines is above 1: such a run trained alone, saying only `1
    process(es)` (two machines: two runs, each alone, into one out_dir). torchrun's ranks have TORCHELASTIC_RUN_ID,
    mpirun's a world size. A MASTER_ADDR the launcher itself started with (a one-replica Kubernetes PyTorchJob, an
    sbatch script exporting it) is the job's, not accelerate's: such a one-process launch trains."""
    world_size = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    if one_process_launcher() and "MASTER_ADDR" in os.environ and world_size == 1:
        launcher = _launcher_environment()
        if launcher is not None and all(launcher.get(k) == os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")):
            return  # accelerate set neither (it sets both, to the YAML's address and port or 127.0.0.1:29500)
        raise ConfigError(
            "the launch asks for several processes (num_processes or num_machines above 1: accelerate set "
            "MASTER_ADDR for them), but accelerate launch started one: it starts a YAML of distributed_type MULTI_CPU "
            "or NO, or a launch given --cpu, as one process (several only through mpirun). For N processes on the "
            "CPU launch accelerate_configs/cpu_ddp2.yaml --num_processes N (DDP over gloo; in a YAML of your own: "
            "distributed_type: MULTI_GPU, use_cpu: false, which trains on the CPU where there is no GPU), or give "
            "--num_processes 1 for one"
        )


def _launcher_environment() -> dict[str, str] | None:
    """The environment this process's parent, the launcher, started with (Linux keeps it in /proc): the shell's or
    the job's, before accelerate set anything for this run; None where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _check_fsdp_yaml() -> None:
    """The fsdp_config answers (`accelerate config` offers them) under which this project's FSDP2 runs failed:
    - a wrap other than one FSDP unit per Block: SIZE_BASED_WRAP failed in fully_shard, a class the model lacks in
      accelerate, and NO_WRAP gathers the whole model at once;
    - FULL_STATE_DICT checkpoints, which a sharded launch, DDP, the export and evals cannot read;
    - parameters offloaded where there is no GPU: FSDP2 pins their memory for one, and failed.
    Before them, the version: FSDP1 is not this project's."""
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(
            "the launch asks for FSDP version 1 (fsdp_version: 1 in its YAML's fsdp_config, or no fsdp_version, which "
            "accelerate reads as 1); this project shards with FSDP2: convert the YAML with `accelerate to-fsdp2 "
            "--config_file YAML --output_file NEW.yaml` and launch with NEW.yaml, or, launched with --use_fsdp and no "
            "YAML, add --fsdp_version 2 to accelerate launch"
        )
    wrap = os.environ.get("FSDP_AUTO_WRAP_POLICY", DEFAULT_WRAP).upper()  # fsdp_plugin's default
    # none, or '' (`accelerate config` writes it where its class question is answered with Enter): our Block
    classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").strip() or Block.__name__
    said = None
    if wrap != "TRANSFORMER_BASED_WRAP":
        said = f"fsdp_auto_wrap_policy: {wrap}"
    elif classes != Block.__name__:
        said = f"fsdp_transformer_layer_cls_to_wrap: {classes}"
    if said:
        raise ConfigError(
            f"the launch YAML's fsdp_config says {said}; this project's FSDP2 shards the model one transformer block "
            f"at a time: set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap: "
            f"{Block.__name__} (or leave the class out)"
        )
    state_dict = os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    if state_dict.upper() != "SHARDED_STATE_DICT":
        raise ConfigError(
            f"the launch YAML's fsdp_config says fsdp_state_dict_type: {state_dict}; this project saves FSDP2 "
            "checkpoints sharded, which any process count, DDP or one process resumes and `python -m training.export` "
            "makes one model of (the run writes export/ at its end): set fsdp_state_dict_type: SHARDED_STATE_DICT"
        )
    if _yaml_says("FSDP_OFFLOAD_PARAMS") and not torch.cuda.is_available():
        raise ConfigError(
            "the launch YAML's fsdp_config says fsdp_offload_params: true, which keeps the parameters in CPU memory "
            "while a GPU computes; there is no GPU here, so they are there already: set fsdp_offload_params: false"
        )


def build_accelerator(*, grad_clip: float, **kwargs: Any) -> Accelerator:
    """An Accelerator for the launch YAML's engine (DDP, FSDP2 or DeepSpeed ZeRO).

    grad_clip is the training config's: DeepSpeed clips inside its own step, so it must know it before prepare()
    (as it must the batch: set_deepspeed_batch, once the accumulation is known).

    With CUDA this is a plain Accelerator; a single process on a Mac uses its GPU (MPS). Otherwise, accelerate
    would quietly drop FSDP and DeepSpeed YAMLs to DDP (`cpu=True`) or to one process, so the CPU twins of the
    GPU configs get real sharding over gloo:
    - DeepSpeed: gloo named as the process-group backend (deepspeed.comm initializes it), no `cpu=True`;
    - FSDP: the gloo CPU state accelerate builds for `cpu=True`, presented as MULTI_GPU so that the
      Accelerator applies the FSDP plugin to it (the device stays the CPU).
    Under bf16 (or fp16), FSDP2 and DeepSpeed reduce gradients in fp32 and FSDP2 leaves the loss in fp32: see
    fsdp_plugin and deepspeed_fp32_gradients.
    """
    if not torch.cuda.is_available():
        quiet_deepspeed()  # before accelerate imports it (also for plain DDP runs, when installed)
        if _launched_with("DEEPSPEED"):
            kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []), InitProcessGroupKwargs(backend="gloo")]
            _no_shared_memory_all_reduce()
        elif _launched_with("FSDP"):
            state = PartialState(cpu=True)
            if state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.MULTI_GPU
        else:  # a MULTI_GPU YAML (accelerate's torchrun launcher) runs DDP over gloo; one process may use MPS
            kwargs["cpu"] = accelerator_needs_cpu()
    if _launched_with("DEEPSPEED"):
        if os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "").lower() == "auto":
            # the YAML's deepspeed_config `gradient_accumulation_steps: auto`, which the Accelerator reads as an int
            # (it failed in int()) and the DeepSpeed plugin, left without it, as auto: set_deepspeed_batch fills it in
            del os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"]
        check_deepspeed_loads()
        # deepspeed 0.19 calls the collectives torch 2.13 renamed, warning on every rank
        deprecated = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
        warnings.filterwarnings("ignore", deprecated, FutureWarning)
    if _launched_with("FSDP"):
        kwargs["fsdp_plugin"] = fsdp_plugin()
        # Compiled per block, a block's output is a view of inductor's buffer, and FSDP2 warns (once per rank) that an
        # in-place op on it would skip its backward all-gather. GPT reads block outputs out of place only; FSDP2's
        # per-step losses equal DDP's (tests/e2e/test_sharded.py), which a skipped all-gather would break.
        warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor", UserWarning)
    accelerator = joined(Accelerator(**kwargs))  # before the checks below stop any process
    if accelerator.device.type == "mps" and accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        accelerator.print("note: torch.compile is off on the Apple GPU (inductor's MPS backend is a prototype)")
        accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        if accelerator.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR:
            check_build_tools(accelerator.device)  # before any work: inductor would stop at the first step
        set_up_compile_cache(accelerator.device)  # before prepare() compiles
        # Compiling DDP's forward (accelerate compiles the DDP module), dynamo meets the profiler label DDP opens and
        # warns on every rank that it ignores it; no profiler runs in training.
        logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_not_the_profiler_label_warning)
    set_up_compute(accelerator.device)  # MKL's vector math warmed up, freed memory kept for the next step
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        check_deepspeed_config(ds_config)
        _configure_deepspeed(ds_config, gradient_clipping=grad_clip)
        deepspeed_fp32_gradients(ds_config, accelerator.mixed_precision)
    return accelerator


def engine_name(accelerator: Accelerator) -> str | None:
    """The engine the run trains under, for its first line ("DDP", "FSDP2", "DeepSpeed ZeRO-2"); None for one
    process. Read from the Accelerator, so the line says what trains, not what the YAML asked for."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    return "DDP" if accelerator.num_processes > 1 else None


def _deepspeed_file() -> str | None:
    """The deepspeed_config_file the launch names; None where the YAML's deepspeed_config holds the settings."""
    source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    return source if source != "none" else None


def _deepspeed_source() -> str:
    """Where the DeepSpeed config comes from, as the lines about it name it."""
    return _deepspeed_file() or "the launch YAML's deepspeed_config"


def check_deepspeed_loads() -> None:
    """The DeepSpeed plugin built once as the Accelerator builds it from the launch, before it does: a config
    accelerate refuses (a JSON without zero_optimization, a path that is no file) raised its ValueError there, a
    traceback on every rank; one line naming the config and accelerate's reason instead."""
    from accelerate.utils import DeepSpeedPlugin

    try:
        DeepSpeedPlugin()
    except ValueError as err:
        raise ConfigError(f"the DeepSpeed config ({_deepspeed_source()}) is refused by accelerate: {err}") from None


def check_deepspeed_config(ds_config: dict) -> None:
    """What a DeepSpeed config asks that this project does not run, as one line at start-up:
    - an optimizer or scheduler of its own (the transformers examples' JSONs have both): accelerate refused it in
      prepare(), after the model was built, with a traceback advising a code change; the run config chooses both;
    - ZeRO stage 0 (an `accelerate config` answer: DeepSpeed's data parallelism, nothing sharded), under which
      DeepSpeed keeps no gradient norm: the run failed at its first step, with a TypeError traceback on every rank;
    - fp16 on a CPU from a DeepSpeed JSON (a YAML's mixed_precision is check_launch's): DeepSpeed's CPU accelerator
      refused it in prepare(), with a ValueError traceback on every rank."""
    where = _deepspeed_source()
    sections = [
        f"{key} ({ds_config[key].get('type', 'no type')})" for key in ("optimizer", "scheduler") if key in ds_config
    ]
    if sections:
        raise ConfigError(
            f"the DeepSpeed config ({where}) sets {' and '.join(sections)}; this project's run config chooses the "
            "optimizer and the lr schedule (--optimizer, --lr, --lr-schedule, --warmup-steps): remove those sections "
            "from the DeepSpeed config"
        )
    if ds_config.get("fp16", {}).get("enabled") is True and not torch.cuda.is_available():
        raise ConfigError(
            f"the DeepSpeed config ({where}) enables fp16, which DeepSpeed does not run on a CPU: enable bf16 in it "
            "instead where this CPU's bf16 is fast (`python -m training.pick_cpu_config` names the faster precision's "
            "YAML), or remove its fp16 section to train in fp32"
        )
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 0:
        key = "zero_optimization.stage: 1, 2 or 3 in it" if _deepspeed_file() else "zero_stage: 1, 2 or 3"
        raise ConfigError(
            f"the DeepSpeed config ({where}) sets ZeRO stage 0 (DeepSpeed's data parallelism, nothing sharded), which "
            f"this project does not train: set {key} (accelerate_configs/8xh100_zero2.yaml is stage 2), or launch a "
            "DDP YAML for data parallelism (accelerate_configs/8xh100.yaml; cpu_ddp2.yaml on a CPU)"
        )


def _not_the_profiler_label_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Profiler record function ")


def _no_shared_memory_all_reduce() -> None:
    """On the CPU, deepspeed.comm compiles its shared-memory all-reduce (a C++ extension: 1.5-2 minutes on 2 cores,
    once per machine and environment) as it sets up the process group, and only its inference all-reduce calls it:
    training's collectives are gloo's. Marked not buildable (a dict deepspeed.ops keeps for such edits), a ZeRO run
    starts without the compile."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def set_deepspeed_batch(accelerator: Accelerator, micro_batch_size: int, grad_accum: int) -> None:
    """The training config's batch into the DeepSpeed config, before prepare() (which would otherwise train with
    a YAML's own gradient_accumulation_steps, one `accelerate config` always writes, over the run's); nothing
    under other engines."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _configure_deepspeed(
            accelerator.state.deepspeed_plugin.deepspeed_config,
            train_micro_batch_size_per_gpu=micro_batch_size,
            gradient_accumulation_steps=grad_accum,
            train_batch_size=micro_batch_size * grad_accum * accelerator.num_processes,
        )


def fsdp_plugin() -> FullyShardedDataParallelPlugin:
    """The FSDP plugin of the launch YAML (from the environment `accelerate launch` sets), with an explicit mixed
    precision policy. Under bf16/fp16 accelerate's default casts everything to the low dtype: parameters (fine,
    autocast computes in it anyway), but also the gradient reduce-scatter (summing ranks' gradients in bf16) and
    every wrapped module's outputs, the loss included (rounded to bf16). Here parameters are all-gathered in the low
    dtype, gradients reduced in fp32, and outputs left as computed: the loss in fp32, a block's output in autocast's
    dtype (output_dtype fp32 would apply to every block too, handing the root's bf16 LayerNorm fp32 inputs, which
    CPU layer_norm rejects). fp32 runs keep FSDP2's no-cast default.
    Where the launch names no wrap policy (`accelerate launch --use_fsdp` without --fsdp_auto_wrap_policy), one FSDP
    unit per Block, as every YAML here says, not accelerate's default NO_WRAP (the whole model gathered at once).
    Activation checkpointing is the model's own (yaml_activation_checkpointing), never accelerate's wrapper."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # FSDP's imports here: 0.7 s of every other process

    wrap = os.environ.get("FSDP_AUTO_WRAP_POLICY", DEFAULT_WRAP)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(os.environ.get("ACCELERATE_MIXED_PRECISION", "no"))
    # named, not read from the launch: _check_fsdp_yaml lets only Block (or no class, or '') through, and accelerate
    # would look for a class named '' where `accelerate config` wrote an empty one
    plugin = dict(auto_wrap_policy=wrap, activation_checkpointing=False, transformer_cls_names_to_wrap=[Block.__name__])
    if low is None:
        return FullyShardedDataParallelPlugin(**plugin)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=None)
    return FullyShardedDataParallelPlugin(**plugin, mixed_precision_policy=policy)


def deepspeed_fp32_gradients(ds_config: dict, mixed_precision: str) -> None:
    """Under bf16/fp16, DeepSpeed reduces (communication_data_type) and accumulates (data_types.grad_accum_dtype)
    gradients in the low dtype unless told otherwise; fp32 for both, as under DDP and FSDP2. A DeepSpeed config
    that sets either keeps its value."""
    if mixed_precision in ("bf16", "fp16"):
        ds_config.setdefault("communication_data_type", "fp32")
        ds_config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")


# Where the training config's value of each DeepSpeed entry comes from, for the error that names both values.
DEEPSPEED_SOURCES = {
    "gradient_clipping": "--grad-clip",
    "train_micro_batch_size_per_gpu": "--micro-batch-size",
    "gradient_accumulation_steps": "--total-batch-tokens / (micro-batch × block size × processes)",
    "train_batch_size": "micro-batch × accumulation × processes",
}


def _configure_deepspeed(ds_config: dict, **known: float) -> None:
    """The batch and clipping entries of the DeepSpeed config belong to the training config: each is filled in
    where 'auto' (or missing) and must agree where the YAML sets it (`accelerate config` writes
    gradient_accumulation_steps, and gradient_clipping when asked)."""
    for key, value in known.items():
        if ds_config.get(key, "auto") == "auto":
            ds_config[key] = value
        elif ds_config[key] != value:
            raise ConfigError(
                f"the launch YAML's DeepSpeed config sets {key}: {ds_config[key]}, but this run needs {value} (from "
                f"{DEEPSPEED_SOURCES[key]}); remove it from deepspeed_config (or set it to 'auto'): the training "
                "config sets it"
            )


def decided_on_main(accelerator: Accelerator, decide: Callable[[], T]) -> T:
    """decide() run on the main process alone, its result, or the exception it raised, handed to every rank: one
    reading of what all ranks would read alike (on several nodes, each would read it over the network), and every
    rank returns or stops alike."""
    outcome: list[tuple[bool, Any]] = [(True, None)]
    if accelerator.is_main_process:
        try:
            outcome = [(True, decide())]
        except Exception as e:  # raised again on every rank, below
            outcome = [(False, e)]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


SHARED_WAIT_S = 5.0  # for a network filesystem's view of the folder to catch up, if it is shared
SHARED_PROBE = ".shared-probe-"  # + a new name each launch: no machine can hold a cached lookup of it


def check_ranks_agree(accelerator: Accelerator, config: dict[str, Any], run_dir: Path) -> None:
    """Several processes must run one config (machines launched by hand can differ: their collectives would then
    wait on each other forever) and see the main process's run folder (each rank writes its part of a checkpoint,
    and a requeued job may start the main process on another machine). Checked right after the process group forms,
    every rank against the main process; the ranks that differ are named with their hosts, and all stop alike."""
    if accelerator.num_processes == 1:
        return
    probe = run_dir / decided_on_main(accelerator, lambda: _new_probe(run_dir))  # in this rank's run_dir
    deadline = time.monotonic() + SHARED_WAIT_S
    while not (sees := probe.exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    main_host, (main_config, _), other = _against_main(accelerator, (config, sees))  # every rank has looked by now
    if accelerator.is_main_process:
        probe.unlink()
    problems = []
    differ = [(rank, host, theirs) for rank, host, (theirs, _) in other if theirs != main_config]
    if differ:
        keys = {k: v for *_, theirs in differ for k, v in theirs.items() if v != main_config[k]}
        there = ", ".join(f"{k} {v!r} against {main_config[k]!r}" for k, v in keys.items())
        problems.append(
            f"the launch on {_hosts(differ)} runs another config than the main process on {main_host} ({there}): "
            "give every machine the same command"
        )
    # a rank given another out_dir is named above: here its folder's path would be this rank's, not the one it uses
    blind = [
        (rank, host, seen)
        for rank, host, (theirs, seen) in other
        if not seen and theirs["out_dir"] == main_config["out_dir"]
    ]
    if blind:
        problems.append(
            f"out_dir {run_dir} on {_hosts(blind)} is not the folder the main process writes on {main_host}: put "
            "--out-dir on storage every machine shares (each rank writes its part of every checkpoint)"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def read_same_data(accelerator: Accelerator, data_dir: str) -> Manifest:
    """data_dir's manifest, read (and its shards checked) on every rank, and one gather of what each found.

    A rank that cannot read it (a path prepared on some machines only, a damaged copy) stops every rank with its
    line, naming its machine: stopping alone, it left the others to fail in their next collective (gloo's
    "Connection reset by peer" traceback) or to wait there until its timeout. A data_dir prepared on each machine
    (not on shared storage) must also be the same dataset: the same tokens in the same shards (Manifest.content_digest;
    where each machine read the books from may differ)."""
    if accelerator.num_processes == 1:
        return load_manifest(data_dir)
    try:
        manifest, problem = load_manifest(data_dir), None
    except DataPrepError as err:
        manifest, problem = None, str(err)
    main_host, (main_content, main_problem), other = _against_main(
        accelerator, (manifest and manifest.content_digest, problem)
    )
    if main_problem:
        raise DataPrepError(main_problem)
    failed = [(rank, host, problem) for rank, host, (_, problem) in other if problem]
    if failed:
        rank, host, problem = failed[0]
        raise DataPrepError(f"data_dir {data_dir} on {host} (rank {rank}): {problem}")
    differ = [(rank, host, content) for rank, host, (content, _) in other if content != main_content]
    if differ:
        raise ConfigError(
            f"data_dir {data_dir} on {_hosts(differ)} holds other data than on {main_host} (its shards hold other "
            "tokens): prepare it on each machine with one command, or put --data-dir on shared storage"
        )
    assert manifest is not None  # no rank failed
    return manifest


def _against_main(accelerator: Accelerator, value: Any) -> tuple[str, Any, list[tuple[int, str, Any]]]:
    """value from every rank (one gather): the main process's host and value, and the ranks whose value differs, as
    (rank, host, value)."""
    ranks = gather_object([(accelerator.process_index, socket.gethostname(), value)])
    _, main_host, main_value = ranks[0]
    return main_host, main_value, [r for r in ranks if r[2] != main_value]


def _new_probe(run_dir: Path) -> str:
    """The name of an empty file of a new name written in run_dir (a killed launch's probe removed first)."""
    for stale in run_dir.glob(f"{SHARED_PROBE}*"):
        stale.unlink()
    name = f"{SHARED_PROBE}{uuid.uuid4().hex}"
    (run_dir / name).touch()
    return name


def _hosts(ranks: list[tuple[int, str, Any]]) -> str:
    """'node-2 (ranks 8-15), node-3 (rank 16)': a launcher's ranks on one machine are consecutive."""
    by_host: dict[str, list[int]] = {}
    for rank, host, _ in ranks:
        by_host.setdefault(host, []).append(rank)
    return ", ".join(
        f"{host} (rank {r[0]})" if len(r) == 1 else f"{host} (ranks {r[0]}-{r[-1]})" for host, r in by_host.items()
    )


def is_dtensor(x: object) -> bool:
    """isinstance(x, DTensor), without importing torch.distributed.tensor (0.8 s of a process that has none): whatever
    made a DTensor imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def clip_grad_norm(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to max_norm (0: no clipping) and return their global norm before clipping, as a plain
    scalar tensor on the device whatever the engine: FSDP2 returns a replicated DTensor, and DeepSpeed, which
    clips inside its own step (at the gradient_clipping set by build_accelerator), a float."""
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
    if is_dtensor(norm):
        return norm.full_tensor()
    return torch.as_tensor(norm, dtype=torch.float32, device=accelerator.device)


def generation_model(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The module to call generate() on, for the prepared model. Call it once, after prepare().

    FSDP2 gathers the root's sharded parameters (embeddings, head) only around forward(), so generate() is
    registered as a forward method of the FSDP root. Elsewhere it is the plain model. With sharded weights (FSDP2,
    ZeRO-3) generate() gathers them with collectives: every rank must call it, not just the main one.

    Never unwrap with keep_torch_compile=True here: accelerate 1.15 then re-points the compile wrapper's _orig_mod
    at the bare GPT, and a compiled DDP model loses its no_sync (accumulate() all-reduced every micro-batch)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    # A GPT that nothing wraps (one eager process; FSDP2 shards it in place) is its own root: accelerate's unwrap_model
    # imports DeepSpeed wherever it is installed (0.3-0.5 s of such a run's start-up, 0.6-1.0 s of its CPU).
    root = model if isinstance(model, GPT) else accelerator.unwrap_model(model, keep_torch_compile=False)
    if isinstance(root, FSDPModule):
        register_fsdp_forward_method(root, "generate")
    return root
