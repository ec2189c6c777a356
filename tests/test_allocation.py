"""LZW allocation (paper Algorithm 1): hand-checked codewords, invariants, and skew on real text."""

import pytest
import torch
from transformers import AutoTokenizer

from hfl3.models.l3gpt import bounds_from_counts, lzw_allocation, lzw_codeword_counts, uniform_allocation


def test_lzw_codewords_match_hand_trace():
    # a b a b a b a: emit a (add ab), b (add ba), ab (add aba), aba (end): a=1, b=1, ab=1+1, aba=1+1, ba=1
    a, b = 0, 1
    counts = lzw_codeword_counts([[a, b, a, b, a, b, a]])
    assert counts == {(a,): 1, (a, b): 2, (b,): 1, (b, a): 1, (a, b, a): 2}


def test_lzw_codewords_never_cross_sequences():
    counts = lzw_codeword_counts([[5, 6], [7]])
    assert (6, 7) not in counts and (5, 6) in counts and counts[(7,)] == 1


@pytest.mark.parametrize("vocab_size,n_emb,k_max", [(50, 50, 4), (50, 173, 8), (50, 400, 8), (7, 70, 10)])
def test_allocation_invariants(vocab_size, n_emb, k_max):
    generator = torch.Generator().manual_seed(0)
    sample = [torch.randint(0, vocab_size, (300,), generator=generator).tolist() for _ in range(3)]
    for counts in (lzw_allocation(sample, vocab_size, n_emb, k_max), uniform_allocation(vocab_size, n_emb, k_max)):
        assert counts.shape == (vocab_size,)
        assert int(counts.sum()) == n_emb
        assert int(counts.min()) >= 1 and int(counts.max()) <= k_max
        bounds = bounds_from_counts(counts)
        assert bounds.shape == (vocab_size + 1,) and bounds[0] == 0 and bounds[-1] == n_emb
        assert torch.equal(bounds[1:] - bounds[:-1], counts)


def test_allocation_credits_last_token_of_frequent_codewords():
    # token 3 ends the most frequent codewords; token 9 never occurs
    sample = [[1, 2, 3] * 50, [4, 3] * 40]
    counts = lzw_allocation(sample, vocab_size=10, n_emb=30, k_max=8)
    assert counts[3] == 8  # capped at k_max
    assert counts[9] < counts[3] and counts[0] < counts[3]


@pytest.mark.parametrize("bad", [dict(n_emb=9), dict(n_emb=81), dict(k_max=0)])
def test_allocation_rejects_impossible_budgets(bad):
    kwargs = dict(vocab_size=10, n_emb=20, k_max=8) | bad
    with pytest.raises(ValueError, match="n_emb|k_max"):
        lzw_allocation([[1, 2]], **kwargs)


def test_allocation_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="outside"):
        lzw_allocation([[1, 12]], vocab_size=10, n_emb=20, k_max=8)


def test_real_text_allocation_is_skewed(assets):
    """nanochat's L3 pull request (karpathy/nanochat#559) allocator came out near-uniform; the paper's must favour frequent tokens."""
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:300_000]
    ids = tokenizer(text)["input_ids"]
    vocab_size = len(tokenizer)
    mean = 4
    k_max = 16 * mean
    counts = lzw_allocation([ids], vocab_size, mean * vocab_size, k_max)
    frequency = torch.bincount(torch.tensor(ids), minlength=vocab_size)
    top = frequency.argsort(descending=True)[:50]
    assert counts[top].float().mean() >= 8 * mean  # the most frequent tokens get many times the mean
    assert int((counts == k_max).sum()) >= 50
    unseen = counts[frequency == 0].float().mean()
    assert unseen < mean  # budget moved from tokens the sample never uses
