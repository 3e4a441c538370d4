"""modeling.reference: the seed baseline model, and its parity with our GPT once given the same weights."""

import torch
import torch.nn.functional as F

from modeling.config import REAL_VOCAB_SIZE, get_preset
from modeling.reference import ReferenceGPT


def test_book_gpt2_124m_has_163m_untied_parameters():
    with torch.device("meta"):
        model = ReferenceGPT(get_preset("gpt2-124m"))
    # The book's count for its GPT_CONFIG_124M (qkv_bias=False, untied head, 50,257 ids).
    assert sum(p.numel() for p in model.parameters()) == 163_009_536
    assert model.out_head.bias is None and model.trf_blocks[0].att.W_query.bias is None
    assert model.trf_blocks[0].att.mask.shape == (1024, 1024)


def test_same_logits_as_gpt_on_the_real_vocab(tiny_gpt):
    gpt = tiny_gpt
    ref = ReferenceGPT.from_gpt(gpt).eval()
    assert ref.out_head.weight.shape == (REAL_VOCAB_SIZE, 32)
    assert ref.out_head.weight.data_ptr() != ref.tok_emb.weight.data_ptr()  # untied copies
    idx = torch.randint(0, REAL_VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ref(idx), gpt(idx)[0][..., :REAL_VOCAB_SIZE], atol=1e-5, rtol=0)


def test_loss_is_cross_entropy_over_all_positions():
    ref = ReferenceGPT(get_preset("tiny-cpu"), vocab_size=100)
    idx, targets = torch.randint(0, 100, (2, 8)), torch.randint(0, 100, (2, 8))
    torch.testing.assert_close(ref.loss(idx, targets), F.cross_entropy(ref(idx).flatten(0, 1), targets.flatten()))
