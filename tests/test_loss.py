"""Memory-light loss (models/l3gpt/linear_cross_entropy.py): chunked linear + softcap + cross-entropy vs the
plain path (lm_head → float32 → softcap → transformers' loss), in values and gradients, and without building the
`(B, T, V)` logits."""

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.models.l3gpt.linear_cross_entropy import CHUNK_BYTES, causal_lm_loss, linear_cross_entropy

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def plain_logits(hidden, weight, softcap):
    logits = (hidden @ weight.t()).float()  # what nn.Linear then `.float()` give
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def random_case(rows, dtype, seed=0, hidden_size=24, vocab=61):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::3] = -100
    return hidden, weight, targets


# (name, dtype, softcap, chunk_size): chunk sizes that do not divide the 53 rows, one chunk, and one row per chunk
CASES = [
    ("fp32", torch.float32, None, 7),
    ("fp32-softcap", torch.float32, 2.0, 7),
    ("fp32-one-chunk", torch.float32, 2.0, None),
    ("fp32-row-chunks", torch.float32, 15.0, 1),
    ("bf16", torch.bfloat16, None, 7),
    ("bf16-softcap", torch.bfloat16, 2.0, 10),
]


@pytest.mark.parametrize("name, dtype, softcap, chunk_size", CASES, ids=[case[0] for case in CASES])
def test_chunked_equals_plain_cross_entropy(name, dtype, softcap, chunk_size):
    hidden, weight, targets = random_case(53, dtype)
    nll_sum, predictions = linear_cross_entropy(
        hidden, weight, targets, softcap, chunk_size=chunk_size, return_predictions=True, backend="chunked"
    )
    grads = torch.autograd.grad(nll_sum * 0.7, [hidden, weight])
    logits = plain_logits(hidden, weight, softcap)
    expected = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    expected_grads = torch.autograd.grad(expected * 0.7, [hidden, weight])
    assert nll_sum.dtype == torch.float32 and grads[0].dtype == dtype and grads[1].dtype == dtype
    torch.testing.assert_close(nll_sum, expected, **TOLERANCES[dtype])
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, **TOLERANCES[dtype])
    assert torch.equal(predictions, logits.argmax(-1))
    assert grads[0][targets == -100].abs().max() == 0  # ignored rows get no gradient


def test_softcap_matters_and_ignored_rows_add_nothing():
    hidden, weight, targets = random_case(20, torch.float32)
    capped = linear_cross_entropy(hidden, weight * 10, targets, softcap=1.0)[0]
    assert not torch.allclose(capped, linear_cross_entropy(hidden, weight * 10, targets)[0])
    kept = targets != -100
    torch.testing.assert_close(
        linear_cross_entropy(hidden, weight, targets, chunk_size=4)[0],
        linear_cross_entropy(hidden[kept], weight, targets[kept], chunk_size=4)[0],
    )


def test_no_grad_computes_no_gradients_and_frozen_weight_gets_none():
    hidden, weight, targets = random_case(9, torch.float32)
    with torch.no_grad():
        assert not linear_cross_entropy(hidden, weight, targets)[0].requires_grad
    frozen = weight.detach()
    loss = linear_cross_entropy(hidden, frozen, targets)[0]
    (grad,) = torch.autograd.grad(loss, [hidden])
    expected = F.cross_entropy(hidden @ frozen.t(), targets, reduction="sum")
    torch.testing.assert_close(grad, torch.autograd.grad(expected, [hidden])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(50), 17])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_causal_lm_loss_equals_transformers_for_causal_lm_loss(num_items_in_batch, softcap):
    hidden, weight, _ = random_case(2 * 13, torch.float32)
    hidden_states = hidden.view(2, 13, -1)
    labels = torch.randint(0, weight.shape[0], (2, 13))
    labels[0, :4] = -100
    loss = causal_lm_loss(hidden_states, weight, labels, softcap, num_items_in_batch=num_items_in_batch)
    logits = plain_logits(hidden_states, weight, softcap)
    expected = ForCausalLMLoss(logits, labels, weight.shape[0], num_items_in_batch=num_items_in_batch)
    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(torch.autograd.grad(loss, [hidden, weight]),
                                   torch.autograd.grad(expected, [hidden, weight])):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(causal_lm_loss(hidden_states, weight, None, softcap, num_items_in_batch,
                                              shift_labels=shifted), loss)


def test_all_ignored_targets_give_nan_like_transformers():
    hidden, weight, _ = random_case(6, torch.float32)
    labels = torch.full((1, 6), -100)
    assert causal_lm_loss(hidden[None], weight, labels).isnan()
    assert ForCausalLMLoss(hidden[None] @ weight.t(), labels, weight.shape[0]).isnan()


def tiny_l3gpt(vocab_size=256, dtype=torch.float32, seed=0, **overrides) -> L3GPTForCausalLM:
    torch.manual_seed(seed)
    config = L3GPTConfig.from_depth(
        2, vocab_size=vocab_size, aspect_ratio=32, head_dim=16, max_position_embeddings=64, window_pattern="SL",
        sliding_window=8, l3_after_layers=[0], l3_n_emb=2 * vocab_size, l3_k_max=8, l3_d_up=32,
        final_logit_softcapping=3.0, **overrides,
    )
    model = L3GPTForCausalLM(config)
    with torch.no_grad():  # nanochat's zero inits (output projections, smear) would leave gradients at zero
        for param in model.parameters():
            if param.ndim == 2 and not param.any():
                param.normal_(std=0.05)
        if model.model.smear is not None:
            model.model.smear.smear_lambda.fill_(0.5)
        model.lm_head.weight.normal_(std=0.3)  # logits large enough for the softcap to bite
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_items_in_batch", [None, torch.tensor(71)], ids=["mean", "num_items"])
def test_l3gpt_training_loss_and_gradients_equal_the_plain_path(dtype, num_items_in_batch):
    model = tiny_l3gpt(dtype=dtype)
    ids = torch.randint(0, 256, (3, 19))
    labels = ids.clone()
    labels[0, :7] = -100
    labels[2, 11:] = -100
    kwargs = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}
    results = []
    for return_logits in (False, True):
        model.zero_grad()
        out = model(ids, labels=labels, return_logits=return_logits, **kwargs)
        out.loss.backward()
        results.append((out, {name: p.grad.clone() for name, p in model.named_parameters()}))
    (chunked, chunked_grads), (plain, plain_grads) = results
    assert chunked.logits is None and plain.logits.shape == (3, 19, 256)
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(chunked.loss, plain.loss, **tolerance)
    for name, grad in plain_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(chunked_grads[name], grad, **tolerance, msg=name)
    with torch.no_grad():  # eval mode keeps the logits and the same loss
        evaluated = model.eval()(ids, labels=labels, **kwargs)
    assert evaluated.logits.shape == (3, 19, 256)
    torch.testing.assert_close(evaluated.loss, plain.loss, **tolerance)


def test_l3gpt_training_forward_builds_no_batch_seq_vocab_logits(largest_tensor):
    vocab = 8192
    model = tiny_l3gpt(vocab_size=vocab)
    batch, seq = 2, 1024  # 2048 rows: 2 chunks of 1024 rows at this vocab
    ids = torch.randint(0, vocab, (batch, seq))
    with largest_tensor() as chunked:
        model(ids, labels=ids).loss.backward()
    with largest_tensor() as plain:
        model(ids, labels=ids, return_logits=True).loss.backward()
    assert plain.numel >= batch * seq * vocab  # the recorder sees the full logits when they exist
    assert chunked.numel <= CHUNK_BYTES // 4 < batch * seq * vocab


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 15.0])
def test_liger_equals_chunked_and_plain_on_cuda(dtype, softcap):
    pytest.importorskip("liger_kernel")
    hidden, weight, targets = (t.cuda() for t in random_case(515, torch.float32, vocab=1024, hidden_size=64))
    hidden = hidden.detach().to(dtype).requires_grad_()
    weight = weight.detach().to(dtype).requires_grad_()
    liger = linear_cross_entropy(hidden, weight, targets, softcap, backend="liger")[0]
    liger_grads = torch.autograd.grad(liger, [hidden, weight])
    chunked = linear_cross_entropy(hidden, weight, targets, softcap, chunk_size=100, backend="chunked")[0]
    chunked_grads = torch.autograd.grad(chunked, [hidden, weight])
    expected = F.cross_entropy(plain_logits(hidden, weight, softcap), targets, reduction="sum")
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    tolerance = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else TOLERANCES[dtype]
    for value, grads in ((liger, liger_grads), (chunked, chunked_grads)):
        torch.testing.assert_close(value, expected, **tolerance)
        for grad, expected_grad in zip(grads, expected_grads):
            torch.testing.assert_close(grad, expected_grad, **tolerance)


@pytest.mark.gpu
def test_compiled_training_step_with_liger_equals_eager_chunked_on_cuda():
    """A compiled L3GPT forward + backward through Liger's loss (run outside the graph) gives the eager plain loss
    (full float32 logits) and its gradients, with ignored targets in the batch: Liger traced by `torch.compile`
    crashed on an H100 and is reported upstream to return a wrong loss when some targets are ignored."""
    pytest.importorskip("liger_kernel")
    model = tiny_l3gpt(vocab_size=1024).cuda()
    ids = torch.randint(0, 1024, (4, 64), device="cuda")
    labels = ids.masked_fill(torch.rand(ids.shape, device="cuda") < 0.25, -100)

    def loss_and_grads(forward, **kwargs):
        model.zero_grad(set_to_none=True)
        loss = forward(ids, labels=labels, **kwargs).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    compiled, compiled_grads = loss_and_grads(torch.compile(model))
    eager, eager_grads = loss_and_grads(model, return_logits=True)
    tolerance = dict(rtol=1e-4, atol=1e-5)  # float32, different reduction orders
    torch.testing.assert_close(compiled, eager, **tolerance)
    assert len(compiled_grads) == len(eager_grads)
    for got, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, expected, **tolerance)
