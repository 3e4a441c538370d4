"""Our GPT <-> transformers' GPT2LMHeadModel, and an export folder that loads offline with
`GPT2LMHeadModel.from_pretrained(folder)` / `AutoModelForCausalLM` and `AutoTokenizer.from_pretrained(folder)`.

The parameter names are the same on both sides; two things differ:
- GPT-2's Conv1D stores its weight as (in, out), the transpose of nn.Linear's (out, in);
- our embedding/head is padded to vocab_size (50,304) rows, GPT-2 has the 50,257 real ids. Export drops the
  padded rows; import keeps the folder's 50,257 (load_hf_config), as nanoGPT's from_pretrained does, so the loss is
  the folder model's: a padded row's logit would enter the softmax too. A folder padded to 50,304 itself (a
  conversion from nanoGPT or llm.c) loads the same way: its padded rows are dropped.
Every conversion checks every key and shape against the model it feeds, so a silent mismatch is impossible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import Tensor
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast
from transformers.utils import logging as hf_logging

from modeling.config import EOT_ID, PADDED_VOCAB_SIZE, REAL_VOCAB_SIZE, GPTConfig
from modeling.device import quiet_deepspeed
from modeling.disk import swap_in, umask_modes
from modeling.gpt import GPT, VOCAB_ROWS, real_vocab_rows
from modeling.runs import EXPORT_STEP_FILE

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# GPT-2's vocab.json (token -> id) and merges.txt (pairs in rank order) contents
VocabAndMerges = tuple[dict[str, int], list[tuple[str, str]]]


def hf_config(config: GPTConfig) -> GPT2Config:
    """The GPT2Config of the same shape: real vocab, tanh GELU ("gelu_new"), LayerNorm eps 1e-5, tied head."""
    return GPT2Config(
        vocab_size=REAL_VOCAB_SIZE,
        n_positions=config.block_size,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        activation_function="gelu_new",
        resid_pdrop=config.dropout,
        embd_pdrop=config.dropout,
        attn_pdrop=config.dropout,
        layer_norm_epsilon=1e-5,
        bos_token_id=EOT_ID,
        eos_token_id=EOT_ID,
        tie_word_embeddings=True,
    )


def _check_keys_and_shapes(state_dict: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    wrong = [
        f"{k}: {tuple(state_dict[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"state dict does not match {what}: missing {missing}, unexpected {unexpected}, wrong shapes {wrong}"
        )


def _check_exportable(config: GPTConfig) -> None:
    if not config.bias:
        raise ValueError("GPT-2 has biases in every Linear and LayerNorm: only bias=True models can be exported")
    if config.vocab_size < REAL_VOCAB_SIZE:
        raise ValueError(f"vocab_size {config.vocab_size} < {REAL_VOCAB_SIZE}: not a GPT-2 tokenizer model")


def _meta_state_dict(model_cls: type[torch.nn.Module], config: GPTConfig | GPT2Config) -> dict[str, Tensor]:
    with torch.device("meta"):  # shapes only, no memory, no init cost
        return model_cls(config).state_dict()


def to_hf_state_dict(model: GPT) -> dict[str, Tensor]:
    """model's weights as GPT2LMHeadModel's state dict (Conv1D weights transposed, vocab cut to 50,257)."""
    _check_exportable(model.config)
    out = {}
    for key, tensor in real_vocab_rows(model.state_dict()).items():
        if key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        out[key] = tensor.detach().contiguous()
    _check_keys_and_shapes(out, _meta_state_dict(GPT2LMHeadModel, hf_config(model.config)), "GPT2LMHeadModel")
    return out


def from_hf_state_dict(state_dict: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """A GPT2LMHeadModel state dict as one for GPT(config): transposed back, vocab padded with zero rows."""
    _check_exportable(config)
    state_dict = dict(state_dict)
    # Saved checkpoints keep a tied matrix once; our GPT, like transformers, has it under both names.
    if "lm_head.weight" not in state_dict and "transformer.wte.weight" in state_dict:
        state_dict["lm_head.weight"] = state_dict["transformer.wte.weight"]
    _check_keys_and_shapes(state_dict, _meta_state_dict(GPT2LMHeadModel, hf_config(config)), "GPT2LMHeadModel")
    if not torch.equal(state_dict["lm_head.weight"], state_dict["transformer.wte.weight"]):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: our GPT needs a tied head")
    out = {}
    for key, tensor in state_dict.items():
        if key in VOCAB_ROWS:
            tensor = torch.cat([tensor, tensor.new_zeros(config.vocab_size - REAL_VOCAB_SIZE, config.n_embd)])
        elif key.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()
        out[key] = tensor.contiguous()
    _check_keys_and_shapes(out, _meta_state_dict(GPT, config), "GPT")
    return out


def export_hf(model: GPT, out_dir: str | Path, vocab_and_merges: VocabAndMerges, step: int | None = None) -> Path:
    """Write a transformers folder (config.json, model.safetensors, generation_config.json, tokenizer.json,
    tokenizer_config.json) for model and the GPT-2 tokenizer (data_prep.tokenizer.gpt2_vocab_and_merges());
    returns out_dir. `step`: the optimizer step of a run whose weights these are, recorded in bookgpt.json (the Hub
    push compares it with the run's newest checkpoint).

    It is written as OUT.tmp and swapped in whole: a failed export (a full disk) leaves no partial folder and
    the previous export, if any, as it was."""
    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)  # left by an interrupted export
    quiet_deepspeed()  # save_pretrained imports it where installed
    try:
        hf_model = GPT2LMHeadModel(hf_config(model.config))
        hf_model.load_state_dict(to_hf_state_dict(model), strict=True)
        # The text-generation pipeline adds 256 new tokens where the model sets none, and generating past the learned
        # positions fails (IndexError): half the context leaves the other half to the prompt. (max_length would
        # make every generate(max_new_tokens=...) warn that both are set.)
        hf_model.generation_config.max_new_tokens = min(256, model.config.block_size // 2)
        with _no_progress_bars():
            hf_model.save_pretrained(tmp_dir)  # safetensors
        export_tokenizer(vocab_and_merges, tmp_dir, model.config.block_size)
        if step is not None:
            (tmp_dir / EXPORT_STEP_FILE).write_text(json.dumps({"step": step}) + "\n")
        umask_modes(tmp_dir)  # model.safetensors: readable as the other files are
        swap_in(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """Without transformers' progress bars ("Writing model shards", "Loading weights"): one file each here, and a
    launch's every rank would print its own."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def check_export(config: GPTConfig, vocab_and_merges: VocabAndMerges) -> None:
    """Raise now what export_hf would raise after training: the shape is GPT-2's, and a one-layer model of it
    with its tokenizer writes into a temporary folder and loads back with transformers. It leaves the RNG as it
    found it: the run's init must not depend on whether its export is checked."""
    _check_exportable(config)
    small = dataclasses.replace(config, n_layer=1, n_head=1, n_embd=8)
    with torch.random.fork_rng(devices=[]), tempfile.TemporaryDirectory(prefix="bookgpt-export-check-") as tmp:
        export_hf(GPT(small), tmp, vocab_and_merges)
        GPT2TokenizerFast.from_pretrained(tmp)


def export_tokenizer(vocab_and_merges: VocabAndMerges, out_dir: str | Path, model_max_length: int) -> None:
    """Write the GPT-2 tokenizer of these vocab.json and merges.txt contents (data_prep.tokenizer's
    gpt2_vocab_and_merges) as transformers saves it (class "GPT2Tokenizer", bos/eos/unk <|endoftext|>, as the Hub's
    gpt2); it encodes exactly as the tiktoken encoding they come from does, special tokens included."""
    vocab, merges = vocab_and_merges
    # GPT-2's byte-level BPE, as the Hub's gpt2 tokenizer.json has it; built here so any transformers wraps it
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = GPT2TokenizerFast(tokenizer_object=backend, model_max_length=model_max_length)
    tokenizer.save_pretrained(out_dir)


def load_hf_config(folder: str | Path) -> GPTConfig:
    """The GPTConfig of a transformers GPT-2 folder or Hub id (config.json only, no weights)."""
    if not Path(folder).expanduser().exists():
        _check_hub_reachable(str(folder))
    # GPT2Config reads any config.json, filling GPT-2 defaults for what another architecture names differently.
    saved = GPT2Config.get_config_dict(folder)[0]
    model_type = saved.get("model_type")
    if model_type != "gpt2":
        raise ValueError(
            f"not a GPT-2 model (model_type {model_type!r}); give a transformers GPT-2 folder (config.json with "
            "model_type 'gpt2', such as a run's export/) or a GPT-2 Hub id such as gpt2 or openai-community/gpt2-medium"
        )
    # Before GPT2Config: another vocabulary makes it warn (GPT-2's bos/eos id 50256 outside it) above this line.
    vocab_size = saved.get("vocab_size", REAL_VOCAB_SIZE)
    if vocab_size not in (REAL_VOCAB_SIZE, PADDED_VOCAB_SIZE):
        raise ValueError(
            f"{folder}: vocab_size {vocab_size!r} is not the GPT-2 tokenizer's {REAL_VOCAB_SIZE} ids (nor "
            f"{PADDED_VOCAB_SIZE}, those padded), which the data is tokenized with; give a GPT-2 of that tokenizer "
            "(gpt2, gpt2-medium, a run's export/) or train from scratch without --init-from"
        )
    c = GPT2Config.from_pretrained(folder)
    # What our GPT hard-codes; a folder that differs would load without error and compute something else (or fail
    # only once its weights are read: an untied head).
    wanted = {
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "n_inner": 4 * c.n_embd, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": True, "add_cross_attention": False,
    }  # fmt: skip
    found = {key: getattr(c, key) for key in wanted} | {"n_inner": c.n_inner or 4 * c.n_embd}
    differ = [f"{key} {found[key]!r} (ours: {value!r})" for key, value in wanted.items() if found[key] != value]
    if differ:
        raise ValueError(f"{folder}: a GPT-2 our GPT cannot compute: {', '.join(differ)}")
    # dropout stays the recipe's 0, as nanoGPT's init_from keeps it, not the 0.1 of the Hub's gpt2 config; no padded
    # vocab rows, not even a padded folder's (load_hf drops them): zeros have logit 0, far above GPT-2's own (around
    # -100 for gpt2), and would take most of the softmax
    return GPTConfig(
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.n_positions, vocab_size=REAL_VOCAB_SIZE
    )


def _check_hub_reachable(repo_id: str) -> None:
    """An OSError now where huggingface.co cannot be reached and repo_id's config.json is not in the local cache:
    huggingface_hub would retry the download with backoff for half a minute (more behind a firewall that drops
    packets), one warning line a try. One request, no retries, HF_HUB_ETAG_TIMEOUT's seconds at most."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    try:
        if constants.HF_HUB_OFFLINE or try_to_load_from_cache(repo_id, "config.json") is not None:
            return  # from the cache only: no request, no retries
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (HfHubHTTPError, ValueError):  # the Hub answered (no such model, gated) or a malformed id: transformers says
        return
    except Exception as err:  # huggingface_hub's HTTP client's own connect, DNS and timeout errors
        raise OSError(f"cannot reach {constants.ENDPOINT} ({type(err).__name__}: {err}).") from None


def load_hf(folder: str | Path, config: GPTConfig | None = None) -> GPT:
    """A GPT (of GPT-2's 50,257 ids, unpadded) from a transformers GPT-2 folder or Hub id, such as export_hf writes.
    config (default: load_hf_config's) may shorten block_size: the position table keeps its first rows. A ValueError
    says what is wrong with the folder (another model, weights that do not load)."""
    saved = load_hf_config(folder)
    config = config or saved
    # Only the weights are read, so the layers stay plain torch: transformers 5.25 made from_pretrained swap layers
    # for Hub kernels by default (use_kernels), refusing to load without the kernels package at its pinned version.
    with _no_progress_bars():
        try:
            hf = GPT2LMHeadModel.from_pretrained(folder, use_kernels=False)
        except Exception as err:  # safetensors' SafetensorError (a truncated file), OSError (none, or no download)
            said = " ".join(str(err).split())[:300]
            raise ValueError(
                f"its weights do not load ({type(err).__name__}: {said}); export the run again (python -m "
                "training.export RUN) or give another folder"
            ) from None
        # a padded folder's rows past GPT-2's ids are never tokens (load_hf_config keeps 50,257)
        state_dict = from_hf_state_dict(real_vocab_rows(hf.state_dict()), saved)
    state_dict["transformer.wpe.weight"] = state_dict["transformer.wpe.weight"][: config.block_size]
    model = GPT(config)
    model.load_state_dict(state_dict, strict=True)
    return model
