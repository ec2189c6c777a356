"""L3GPT keeps transformers' conventions: `return_dict=False`, `resize_token_embeddings` (value embeddings and L3
tables grow with the vocabulary), RoPE scaling types, attention implementation switching, static cache and compiled
decoding, whole-graph compilation of the training forward."""

import pytest
import torch

from test_l3gpt import VOCAB, skewed_model, tiny_config


@pytest.mark.parametrize("where", ["kwarg", "config"])
def test_return_dict_false_returns_the_outputs_as_a_tuple(where):
    model = skewed_model(tiny_config()).eval()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, expected_base = model(ids, labels=ids), model.model(ids)
        if where == "config":
            model.config.return_dict = False
            out, base = model(ids, labels=ids), model.model(ids)
        else:
            out, base = model(ids, labels=ids, return_dict=False), model.model(ids, return_dict=False)
    assert isinstance(out, tuple) and isinstance(base, tuple)
    loss, logits, cache = out
    torch.testing.assert_close(loss, expected.loss, rtol=0, atol=0)
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(base[0], expected_base.last_hidden_state, rtol=0, atol=0)
