"""HellaSwag / LAMBADA scoring: per-example parity with transformers, memorization, chance level."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2LMHeadModel

from data_prep.tokenizer import get_encoding, gpt2_vocab_and_merges
from evals import lambada
from evals.data import load_examples, provision
from evals.runner import evaluate_tasks, run_task
from evals.scoring import Request, score_requests
from modeling.config import REAL_VOCAB_SIZE, GPTConfig
from modeling.gpt import GPT
from modeling.hf_export import export_hf

# block_size 64 truncates most HellaSwag contexts (their median is 56 tokens, endings 33), so the
# left-truncation path is exercised as well.
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)


@pytest.fixture(scope="module", autouse=True)
def eval_data() -> None:
    provision()  # into the user cache, once; offline afterwards


def decisive_random_gpt(config: GPTConfig, seed: int) -> GPT:
    """A random GPT with weights large enough for peaked predictions: near-ties between endings (which
    rounding could flip) are then far rarer than with GPT-2's small init, whose predictions are ~uniform."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def reference_scores(hf: GPT2LMHeadModel, context: str, continuation: str) -> tuple[float, int, bool]:
    """(summed NLL, tokens scored, greedy match) of one request, unbatched, through transformers."""
    enc = get_encoding()
    cont = enc.encode(continuation)
    tokens = torch.tensor((enc.encode(context) + cont)[-(hf.config.n_positions + 1) :])
    n = min(len(cont), len(tokens) - 1)
    logits = hf(tokens[None, :-1]).logits[0, -n:, :REAL_VOCAB_SIZE].double()
    targets = tokens[-n:]
    nll = F.cross_entropy(logits, targets, reduction="sum").item()
    return nll, n, bool((logits.argmax(-1) == targets).all())


@torch.no_grad()
def test_predictions_match_transformers_on_the_export(tmp_path):
    model = decisive_random_gpt(TINY, seed=0)
    hf = GPT2LMHeadModel.from_pretrained(export_hf(model, tmp_path / "export", gpt2_vocab_and_merges())).eval()
    assert hf.config.n_positions == TINY.block_size

    ours = run_task(model, "hellaswag", get_encoding(), limit=10, batch_size=3)  # 3: examples span batches
    ref_nll, ref_norm, ref_sum = [], [], []
    for ex in ours.examples:
        rows = [reference_scores(hf, ex["ctx"], " " + ending) for ending in ex["endings"]]
        ref_nll += [nll for nll, _, _ in rows]
        ref_norm.append(min(range(4), key=lambda i: rows[i][0] / rows[i][1]))
        ref_sum.append(min(range(4), key=lambda i: rows[i][0]))
    assert ours.predictions["pred_norm"].tolist() == ref_norm
    assert ours.predictions["pred_sum"].tolist() == ref_sum
    torch.testing.assert_close(ours.scores.nll, torch.tensor(ref_nll, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    assert len(set(ref_norm)) > 1  # the comparison is not trivially "always ending 0"

    ours = run_task(model, "lambada", get_encoding(), limit=10, batch_size=4)
    ref = [reference_scores(hf, ex["context"], ex["target"]) for ex in ours.examples]
    assert ours.predictions["correct"].tolist() == [greedy for _, _, greedy in ref]
    ref_nll = torch.tensor([nll for nll, _, _ in ref], dtype=torch.float64)
    torch.testing.assert_close(ours.predictions["nll"], ref_nll, rtol=1e-4, atol=1e-4)
    ppl = math.exp(sum(nll for nll, _, _ in ref) / sum(n for _, n, _ in ref))
    assert ours.metrics["lambada_ppl"] == pytest.approx(ppl, rel=1e-4)

    # A continuation longer than the context window: only its last block_size tokens can be scored.
    long_text = " " + " ".join(ex["context"] for ex in ours.examples[:2])
    request = Request(get_encoding().encode("Hello"), get_encoding().encode(long_text))
    long = score_requests(model, [request], TINY.block_size, batch_size=1)
    ref_long = reference_scores(hf, "Hello", long_text)
    assert long.num_tokens.item() == ref_long[1] == TINY.block_size
    assert long.nll.item() == pytest.approx(ref_long[0], rel=1e-4)

    # Wrappers that must be called whole (FSDP, DeepSpeed) go through model(idx): the same scores.
    requests = lambada.requests(ours.examples, get_encoding())
    wrapped = score_requests(torch.nn.DataParallel(model), requests, TINY.block_size, batch_size=4)
    torch.testing.assert_close(wrapped.nll, ours.scores.nll)


def test_memorized_examples_score_perfectly():
    """Train on 4 HellaSwag contexts with their right ending and 4 LAMBADA passages; all 8 are then right."""
    enc = get_encoding()
    config = dataclasses.replace(TINY, block_size=128)
    hellaswag, lambada = load_examples("hellaswag", 4), load_examples("lambada", 4)
    pairs = [(enc.encode(ex["ctx"]), enc.encode(" " + ex["endings"][ex["label"]])) for ex in hellaswag]
    pairs += [(enc.encode(ex["context"]), enc.encode(ex["target"])) for ex in lambada]
    width = max(len(c) + len(t) for c, t in pairs) - 1
    assert width <= config.block_size  # no truncation: the model sees what it is scored on
    x = torch.tensor([(c + t)[:-1] + [0] * (width + 1 - len(c) - len(t)) for c, t in pairs])
    # Loss on the continuation tokens only: the vocab-sized head then runs at ~40 positions, not ~700.
    y = torch.tensor([[-1] * (len(c) - 1) + t + [-1] * (width + 1 - len(c) - len(t)) for c, t in pairs])
    torch.manual_seed(0)
    model = GPT(config)
    before = evaluate_tasks(model, None, "hellaswag,lambada", 4, enc)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(40):  # the 8 are right from step ~30 on
        loss = F.cross_entropy(model.lm_head(model.hidden_states(x)[y >= 0]), y[y >= 0])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = evaluate_tasks(model, None, ["hellaswag", "lambada"], 4, enc)
    assert after["hellaswag_acc_norm"] == after["hellaswag_acc"] == after["lambada_acc"] == 1.0
    assert after["lambada_ppl"] < 1.5 < 1000 < before["lambada_ppl"]
    assert before["lambada_acc"] == 0.0
    assert model.training  # evaluation restores the mode it found


def test_untrained_model_is_at_chance():
    """acc_norm of a freshly initialized model on 200 examples lies in the central 99% of Binomial(200, 0.25)."""
    torch.manual_seed(0)
    n = 200
    acc = run_task(GPT(TINY), "hellaswag", get_encoding(), limit=n).metrics["hellaswag_acc_norm"]
    low, high = binomial_interval(n, 0.25, 0.99)
    assert (low, high) == (35, 66)  # acc_norm 0.175 .. 0.33
    assert low <= round(acc * n) <= high


def binomial_interval(n: int, p: float, mass: float) -> tuple[int, int]:
    """Smallest k_lo and largest k_hi with P(X < k_lo) and P(X > k_hi) each at most (1 - mass) / 2."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    tail = (1 - mass) / 2
    low = next(k for k in range(n + 1) if sum(pmf[: k + 1]) > tail)
    high = next(k for k in range(n, -1, -1) if sum(pmf[k:]) > tail)
    return low, high
