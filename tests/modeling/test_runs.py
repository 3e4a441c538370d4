"""modeling.runs: the weights of a trained model, whatever wraps it, under our GPT's own keys."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from accelerate.utils.other import compile_regions
from torch.nn.parallel import DistributedDataParallel

from modeling.config import get_preset
from modeling.gpt import GPT
from modeling.runs import model_shape, plain_state_dict


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
