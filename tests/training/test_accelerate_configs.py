"""Every launch YAML loads with accelerate's own loader and says what its name and comments claim."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env
from accelerate.utils.other import compile_regions_fsdp2
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import modeling.fused_ce
from bench.time_to_loss import launch_env as time_to_loss_env
from modeling.config import GPTConfig, get_preset
from modeling.gpt import GPT
from testkit import REPO, free_port, fsdp_yaml
from training.config import ConfigError, TrainConfig
from training.distributed import (
    _configure_deepspeed,
    check_deepspeed_config,
    check_launch,
    deepspeed_fp32_gradients,
    fsdp_plugin,
    no_gpu_note,
    yaml_activation_checkpointing,
)
from training.loop import setup

CONFIG_DIR = REPO / "accelerate_configs"
YAMLS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))

# name -> (distributed_type, machines, processes in total, mixed precision, dynamo backend or None)
CLAIMS: dict[str, tuple[DistributedType, int, int, str, str | None]] = {
    "cpu.yaml": (DistributedType.NO, 1, 1, "no", "INDUCTOR"),
    "cpu_bf16.yaml": (DistributedType.NO, 1, 1, "bf16", "INDUCTOR"),
    "cpu_eager.yaml": (DistributedType.NO, 1, 1, "no", None),
    "cpu_ddp2.yaml": (DistributedType.MULTI_GPU, 1, 2, "no", None),
    "cpu_fsdp2.yaml": (DistributedType.FSDP, 1, 2, "no", "INDUCTOR"),
    "cpu_zero2.yaml": (DistributedType.DEEPSPEED, 1, 2, "no", None),
    "cpu_zero3.yaml": (DistributedType.DEEPSPEED, 1, 2, "no", None),
    "2node_cpu_rank0.yaml": (DistributedType.MULTI_GPU, 2, 2, "no", None),
    "2node_cpu_rank1.yaml": (DistributedType.MULTI_GPU, 2, 2, "no", None),
    "1xgpu.yaml": (DistributedType.NO, 1, 1, "bf16", "INDUCTOR"),
    "1xgpu_fp16.yaml": (DistributedType.NO, 1, 1, "fp16", "INDUCTOR"),
    "mps.yaml": (DistributedType.NO, 1, 1, "no", None),
    "4xa100.yaml": (DistributedType.MULTI_GPU, 1, 4, "bf16", "INDUCTOR"),
    "8xh100.yaml": (DistributedType.MULTI_GPU, 1, 8, "bf16", "INDUCTOR"),
    "8xh100_fsdp.yaml": (DistributedType.FSDP, 1, 8, "bf16", "INDUCTOR"),
    # accelerate's DeepSpeed launcher does not pass dynamo_config on, so these claim no compile
    "8xh100_zero2.yaml": (DistributedType.DEEPSPEED, 1, 8, "bf16", None),
    "8xh100_zero3.yaml": (DistributedType.DEEPSPEED, 1, 8, "bf16", None),
    "2x8xh100.yaml": (DistributedType.MULTI_GPU, 2, 16, "bf16", "INDUCTOR"),
}


def load(name: str) -> ClusterConfig:
    config = load_config_from_file(str(CONFIG_DIR / name))
    assert isinstance(config, ClusterConfig), name
    return config


def test_every_yaml_states_its_claims_here():
    assert sorted(CLAIMS) == YAMLS


@pytest.mark.parametrize("name", YAMLS)
def test_yaml_loads_and_says_what_it_claims(name):
    config = load(name)
    distributed_type, machines, processes, precision, dynamo = CLAIMS[name]
    assert config.distributed_type == distributed_type
    assert (config.num_machines, config.num_processes) == (machines, processes)
    assert config.mixed_precision == precision
    assert config.dynamo_config.get("dynamo_backend") == dynamo
    # use_cpu makes `accelerate launch` start a single process whatever num_processes says
    assert config.use_cpu == (name in ("cpu.yaml", "cpu_bf16.yaml", "cpu_eager.yaml"))


def test_the_yamls_fsdp_activation_checkpointing_is_the_runs_own(monkeypatch, tmp_path):
    """`fsdp_activation_checkpointing: true` (`accelerate config` asks) runs as --activation-checkpointing true: the
    model recomputes its Blocks, which `--micro-batch-size auto` and config.yaml know of, and accelerate's
    checkpoint wrapper, which would recompute each Block a second time, stays off."""
    launch_as(monkeypatch, str(fsdp_yaml(tmp_path, fsdp_activation_checkpointing=True)))
    assert yaml_activation_checkpointing() and fsdp_plugin().activation_checkpointing is False
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    assert not yaml_activation_checkpointing()


@pytest.mark.parametrize("name", ["8xh100_fsdp.yaml", "cpu_fsdp2.yaml"])
def test_fsdp_yamls_are_fsdp2_wrapping_our_block_with_sharded_checkpoints(name):
    fsdp = load(name).fsdp_config
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert fsdp["fsdp_reshard_after_forward"] is True
    assert fsdp["fsdp_offload_params"] is False
    # the wrap class is found by name in the model: it must be the class of the model's transformer blocks
    block = GPT(get_preset("tiny-cpu")).transformer.h[0]
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == type(block).__name__


@pytest.mark.parametrize("name", ["8xh100_zero2.yaml", "8xh100_zero3.yaml", "cpu_zero2.yaml", "cpu_zero3.yaml"])
def test_deepspeed_yamls(name):
    ds = load(name).deepspeed_config
    assert ds["zero_stage"] == int(name.removesuffix(".yaml")[-1])
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
    # torchrun on every machine (as for DDP and FSDP), not DeepSpeed's pdsh/ssh launcher
    assert ds["deepspeed_multinode_launcher"] == "standard"
    # the training config owns these: build_accelerator fills them in and rejects other values
    assert not {"gradient_accumulation_steps", "gradient_clipping", "deepspeed_config_file"} & ds.keys()
    if ds["zero_stage"] == 3:  # accelerate config's default: the final export reads the checkpoint, not the module
        assert ds["zero3_save_16bit_model"] is False


@pytest.mark.parametrize(
    "gpu, cpu",
    [
        ("8xh100_fsdp.yaml", "cpu_fsdp2.yaml"),
        ("8xh100_zero2.yaml", "cpu_zero2.yaml"),
        ("8xh100_zero3.yaml", "cpu_zero3.yaml"),
    ],
)
def test_cpu_twins_test_the_gpu_engine_settings(gpu, cpu):
    """The tests run the CPU twin: its engine and compile sections must be the GPU config's, precision and size
    aside (accelerate's DeepSpeed launcher does not pass dynamo_config on, so the ZeRO YAMLs have none)."""
    assert load(cpu).fsdp_config == load(gpu).fsdp_config
    assert load(cpu).deepspeed_config == load(gpu).deepspeed_config
    assert load(cpu).dynamo_config == load(gpu).dynamo_config


def launch_env(name: str) -> dict[str, str]:
    """The environment `accelerate launch --config_file accelerate_configs/<name>` (or an absolute path) gives the
    training processes, from the launcher accelerate picks for it (DeepSpeed's, torchrun or one process). On a free
    port: torchrun's launchers refuse (two machines) or warn where the YAML's port (29500 where it names none) is
    held by another launch on this machine."""
    parser = launch_command_parser()
    port = ["--main_process_port", str(free_port())]
    args, defaults, mp_from_config = _validate_launch_command(
        parser.parse_args(["--config_file", str(CONFIG_DIR / name), *port, "train_accel.py"])
    )
    if args.use_deepspeed:  # what accelerate's launch_command adds before its DeepSpeed launcher
        fields = [*defaults.deepspeed_config, *["mixed_precision"] * mp_from_config]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        return prepare_deepspeed_cmd_env(args)[1]
    if (args.use_fsdp or args.multi_gpu) and not args.cpu:  # torchrun, as launch_command picks it
        return prepare_multi_gpu_env(args)
    return prepare_simple_launcher_cmd_env(args)[1]  # one process


def launch_as(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """This process's environment as `accelerate launch --config_file <name>` gives a training process (launch_env)."""
    for key, value in launch_env(name).items():
        monkeypatch.setenv(key, value)


def deepspeed_json_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, json_text: str) -> tuple[Path, dict]:
    """Launched as cpu_zero2.yaml pointed at a deepspeed_config_file holding `json_text` (as `accelerate config`
    writes it with a JSON: no mixed_precision, the JSON's to set): (the JSON's path, the DeepSpeed config accelerate
    reads from it)."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json_text)
    config = yaml.safe_load((CONFIG_DIR / "cpu_zero2.yaml").read_text())
    config["deepspeed_config"] = {"deepspeed_config_file": str(ds_json), "zero3_init_flag": False}
    del config["mixed_precision"]
    yaml_file = tmp_path / "my_ds.yaml"
    yaml_file.write_text(yaml.safe_dump(config))
    launch_as(monkeypatch, str(yaml_file))
    from accelerate.utils import DeepSpeedPlugin

    return ds_json, DeepSpeedPlugin().deepspeed_config


def test_fsdp2_under_bf16_gathers_bf16_but_reduces_in_fp32_and_casts_no_output(monkeypatch):
    launch_as(monkeypatch, "8xh100_fsdp.yaml")
    plugin = fsdp_plugin()
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None)
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["Block"]
    assert plugin.mixed_precision_policy == bf16_policy
    # AcceleratorState then applies the launch's mixed_precision to the plugin: an explicit policy stays
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy == bf16_policy


@contextmanager
def one_process_mesh() -> Iterator[DeviceMesh]:
    """A 1-process gloo group and a CPU mesh over it, for fully_shard in this process. The CPU mesh also where a GPU
    is present: fully_shard's default mesh is the accelerator's (cuda:0 on the GPU machines, where a CPU twin's loss
    could then not be compared with the sharded model's)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def shard_per_block(model: GPT, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    """fully_shard as accelerate applies it under FSDP2: each Block, then the root."""
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def test_fsdp2_bf16_policy_keeps_the_loss_and_gradients_fp32(monkeypatch):
    """Applied as accelerate applies it (each Block, then the root) on a 1-process gloo group: the loss and the
    gradients are those of the model's bf16 copy under autocast, bit for bit, handed back in fp32; accelerate's
    default policy would hand the loss back rounded to bf16. (The twin, not the fp32 model under autocast: FSDP's
    bf16 parameters make a bf16 residual stream, 3e-5 from autocast's loss on a Zen 3 and more with other kernels.)"""
    launch_as(monkeypatch, "8xh100_fsdp.yaml")
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    twin = GPT(config).to(torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):
        _, want = twin(x, x)
    want.backward()
    accelerate_default = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    got, grads = {}, {}
    with one_process_mesh() as mesh:
        for name, policy in (("ours", fsdp_plugin().mixed_precision_policy), ("default", accelerate_default)):
            torch.manual_seed(0)
            model = GPT(config)
            shard_per_block(model, mesh, policy)
            with torch.autocast("cpu", torch.bfloat16):
                _, got[name] = model(x, x)
            got[name].backward()
            grads[name] = model.transformer.h[0].mlp.c_fc.weight.grad.full_tensor()
            assert grads[name].dtype == torch.float32
    assert got["ours"].dtype == torch.float32 and got["default"].dtype == torch.bfloat16
    assert torch.equal(got["ours"], want)
    assert torch.equal(grads["ours"], twin.transformer.h[0].mlp.c_fc.weight.grad.float())


def test_fsdp2_in_fp32_casts_nothing(monkeypatch):
    launch_as(monkeypatch, "cpu_fsdp2.yaml")
    assert fsdp_plugin().mixed_precision_policy in (None, MixedPrecisionPolicy())


@pytest.mark.parametrize("name", ["8xh100_zero2.yaml", "8xh100_zero3.yaml", "cpu_zero2.yaml"])
def test_deepspeed_bf16_reduces_and_accumulates_gradients_in_fp32(monkeypatch, name):
    """The DeepSpeed config accelerate builds from the YAML, completed by build_accelerator, as DeepSpeed reads it."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    env = launch_env(name)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig

    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])  # as AcceleratorState does
    ds_config = plugin.deepspeed_config
    _configure_deepspeed(ds_config, gradient_clipping=1.0)  # build_accelerator's, then set_deepspeed_batch's
    _configure_deepspeed(ds_config, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2, train_batch_size=8)
    deepspeed_fp32_gradients(ds_config, env["ACCELERATE_MIXED_PRECISION"])
    parsed = DeepSpeedConfig(ds_config)
    bf16 = env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert parsed.bfloat16_config.enabled == bf16
    assert parsed.communication_data_type == (torch.float32 if bf16 else None)  # None: the model's dtype, fp32
    assert parsed.grad_accum_dtype == ("fp32" if bf16 else None)


def test_a_deepspeed_yaml_as_accelerate_config_writes_it_must_agree_with_the_run(monkeypatch, tmp_path):
    """`accelerate config` writes gradient_accumulation_steps into a DeepSpeed YAML (and gradient_clipping when
    asked), and accelerate's prepare() would train with the YAML's accumulation over the run's. Where they agree the
    run goes on; where not it stops at start-up with one line (a ConfigError) naming both values and the fix."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    text = (CONFIG_DIR / "cpu_zero2.yaml").read_text()
    yaml = tmp_path / "my_zero2.yaml"
    yaml.write_text(
        text.replace("  zero_stage: 2", "  zero_stage: 2\n  gradient_accumulation_steps: 1\n  gradient_clipping: 1.0")
    )
    launch_as(monkeypatch, str(yaml))
    from accelerate.utils import DeepSpeedPlugin

    def config() -> dict:
        return DeepSpeedPlugin().deepspeed_config

    agreed = config()
    _configure_deepspeed(agreed, gradient_clipping=1.0)
    _configure_deepspeed(agreed, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=1, train_batch_size=32)
    assert (agreed["gradient_accumulation_steps"], agreed["train_batch_size"]) == (1, 32)
    with pytest.raises(ConfigError, match=r"sets gradient_accumulation_steps: 1, but this run needs 4 \(from --total"):
        _configure_deepspeed(config(), train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4)
    with pytest.raises(ConfigError, match=r"sets gradient_clipping: 1.0, but this run needs 0.5 \(from --grad-clip"):
        _configure_deepspeed(config(), gradient_clipping=0.5)


def test_a_deepspeed_config_with_its_own_optimizer_and_scheduler_stops_with_one_line(monkeypatch, tmp_path):
    """The transformers examples' DeepSpeed JSONs set an optimizer and a scheduler ("auto" values for the Trainer to
    fill in); accelerate refused them in prepare(), after the model was built, advising a code change."""
    ds_json, ds_config = deepspeed_json_config(
        monkeypatch, tmp_path,
        '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", '
        '"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": {"type": "WarmupLR"}}',
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_deepspeed_config(ds_config)
    assert str(err.value) == (
        f"the DeepSpeed config ({ds_json}) sets optimizer (AdamW) and scheduler (WarmupLR); this project's run config "
        "chooses the optimizer and the lr schedule (--optimizer, --lr, --lr-schedule, --warmup-steps): remove those "
        "sections from the DeepSpeed config"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed runs fp16 on GPUs")
def test_a_deepspeed_config_file_in_fp16_on_a_cpu_stops_with_one_line(monkeypatch, tmp_path):
    """fp16 chosen in the DeepSpeed JSON (`accelerate config` asks no precision where a JSON is given), not the
    YAML's mixed_precision (check_launch's): DeepSpeed's CPU accelerator refused it in prepare(), after the model
    was built, with a ValueError traceback on every rank."""
    ds_json, ds_config = deepspeed_json_config(
        monkeypatch, tmp_path, '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}'
    )
    with pytest.raises(ConfigError) as err:
        check_deepspeed_config(ds_config)
    assert str(err.value) == (
        f"the DeepSpeed config ({ds_json}) enables fp16, which DeepSpeed does not run on a CPU: enable bf16 in it "
        "instead where this CPU's bf16 is fast (`python -m training.pick_cpu_config` names the faster precision's "
        "YAML), or remove its fp16 section to train in fp32"
    )


def test_deepspeed_zero_stage_0_stops_with_one_line(monkeypatch, tmp_path):
    """`accelerate config` offers ZeRO stage 0 (DeepSpeed's data parallelism, nothing sharded): DeepSpeed then keeps
    no gradient norm, and the run wrote its folder and failed at its first step with a TypeError traceback on every
    rank. One line at start-up instead, naming what does run."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    yaml_file = tmp_path / "my_zero0.yaml"
    yaml_file.write_text((CONFIG_DIR / "cpu_zero2.yaml").read_text().replace("zero_stage: 2", "zero_stage: 0"))
    launch_as(monkeypatch, str(yaml_file))
    from accelerate.utils import DeepSpeedPlugin

    with pytest.raises(ConfigError) as err:
        check_deepspeed_config(DeepSpeedPlugin().deepspeed_config)
    assert str(err.value) == (
        "the DeepSpeed config (the launch YAML's deepspeed_config) sets ZeRO stage 0 (DeepSpeed's data parallelism, "
        "nothing sharded), which this project does not train: set zero_stage: 1, 2 or 3 (accelerate_configs/"
        "8xh100_zero2.yaml is stage 2), or launch a DDP YAML for data parallelism (accelerate_configs/8xh100.yaml; "
        "cpu_ddp2.yaml on a CPU)"
    )


def test_a_deepspeed_json_at_zero_stage_0_is_told_the_jsons_key(monkeypatch, tmp_path):
    """A DeepSpeed JSON at stage 0: the line names the JSON's key, zero_optimization.stage; a YAML with a JSON has no
    zero_stage to set."""
    ds_json, ds_config = deepspeed_json_config(monkeypatch, tmp_path, '{"zero_optimization": {"stage": 0}}')
    with pytest.raises(ConfigError, match=rf"^the DeepSpeed config \({ds_json}\) sets ZeRO stage 0 .*: set "):
        check_deepspeed_config(ds_config)
    with pytest.raises(ConfigError, match=r": set zero_optimization.stage: 1, 2 or 3 in it \("):
        check_deepspeed_config(ds_config)


def test_accelerates_deepspeed_launcher_hands_the_run_no_dynamo_setting(tmp_path):
    """docs/distributed.md: a DeepSpeed YAML that compiles (an `accelerate config` answer) trains eagerly, since
    accelerate's DeepSpeed launcher, unlike its others, sets no ACCELERATE_DYNAMO_* for the run. Should accelerate
    start to, the run would compile under DeepSpeed, untested here, and this page would be wrong."""
    config = yaml.safe_load((CONFIG_DIR / "cpu_zero2.yaml").read_text())
    config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    yaml_file = tmp_path / "my_zero2.yaml"
    yaml_file.write_text(yaml.safe_dump(config))
    assert not [key for key in launch_env(str(yaml_file)) if key.startswith("ACCELERATE_DYNAMO_")]
    assert launch_env("cpu.yaml")["ACCELERATE_DYNAMO_BACKEND"] == "INDUCTOR"  # the one-process launcher's


@pytest.mark.parametrize("machines", [1, 2])
def test_more_processes_than_gpus_on_a_machine_stops_with_one_line(monkeypatch, machines):
    """4xa100.yaml on a machine of 2 GPUs: the ranks past the last GPU would die with CUDA's "invalid device ordinal".
    No GPU here: torch is told of 2 (the count is all the check reads), as torchrun tells each rank its launch."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("WORLD_SIZE", str(2 * machines))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_launch()  # one process per GPU
    monkeypatch.setenv("WORLD_SIZE", str(4 * machines))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError) as err:
        check_launch()
    assert str(err.value) == (
        "the launch starts 4 processes on this machine, one per GPU, but it has 2 GPU(s) (CUDA_VISIBLE_DEVICES=0,1): "
        f"pass --num_processes {2 * machines} to accelerate launch (the total over all machines), use a YAML for 2 "
        "GPU(s) (accelerate_configs/1xgpu.yaml for one), or write one for this machine with `accelerate config`"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU YAML finds its GPU")
@pytest.mark.parametrize("name", ["1xgpu.yaml", "1xgpu_fp16.yaml", "cpu.yaml", "cpu_ddp2.yaml"])
def test_a_gpu_launch_that_finds_no_gpu_says_it_trains_on_the_cpu(monkeypatch, name):
    """1xgpu.yaml (one process, use_cpu: false) on a machine where torch sees no GPU: one note at start-up, before
    a GPU recipe crawls on the CPU. The CPU YAMLs, and the gloo twins of the multi-GPU ones, say nothing. The
    environment is the one accelerate's own launcher for the YAML gives the process."""
    launch_as(monkeypatch, name)
    note = no_gpu_note(torch.device("cpu"))
    if name.startswith("cpu"):
        assert note is None
    else:
        cpu_build = "is a CPU-only build (install a CUDA build of torch for the GPU)"
        why = cpu_build if torch.version.cuda is None else "sees no GPU (check the driver with nvidia-smi"
        said = f"note: the launch YAML is for a GPU (use_cpu: false), but torch {torch.__version__} {why}"
        assert note.startswith(said), note
        assert note.endswith(": this run trains on the CPU")


FP16_ON_CPU = "mixed_precision: fp16, which accelerate does not apply on a CPU: the run would train in fp32"
FP16_INSTEAD = r"set mixed_precision: bf16 where this CPU's bf16 is fast \(cpu_bf16.yaml; .*\) or no \(cpu.yaml\)"
FSDP1 = r"FSDP version 1 .*`accelerate to-fsdp2 --config_file YAML --output_file NEW.yaml`"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, FSDP1),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": None}, FSDP1),
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, r"mixed_precision: fp8 .*set mixed_precision: bf16 .*--fp8-head true"),
        ({"ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "fp16"}, rf"{FP16_ON_CPU}; {FP16_INSTEAD}"),
        pytest.param(
            {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_USE_CPU": None},
            rf"mixed_precision: fp16, which DeepSpeed does not run on a CPU; {FP16_INSTEAD}",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed runs fp16 on GPUs"),
        ),
        pytest.param(  # 1xgpu_fp16.yaml where torch sees no GPU: why there is none, too
            {"ACCELERATE_USE_CPU": "false", "ACCELERATE_MIXED_PRECISION": "fp16"},
            rf"{FP16_ON_CPU}, and the YAML is for a GPU, but torch {re.escape(torch.__version__)} (is a CPU-only "
            rf"build|sees no GPU) .*\); {FP16_INSTEAD}",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on the GPU"),
        ),
        (
            {"ACCELERATE_DYNAMO_BACKEND": "TVM"},
            r"dynamo_backend: TVM, which this project does not train with: set dynamo_backend: INDUCTOR in the YAML",
        ),
    ],
    ids=[
        "fsdp_version 1",
        "no fsdp_version",
        "fp8",
        "fp16 on a CPU",
        "DeepSpeed fp16 on a CPU",
        "GPU YAML, no GPU",
        "dynamo tvm",
    ],
)
def test_a_launch_this_project_does_not_run_stops_before_anything_is_written(monkeypatch, tmp_path, env, message):
    """What `accelerate launch` puts in the environment for such a YAML (or flag) gives one ConfigError saying what
    to use instead, before the run folder is made:
    - FSDP version 1 (what accelerate reads from a YAML without fsdp_version, as older ones are): this project
      shards with FSDP2, and `accelerate to-fsdp2` converts the YAML;
    - mixed_precision fp8 (an `accelerate config` answer): accelerate swaps every Linear for an FP8 library's, whose
      weights the checkpoints cannot hold (with torchao installed, such a run trained and then failed at its first
      save, with a traceback);
    - mixed_precision fp16 on a CPU (an `accelerate config` answer there, or a GPU YAML on a machine without one):
      accelerate autocasts to fp16 on GPUs only, so the run trained in fp32 and called itself fp16;
    - a dynamo backend other than inductor (or dynamo's eager debugging ones), which `accelerate config` offers:
      tvm, not installed, failed at the first step with dynamo's traceback."""
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        setup(TrainConfig(out_dir=str(run_dir)))
    assert not run_dir.exists()


def test_an_fsdp_launch_by_flags_alone_is_told_the_flag_for_fsdp2(monkeypatch, tmp_path):
    """`accelerate launch --use_fsdp --num_processes 2`, no YAML: accelerate's --fsdp_version defaults to 1, and the
    line told the user to convert a YAML there was none of. It names --fsdp_version 2 too (which then trains)."""
    args, _, _ = _validate_launch_command(
        launch_command_parser().parse_args(["--use_fsdp", "--num_processes", "2", "train_accel.py"])
    )
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    run_dir = tmp_path / "run"
    flags = "or, launched with --use_fsdp and no YAML, add --fsdp_version 2 to accelerate launch"
    with pytest.raises(ConfigError, match=rf"{FSDP1} and launch with NEW.yaml, {flags}$"):
        setup(TrainConfig(out_dir=str(run_dir)))
    assert not run_dir.exists()


WRAP = r"this project's FSDP2 shards the model one transformer block at a time: set fsdp_auto_wrap_policy: TRANS"


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, rf"fsdp_auto_wrap_policy: SIZE_BASED_WRAP; {WRAP}"),
        ({"fsdp_auto_wrap_policy": "NO_WRAP"}, rf"fsdp_auto_wrap_policy: NO_WRAP; {WRAP}"),
        (
            {"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"},
            rf"fsdp_transformer_layer_cls_to_wrap: GPT2Block; {WRAP}",
        ),
        (
            {"fsdp_state_dict_type": "FULL_STATE_DICT"},
            r"fsdp_state_dict_type: FULL_STATE_DICT; this project saves FSDP2 checkpoints sharded",
        ),
        pytest.param(
            {"fsdp_offload_params": True},
            r"fsdp_offload_params: true, .* there is no GPU here, so they are there already: set fsdp_offload",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="offloading from a GPU is what it is for"),
        ),
    ],
    ids=["size-based wrap", "no wrap", "a class the model lacks", "full state dict", "offload without a GPU"],
)
def test_fsdp_answers_this_project_does_not_run_stop_before_anything_is_written(
    monkeypatch, tmp_path, answers, message
):
    """fsdp_config answers `accelerate config` offers, under which the run failed later (SIZE_BASED_WRAP in
    fully_shard, a class the model lacks in accelerate, offloading in FSDP2's pinning of memory for a GPU, with
    tracebacks), trained less sharded than asked (NO_WRAP: the whole model gathered at once) or wrote checkpoints
    that only the same YAML could resume (FULL_STATE_DICT: a traceback elsewhere)."""
    launch_as(monkeypatch, str(fsdp_yaml(tmp_path, **answers)))
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=f"^the launch YAML's fsdp_config says {message}"):
        setup(TrainConfig(out_dir=str(run_dir)))
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "answers",
    [
        {"fsdp_transformer_layer_cls_to_wrap": None},
        {"fsdp_transformer_layer_cls_to_wrap": ""},
        {"fsdp_auto_wrap_policy": None, "fsdp_transformer_layer_cls_to_wrap": None},
    ],
    ids=["no class", "class answered with Enter", "no wrap policy"],
)
def test_fsdp2_shards_each_block_when_the_launch_names_no_class_or_policy(monkeypatch, tmp_path, answers):
    """`accelerate config` leaves the wrap class out where its `_no_split_modules` question is answered yes: accelerate
    then wraps the model's _no_split_modules (the transformers attribute), and without it wrapped none, sharding the
    model as one unit. Answered with Enter (no), its class question, answered with Enter, writes '': the run stopped
    with "fsdp_transformer_layer_cls_to_wrap: ; ... (or leave the class out)", and accelerate would have looked for
    a class named ''. `accelerate launch --use_fsdp` without --fsdp_auto_wrap_policy names no policy either
    (accelerate: NO_WRAP)."""
    yaml_file = fsdp_yaml(tmp_path, **answers)
    launch_as(monkeypatch, str(yaml_file))
    check_launch()
    plugin, model = fsdp_plugin(), GPT(get_preset("tiny-cpu"))
    plugin.set_auto_wrap_policy(model)  # as accelerate's FSDP2 prepare does, then fsdp2_prepare_model
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    assert [m for m in model.modules() if policy(m)] == list(model.transformer.h)


GPU_YAMLS = ["1xgpu.yaml", "1xgpu_fp16.yaml", "4xa100.yaml", "8xh100.yaml", "2x8xh100.yaml", "8xh100_fsdp.yaml"]


@pytest.mark.parametrize("name", [*GPU_YAMLS, "cpu_fsdp2.yaml"])
def test_gpu_and_fsdp_yamls_compile_per_block(name):
    """Per block: the whole model's speed on an H200, its first compile a third as long (BENCHMARKS.md, "Sixth
    light"); under FSDP2, inside the hooks that gather each block's weights."""
    assert load(name).dynamo_config == {"dynamo_backend": "INDUCTOR", "dynamo_use_regional_compilation": True}
    assert launch_env(name)["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] == "True"


@pytest.mark.parametrize("name", ["1xgpu.yaml", "cpu.yaml", "cpu_bf16.yaml", "cpu_eager.yaml"])
def test_time_to_loss_trains_under_the_precision_and_compile_accelerate_launch_sets(name):
    """bench.time_to_loss trains in its own process, not through `accelerate launch`: it sets what the launcher
    would from the YAML, per block where the YAML says so."""
    ours, theirs = time_to_loss_env(CONFIG_DIR / name, torch.device("cuda")), launch_env(name)
    assert ours.items() <= theirs.items()
    regional = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"
    assert ours.get(regional, "False") == theirs[regional]


def test_regional_compilation_compiles_our_block_once_for_every_layer():
    """accelerate's FSDP2 regional compile finds GPT's transformer.h ModuleList and compiles each Block in place
    (FSDP's hooks stay outside the compiled code); all blocks share one compiled frame, the head's loss is compiled
    too (GPT.forward, which regional compilation leaves eager, only calls it), and the numbers match eager."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=128)
    model, eager = GPT(config), GPT(config)
    eager.load_state_dict(model.state_dict())
    counter = CompileCounter()
    try:
        compile_regions_fsdp2(model, backend=counter)
        assert all(block._compiled_call_impl is not None for block in model.transformer.h)
        x, y = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
        (_, loss), (_, want) = model(x, y), eager(x, y)
        loss.backward()
        want.backward()
        assert counter.frame_count == 2  # the Block's forward, compiled once for all three, and the head's loss
        assert model.lm_head._compiled_call_impl is not None
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.usefixtures("fp8_matmul")  # tests/conftest.py: skips where oneDNN is held to an ISA without FP8
def test_the_fp8_head_under_fsdp2_compiled_per_block_is_the_unsharded_models(monkeypatch):
    """8xh100_fsdp.yaml with --fp8-head true, as on a Hopper GPU: FSDP2's bf16 policy, each Block and the head
    compiled on their own, the loss on the rule's CUDA branch (the full logits where compiled, so the FP8 matmul,
    which runs on the CPU too). The head's FP8 form runs inside its compiled frame on the gathered tied weight: the
    loss and the embedding's gradient are the unsharded bf16 model's, compiled the same way, bit for bit, and not
    those of its bf16 head."""
    launch_as(monkeypatch, "8xh100_fsdp.yaml")
    monkeypatch.setattr(modeling.fused_ce, "takes_full_logits", lambda device, compiling, *sizes: compiling)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128)
    x, y = (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (0, 1))

    def loss_and_grad(fp8: bool, mesh: DeviceMesh | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the embedding's gradient, sharded over `mesh` (None: the unsharded bf16 model)."""
        torch.manual_seed(0)
        model = GPT(config)
        model.fp8_head = fp8
        if mesh is None:  # what the bf16 policy gathers
            model = model.to(torch.bfloat16)
        counter = CompileCounterWithBackend("aot_eager")  # the graphs dynamo captures, without inductor's builds
        compile_regions_fsdp2(model, backend=counter)  # before fully_shard, as accelerate's FSDP2 prepare
        if mesh is not None:
            shard_per_block(model, mesh, fsdp_plugin().mixed_precision_policy)
        try:
            with torch.autocast("cpu", torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
        finally:
            torch._dynamo.reset()
        assert counter.frame_count == 2  # the Block's, once for both, and the head's loss: no graph break
        grad = model.transformer.wte.weight.grad
        return loss.detach().float(), (grad if mesh is None else grad.full_tensor()).float()

    with one_process_mesh() as mesh:
        sharded = loss_and_grad(fp8=True, mesh=mesh)
    unsharded, bf16_head = loss_and_grad(fp8=True), loss_and_grad(fp8=False)
    assert torch.equal(sharded[0], unsharded[0]) and torch.equal(sharded[1], unsharded[1])
    assert not torch.equal(unsharded[0], bf16_head[0])  # the FP8 matmul ran


def test_zero2_yamls_differ_from_zero3_only_in_stage():
    stage3_only = {"zero_stage", "zero3_init_flag", "zero3_save_16bit_model"}
    for zero2, zero3 in (("8xh100_zero2.yaml", "8xh100_zero3.yaml"), ("cpu_zero2.yaml", "cpu_zero3.yaml")):
        ds2, ds3 = load(zero2).deepspeed_config, load(zero3).deepspeed_config
        assert {k: v for k, v in ds2.items() if k not in stage3_only} == {
            k: v for k, v in ds3.items() if k not in stage3_only
        }


def test_two_node_cpu_pair_meets_at_one_address_as_machines_0_and_1():
    rank0, rank1 = load("2node_cpu_rank0.yaml"), load("2node_cpu_rank1.yaml")
    assert (rank0.machine_rank, rank1.machine_rank) == (0, 1)
    assert rank0.main_process_ip == rank1.main_process_ip == "127.0.0.1"
    assert rank0.main_process_port == rank1.main_process_port
    assert rank0.num_processes // rank0.num_machines == 1  # one process per "machine": world size 2
    assert {**vars(rank0), "machine_rank": 1} == vars(rank1)


def test_multi_node_gpu_yaml_is_two_machines_of_eight():
    config = load("2x8xh100.yaml")
    assert config.num_processes // config.num_machines == 8
    assert config.main_process_ip and config.main_process_port
    assert config.rdzv_backend == "static" and config.same_network
