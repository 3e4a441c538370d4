"""The GPT-2 BPE tokenizer (tiktoken), usable offline.

Lookup order: our cached copy of the BPE ranks, then tiktoken's own "gpt2" (network or
TIKTOKEN_CACHE_DIR), then provisioning the ranks from the `openai-whisper` sdist on PyPI,
which ships them byte-identical to tiktoken's r50k_base. The transformers export's tokenizer is built from
GPT-2's vocab.json and merges.txt contents, derived from the ranks and cached beside them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

import tiktoken
import tiktoken.load

from data_prep import DataPrepError
from data_prep.assets import CacheNotWritable, sdist, writing_cache
from modeling.config import EOT_ID, REAL_VOCAB_SIZE
from modeling.disk import atomic_write_bytes, cache_dir

if TYPE_CHECKING:
    from modeling.hf_export import VocabAndMerges  # imports transformers: for the type alone

TOKENIZER_NAME = "gpt2"
# sha256 of the BPE ranks in tiktoken's file format (identical for gpt2 and r50k_base).
TOKENIZER_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
VOCAB_SIZE = REAL_VOCAB_SIZE
# tiktoken's own GPT-2 split pattern (tiktoken_ext/openai_public.py, r50k_pat_str).
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# The PyPI sdist that ships the GPT-2 ranks: (name, version, sha256 of the archive).
WHISPER_SDIST = ("openai-whisper", "20250625", "37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96")
_WHISPER_MEMBER = "whisper/assets/gpt2.tiktoken"


def ranks_path() -> Path:
    """Where the provisioned BPE ranks file lives (copy it here by hand on air-gapped machines)."""
    return cache_dir() / "tokenizer" / "gpt2.tiktoken"


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 encoding; raises DataPrepError saying how to provision it if nothing works."""
    path = ranks_path()
    if path.is_file() and _sha256(path.read_bytes()) == TOKENIZER_SHA256:
        return _from_ranks_file(str(path))
    try:
        return tiktoken.get_encoding(TOKENIZER_NAME)
    except Exception as tiktoken_error:  # network errors come in many types (requests, OSError, ...)
        try:
            _provision_ranks()
        except DataPrepError as provision_error:
            by_hand = f"\n(or extract {_WHISPER_MEMBER} from that archive to {path})"
            if isinstance(provision_error, CacheNotWritable):  # nothing can be put there by hand either
                by_hand = ""
            raise DataPrepError(
                f"cannot load the GPT-2 tokenizer: tiktoken could not fetch it ({type(tiktoken_error).__name__}), "
                f"and {provision_error}{by_hand}"
            ) from provision_error
    return _from_ranks_file(str(path))


def prompt_tokens(prompt: str) -> list[int]:
    """A prompt's tokens for generation: <|endoftext|> as the document separator (as the export's transformers
    tokenizer and nanoGPT's sample.py read it), and an empty prompt as the start of a new document (the separator
    alone). GPT-2 has no other special token, so no prompt a user can type raises."""
    return get_encoding().encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT_ID]


def vocab_and_merges_path() -> Path:
    """Where gpt2_vocab_and_merges keeps what it derives from the ranks."""
    return cache_dir() / "tokenizer" / "gpt2-vocab-merges.json"


@functools.cache
def gpt2_vocab_and_merges() -> VocabAndMerges:
    """GPT-2's vocab.json and merges.txt contents (what the export's transformers tokenizer is built from),
    derived from the BPE ranks (~2 s) once per machine and kept beside them, under the ranks' sha256; a missing or
    damaged file is derived again (and a cache that cannot be written, each time)."""
    path = vocab_and_merges_path()
    try:
        saved = json.loads(path.read_bytes())
        if saved["ranks_sha256"] == TOKENIZER_SHA256 and len(saved["vocab"]) == VOCAB_SIZE:
            return saved["vocab"], [(left, right) for left, right in saved["merges"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or damaged: derived again below
    vocab, merges = _derive_vocab_and_merges(get_encoding())
    try:
        saved = {"ranks_sha256": TOKENIZER_SHA256, "vocab": vocab, "merges": merges}
        atomic_write_bytes(path, json.dumps(saved, ensure_ascii=False).encode())
    except OSError:
        pass  # a read-only or full cache: the export has what it needs, the next process derives again
    return vocab, merges


def _derive_vocab_and_merges(encoding: tiktoken.Encoding) -> VocabAndMerges:
    """From tiktoken's BPE ranks (no blobfile, no network): a token is its bytes spelled in GPT-2's byte-to-unicode
    alphabet, and the merge that made the token of rank r is the last step of BPE over its bytes with the ranks
    below r."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    ranks = {token: encoding.encode_single_token(token) for token in encoding.token_byte_values()}
    alphabet = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _last_merge(token, rank, ranks)
            merges.append((spell(left), spell(right)))
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab.update({name: encoding.encode_single_token(name) for name in encoding.special_tokens_set})
    return vocab, merges


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        merged = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(merged)
        if best >= rank:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens: not a BPE")
    return parts[0], parts[1]


def _provision_ranks() -> None:
    archive = sdist(*WHISPER_SDIST)  # sha256-pinned, so the member is known to be there and right
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + _WHISPER_MEMBER))
        ranks = tar.extractfile(member).read()
    with writing_cache(ranks_path().parent):
        atomic_write_bytes(ranks_path(), ranks)


def _from_ranks_file(path: str) -> tiktoken.Encoding:
    ranks = tiktoken.load.load_tiktoken_bpe(path, expected_hash=TOKENIZER_SHA256)
    return tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
