"""modeling.hf_export: a round trip through a transformers GPT-2 folder keeps the logits and the tokenizer."""

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from data_prep.sources import iter_documents
from data_prep.tokenizer import get_encoding, gpt2_vocab_and_merges
from modeling.config import PADDED_VOCAB_SIZE, PRESETS, REAL_VOCAB_SIZE, GPTConfig
from modeling.gpt import GPT
from modeling.hf_export import (
    check_export,
    export_hf,
    from_hf_state_dict,
    hf_config,
    load_hf,
    load_hf_config,
    to_hf_state_dict,
)
from testkit import NO_DATASETS, distinct_gpt

SAMPLE = (
    "It was the best of times, it was the worst of times;\n\n  ünïcödé, 1234 tabs\tand <|endoftext|> too.\r\n"
    "   runs   of spaces,\n\n\n\nblank lines, trailing spaces   \n you'll we've I'M 你好 🤗 ½ 3.14159 -- end  \t"
)


@pytest.fixture(scope="module")
def export(tiny_gpt: GPT, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export with blobfile hidden from this process (as in an image without it): `import blobfile` fails."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "blobfile", None)
        return export_hf(tiny_gpt, tmp_path_factory.mktemp("hf") / "export", gpt2_vocab_and_merges())


def ids(length: int = 16) -> torch.Tensor:
    return torch.randint(0, REAL_VOCAB_SIZE, (2, length), generator=torch.Generator().manual_seed(0))


def test_export_writes_a_transformers_folder(export: Path):
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (export / name).is_file(), name


def test_the_text_generation_pipeline_writes_within_the_context(tiny_gpt: GPT, export: Path):
    """pipeline("text-generation") adds 256 new tokens where the model's generation config sets none, past a small
    context's learned positions (IndexError); the export sets half the context, and generate(max_new_tokens=...)
    still takes the caller's."""
    from transformers import pipeline

    (out,) = pipeline("text-generation", model=str(export))("ROMEO:", do_sample=False, return_tensors=True)
    assert len(out["generated_token_ids"]) == 3 + tiny_gpt.config.block_size // 2  # "ROMEO:" is 3 tokens
    model = GPT2LMHeadModel.from_pretrained(export)
    assert model.generate(ids()[:, :4], max_new_tokens=2, do_sample=False).shape == (2, 6)


# Shapes of a run's own (TrainConfig's n_layer, n_head, n_embd, block_size over a preset): 4 heads of 12, and a
# context of 2,048 learned positions, twice GPT-2's (the logits of its last 16, where only positions past 1,024 reach)
OWN_SHAPES = {
    "heads_of_12": GPTConfig(n_layer=3, n_head=4, n_embd=48, block_size=16, vocab_size=50304),
    "context_2048": GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=2048, vocab_size=50304),
}


@pytest.mark.parametrize("shape", [None, *OWN_SHAPES], ids=["tiny_gpt", *OWN_SHAPES])
def test_transformers_gives_the_same_logits_and_load_hf_round_trips(
    tiny_gpt: GPT, export: Path, tmp_path: Path, shape: str | None
):
    model, folder = (tiny_gpt, export)
    if shape is not None:
        model = distinct_gpt(OWN_SHAPES[shape])
        folder = export_hf(model, tmp_path / "export", gpt2_vocab_and_merges())
    tokens, keep = ids(model.config.block_size), 16
    with torch.no_grad():
        ours = model.lm_head(model.hidden_states(tokens)[:, -keep:])[..., :REAL_VOCAB_SIZE]
        hf = GPT2LMHeadModel.from_pretrained(folder).eval()
        assert hf.config.vocab_size == REAL_VOCAB_SIZE and hf.lm_head.weight is hf.transformer.wte.weight
        assert hf.config.n_positions == model.config.block_size
        assert (hf(tokens, logits_to_keep=keep).logits - ours).abs().max() < 1e-4
        back = load_hf(folder).eval()
        assert back.config == dataclasses.replace(model.config, vocab_size=REAL_VOCAB_SIZE)  # no padded rows
        assert torch.equal(back.lm_head(back.hidden_states(tokens)[:, -keep:]), ours)


# Every preset's shape, tiny: the CPU presets as they are, GPT-2's with their head counts (12, 16, 20, 25) in one layer
# of 4-wide heads
PRESET_SHAPES = {
    name: dataclasses.replace(preset, n_layer=1, n_embd=4 * preset.n_head) if name.startswith("gpt2") else preset
    for name, preset in PRESETS.items()
}


@pytest.mark.parametrize("preset", list(PRESET_SHAPES))
def test_transformers_logits_are_ours_to_float_rounding_at_a_trained_models_weight_scale(preset: str):
    """The conversion is exact: transformers' fp32 logits are ours to float rounding (measured <= 6e-7 of the largest
    logit). At GPT-2's init (weights of std 0.02) the pre-activations stay where GELU's tanh form and the exact erf one
    agree: a model computing the erf GELU was 5e-6 of the logits off, within the 1e-4 above. So the matrices are scaled
    to a trained model's spread (std 0.1), where it is 2e-4 off (a LayerNorm eps of 1e-6 for GPT-2's 1e-5: 3e-4)."""
    model = distinct_gpt(PRESET_SHAPES[preset])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    hf = GPT2LMHeadModel(hf_config(model.config)).eval()
    hf.load_state_dict(to_hf_state_dict(model), strict=True)  # as export_hf loads it before save_pretrained
    tokens = ids(min(model.config.block_size, 32))
    with torch.no_grad():
        ours = model.lm_head(model.hidden_states(tokens))[..., :REAL_VOCAB_SIZE]
        assert (hf(tokens).logits - ours).abs().max() <= 5e-6 * ours.abs().max()


def test_load_hf_trains_from_the_folders_loss_where_its_logits_are_far_below_zero(tmp_path: Path):
    """GPT-2's logits sit around -100 (its final LayerNorm's bias along a direction every embedding shares): a padded
    row of zeros (logit 0) beside them would take most of the softmax, and the first train loss would be ~100, not
    the folder model's. Built so here: a uniform -100 shift that leaves transformers' loss as it was."""
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16)).eval()
    with torch.no_grad():
        hf.transformer.ln_f.weight[0], hf.transformer.ln_f.bias[0] = 0.0, -10.0
        hf.transformer.wte.weight[:, 0] += 10.0
    hf.save_pretrained(tmp_path)
    x, y = ids(), ids().roll(1, dims=1)
    with torch.no_grad():
        assert hf(x).logits.max() < -50
        theirs = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
        _, ours = load_hf(tmp_path)(x, y)
    assert abs(ours.item() - theirs.item()) < 1e-4, (ours.item(), theirs.item())


def test_load_hf_takes_a_folder_padded_to_50304_and_drops_the_padded_rows(tmp_path: Path):
    """A GPT-2 converted from nanoGPT or llm.c keeps their 50,304 rows; --init-from refused it ("vocab_size 50304
    (ours: 50257)") with no advice. Its rows past GPT-2's ids are never tokens: here made the likeliest, they must
    neither be sampled nor enter the loss, which is the folder model's over the 50,257 real ids."""
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=PADDED_VOCAB_SIZE))
    with torch.no_grad():
        hf.transformer.wte.weight[REAL_VOCAB_SIZE:] = 10.0  # tied: the head's padded rows too
    hf.eval().save_pretrained(tmp_path)
    x, y = ids(), ids().roll(1, dims=1)
    model = load_hf(tmp_path).eval()
    assert model.config.vocab_size == REAL_VOCAB_SIZE
    with torch.no_grad():
        real = hf(x).logits[..., :REAL_VOCAB_SIZE]
        theirs = torch.nn.functional.cross_entropy(real.flatten(0, 1), y.flatten())
        assert (model(x)[0] - real).abs().max() < 1e-4
        _, ours = model(x, y)
        assert abs(ours.item() - theirs.item()) < 1e-4, (ours.item(), theirs.item())
        assert model.generate(x[:, :4], 8, top_k=1).max() < REAL_VOCAB_SIZE


def test_auto_tokenizer_encodes_like_tiktoken(tiny_gpt: GPT, export: Path):
    tokenizer = AutoTokenizer.from_pretrained(export)
    expected = get_encoding().encode(SAMPLE, allowed_special="all")
    assert tokenizer(SAMPLE)["input_ids"] == expected
    assert tokenizer.decode(expected) == SAMPLE
    assert tokenizer.eos_token_id == 50256 and tokenizer.model_max_length == tiny_gpt.config.block_size
    assert len(tokenizer) == REAL_VOCAB_SIZE


def test_auto_tokenizer_encodes_a_whole_book_like_tiktoken(export: Path):
    """Hamlet (~50k tokens of verse, prose, names and punctuation): every id the same, and back to the same text."""
    pytest.importorskip("datasets", reason=NO_DATASETS)
    tokenizer = AutoTokenizer.from_pretrained(export)
    text = next(iter_documents("default:hamlet")).text
    expected = get_encoding().encode_ordinary(text)
    assert tokenizer(text)["input_ids"] == expected
    assert tokenizer.decode(expected) == text


def test_check_export_refuses_what_the_export_would_refuse_and_passes_without_blobfile(monkeypatch):
    monkeypatch.setitem(sys.modules, "blobfile", None)
    rng, tokenizer = torch.get_rng_state(), gpt2_vocab_and_merges()
    check_export(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50304), tokenizer)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's init is the same with or without the check
    with pytest.raises(ValueError, match="only bias=True models can be exported"):
        check_export(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=50304, bias=False), tokenizer)


def test_conversion_rejects_a_missing_key_or_a_wrong_shape(tiny_gpt: GPT):
    hf_state = to_hf_state_dict(tiny_gpt)
    missing = {k: v for k, v in hf_state.items() if k != "transformer.h.1.ln_2.bias"}
    with pytest.raises(ValueError, match=r"missing \['transformer.h.1.ln_2.bias'\]"):
        from_hf_state_dict(missing, tiny_gpt.config)
    key = "transformer.h.0.mlp.c_fc.weight"
    untransposed = {**hf_state, key: hf_state[key].t()}
    with pytest.raises(ValueError, match=r"transformer.h.0.mlp.c_fc.weight: \(128, 32\) != \(32, 128\)"):
        from_hf_state_dict(untransposed, tiny_gpt.config)


def test_only_gpt2_shaped_models_export():
    with pytest.raises(ValueError, match="bias=True"):
        to_hf_state_dict(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=50304, bias=False)))
    with pytest.raises(ValueError, match="vocab_size 512"):
        to_hf_state_dict(GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=512)))


@pytest.mark.parametrize(
    ("field", "value"),
    [("scale_attn_by_inverse_layer_idx", True), ("tie_word_embeddings", False), ("layer_norm_epsilon", 1e-6)],
)
def test_load_hf_config_names_what_our_gpt_cannot_compute(tmp_path: Path, field: str, value: object):
    """Such a GPT-2 (Stanford CRFM's scale attention by layer, an untied head) would load and train something else,
    or fail only once its weights are read: one error at start-up names the field."""
    GPT2Config(n_layer=1, n_head=1, n_embd=8, **{field: value}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}: a GPT-2 our GPT cannot compute: {field} "):
        load_hf_config(tmp_path)


def test_load_hf_config_takes_the_shape_and_leaves_dropout_at_the_recipes(tmp_path: Path):
    GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=64, resid_pdrop=0.1).save_pretrained(tmp_path)  # as gpt2's
    assert load_hf_config(tmp_path) == GPTConfig(
        n_layer=2, n_head=2, n_embd=16, block_size=64, dropout=0.0, vocab_size=REAL_VOCAB_SIZE
    )


@pytest.mark.parametrize("config", [{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 12}, {}])
def test_load_hf_config_names_a_folder_that_is_not_gpt2(tmp_path: Path, config: dict):
    """Another architecture's config.json would otherwise become a GPT-2 config of defaults and fail far from here."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    kind = repr(config.get("model_type"))
    with pytest.raises(ValueError, match=rf"not a GPT-2 model \(model_type {kind}\); give a transformers GPT-2 folder"):
        load_hf_config(tmp_path)
