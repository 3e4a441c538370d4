"""modeling.runs: the weights of a trained model, whatever wraps it, under our GPT's own keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from accelerate.utils.other import compile_regions
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

from modeling.config import PADDED_VOCAB_SIZE, REAL_VOCAB_SIZE, GPTConfig, get_preset
from modeling.gpt import GPT
from modeling.runs import (
    CONFIG_FILE,
    RunError,
    checkpoint_dir,
    load_checkpoint,
    model_shape,
    plain_state_dict,
    run_model_config,
)
from testkit import write_checkpoint


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_plain_state_dict_loads_the_weights_whatever_wraps_the_model(one_process_group):
    """The final export and the run-folder readers load weights by our GPT's keys. The wrappers a launch YAML can put
    around the model each add parts to them: torch.compile of the whole model a leading `_orig_mod.`, DDP a
    `module.`, and regional compilation (`dynamo_use_regional_compilation`, which `accelerate config` offers) an
    `_orig_mod.` inside the key of every compiled block, embedding and head."""
    torch.manual_seed(0)
    model = GPT(get_preset("tiny-cpu"))
    wrapped = {
        "compiled": torch.compile(model),
        "ddp of compiled": DistributedDataParallel(torch.compile(model)),
        "regions": compile_regions(model),
    }
    assert any("._orig_mod." in key for key in wrapped["regions"].state_dict())
    for name, wrapper in wrapped.items():
        fresh = GPT(get_preset("tiny-cpu"))
        fresh.load_state_dict(plain_state_dict(wrapper.state_dict()))  # strict: every key, no other
        for (key, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b), (name, key)


def test_a_hub_id_out_of_reach_is_one_line_saying_how_to_do_without(monkeypatch, tmp_path):
    """--init-from gpt2 on a machine that cannot reach huggingface.co (offline mode: the same answer without the
    retries): transformers' message ran over two lines and said nothing of what to give instead. A folder without
    config.json is not a Hub id: no download advice there."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError) as err:
        model_shape("gpt2-124m", init_from="gpt2")
    said = str(err.value)
    assert "\n" not in said and said.startswith("init_from gpt2: ")
    assert said.endswith("(hf download gpt2 --local-dir DIR) and give --init-from DIR"), said
    with pytest.raises(ValueError) as err:
        model_shape("gpt2-124m", init_from=str(tmp_path))
    assert "\n" not in str(err.value) and "hf download" not in str(err.value)


def test_a_run_folder_given_to_init_from_names_its_export(tmp_path):
    """A run's folder (config.yaml, checkpoints/, export/) where its export is meant: transformers read the folder
    and the line said "not a GPT-2 model (model_type None)"."""
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text('{"model_type": "gpt2"}')
    (run / "config.yaml").write_text("preset: tiny-cpu\n")
    with pytest.raises(ValueError) as err:
        model_shape("gpt2-124m", init_from=str(run))
    assert str(err.value) == f"init_from {run} is a run folder: give its export, {run / 'export'}"


def test_a_run_started_from_a_folder_with_its_vocab_padded_still_reads(tmp_path):
    """Runs started with --init-from before it kept the folder's 50,257 ids saved 50,304 rows; evals, generate and
    training.export read them still (the padded ids are never tokens), so such a run can be exported and started
    from again."""
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32)).save_pretrained(tmp_path / "hf")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / CONFIG_FILE).write_text(f"preset: tiny-cpu\ninit_from: {tmp_path / 'hf'}\n")
    padded = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=PADDED_VOCAB_SIZE))
    checkpoint = checkpoint_dir(tmp_path / "run", 2)
    checkpoint.mkdir(parents=True)
    save_file({k: v.clone() for k, v in padded.state_dict().items()}, checkpoint / "model.safetensors")
    model, _ = load_checkpoint(tmp_path / "run", "step-00000002")
    assert model.config.vocab_size == REAL_VOCAB_SIZE
    assert torch.equal(model.lm_head.weight, padded.lm_head.weight[:REAL_VOCAB_SIZE])


def test_a_run_whose_starting_folder_is_gone_reads_its_shape_from_its_export(tmp_path):
    """The folder a run started from (--init-from) gives its shape; deleted after the run (a download in /tmp), evals,
    evals.generate and training.export stopped, saying to give a folder they take no flag for. The run's own export
    has the same shape; without one, the line says to put the folder back."""
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_FILE).write_text(f"preset: tiny-cpu\ninit_from: {tmp_path / 'deleted'}\n")
    gone = r"init_from .*deleted: no such folder: the run's model shape comes from there; put it back"
    with pytest.raises(RunError, match=gone):
        run_model_config(run)
    GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32).save_pretrained(run / "export")
    shape = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=REAL_VOCAB_SIZE)
    assert run_model_config(run) == shape


def test_a_run_of_its_own_shape_reads_that_shape_back_and_a_checkpoint_loads_into_it(tmp_path):
    """n_layer, n_head and n_embd set over the preset, and a context longer than its: evals, evals.generate and
    training.export build the model a run trained from its config.yaml (they built the preset's, and its checkpoint
    did not load)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_FILE).write_text("preset: tiny-cpu\nn_layer: 3\nn_head: 4\nn_embd: 48\nblock_size: 128\n")
    shape = dataclasses.replace(get_preset("tiny-cpu"), n_layer=3, n_head=4, n_embd=48, block_size=128)
    assert run_model_config(run) == shape
    trained = GPT(shape)
    write_checkpoint(trained, checkpoint_dir(run, 1))
    model, _ = load_checkpoint(run, "step-00000001")
    assert model.config == shape and torch.equal(model.transformer.wpe.weight, trained.transformer.wpe.weight)


def test_a_shape_set_over_a_preset_is_one_line_where_it_cannot_be(tmp_path):
    """What no model can be (heads that do not divide the width), what the folder a run starts from decides (its
    shape), and positions it never trained, each one line naming the flag to change."""
    with pytest.raises(
        ValueError, match=r"^n_embd 48 is not divisible by n_head 5: .* give e.g. --n-head 4 \(heads of 12\)"
    ):
        model_shape("tiny-cpu", n_head=5, n_embd=48)
    preset_heads = r"^n_embd 101 is not divisible by n_head 2 \(the tiny-cpu preset's\)"
    with pytest.raises(ValueError, match=preset_heads):
        model_shape("tiny-cpu", n_embd=101)
    folder = tmp_path / "export"
    GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32).save_pretrained(folder)
    its_shape = rf"^--n-layer, --n-embd set the shape of a model trained from scratch, and init_from {folder}'s shape"
    with pytest.raises(ValueError, match=its_shape + r" is its config.json's: drop --n-layer, --n-embd \(or drop"):
        model_shape("tiny-cpu", None, str(folder), n_layer=2, n_embd=64)
    # from scratch, learned positions are any number of them; from a folder, its positions are all that were trained
    assert model_shape("tiny-cpu", 2048).block_size == 2048
    assert model_shape("tiny-cpu", 16, str(folder)).block_size == 16
    with pytest.raises(ValueError, match=rf"^block_size=64 exceeds {folder}'s 32 positions, .*: give --block-size 32"):
        model_shape("tiny-cpu", 64, str(folder))
