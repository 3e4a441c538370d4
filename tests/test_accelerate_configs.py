"""Every launch YAML loads with accelerate's own loader and says what its name and comments claim."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.utils import DistributedType

from modeling.config import get_preset
from modeling.gpt import GPT

CONFIG_DIR = Path(__file__).resolve().parents[1] / "accelerate_configs"
YAMLS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))

# name -> (distributed_type, machines, processes in total, mixed precision, dynamo backend or None)
CLAIMS: dict[str, tuple[DistributedType, int, int, str, str | None]] = {
    "cpu.yaml": (DistributedType.NO, 1, 1, "no", "INDUCTOR"),
    "cpu_bf16.yaml": (DistributedType.NO, 1, 1, "bf16", "INDUCTOR"),
    "cpu_eager.yaml": (DistributedType.NO, 1, 1, "no", None),
    "cpu_ddp2.yaml": (DistributedType.MULTI_GPU, 1, 2, "no", None),
    "cpu_fsdp2.yaml": (DistributedType.FSDP, 1, 2, "no", None),
    "cpu_zero2.yaml": (DistributedType.DEEPSPEED, 1, 2, "no", None),
    "cpu_zero3.yaml": (DistributedType.DEEPSPEED, 1, 2, "no", None),
    "2node_cpu_rank0.yaml": (DistributedType.MULTI_GPU, 2, 2, "no", None),
    "2node_cpu_rank1.yaml": (DistributedType.MULTI_GPU, 2, 2, "no", None),
    "1xgpu.yaml": (DistributedType.NO, 1, 1, "bf16", "INDUCTOR"),
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
    if ds["zero_stage"] == 3:
        assert ds["zero3_save_16bit_model"] is True  # so the final export can gather the full weights


@pytest.mark.parametrize(
    "gpu, cpu",
    [
        ("8xh100_fsdp.yaml", "cpu_fsdp2.yaml"),
        ("8xh100_zero2.yaml", "cpu_zero2.yaml"),
        ("8xh100_zero3.yaml", "cpu_zero3.yaml"),
    ],
)
def test_cpu_twins_test_the_gpu_engine_settings(gpu, cpu):
    """The tests run the CPU twin: its engine section must be the GPU config's, precision and size aside."""
    assert load(cpu).fsdp_config == load(gpu).fsdp_config
    assert load(cpu).deepspeed_config == load(gpu).deepspeed_config


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
