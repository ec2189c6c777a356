"""L3GPT: L3 lookup vs the padded reference, HF integration (masks, cache, loss, save/load, remote code), configs,
nanochat master's features (value embeddings, smear, backout) and configs saved before them."""

import copy
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hfl3
from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.models.l3gpt import l3_routing, lzw_allocation
from hfl3.models.l3gpt.configuration_l3gpt import LEGACY_FIELD_VALUES
from hfl3.models.l3gpt.modeling_l3gpt import L3GPTSmear
from hfl3.models.l3gpt.reference import padded_lookup_reference

VOCAB = 96


def tiny_config(**overrides) -> L3GPTConfig:
    kwargs = dict(
        vocab_size=VOCAB, aspect_ratio=32, head_dim=16, max_position_embeddings=64, window_pattern="SL",
        sliding_window=8, l3_after_layers=[0], l3_n_emb=500, l3_k_max=24, l3_d_up=48, num_key_value_heads=2,
    )
    kwargs.update(overrides)
    return L3GPTConfig.from_depth(2, **kwargs)


def skewed_model(config: L3GPTConfig, seed: int = 0, randomize_zero_inits: bool = True) -> L3GPTForCausalLM:
    """A model with an LZW allocation and (optionally) non-zero output projections and smear, so every path is
    exercised."""
    torch.manual_seed(seed)
    model = L3GPTForCausalLM(config)
    sample = [torch.randint(0, config.vocab_size // 3, (400,)).tolist()]
    if config.l3_after_layers:
        model.set_l3_allocation(lzw_allocation(sample, config.vocab_size, config.l3_n_emb, config.l3_k_max))
    if randomize_zero_inits:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim == 2 and not param.any():
                    param.normal_(std=0.05)
            if model.model.smear is not None:
                model.model.smear.smear_lambda.fill_(0.8)
    return model


def test_from_depth_sizes_like_nanochat():
    config = L3GPTConfig.from_depth(12, vocab_size=32768)
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (768, 6, 12)
    assert config.head_dim == 128 and config.intermediate_size == 4 * 768
    assert config.layer_types[-1] == "full_attention" and config.layer_types[0] == "sliding_attention"
    assert config.sliding_window == 512  # a quarter of 2048, multiple of 128
    odd = L3GPTConfig.from_depth(3, vocab_size=1000, aspect_ratio=64, head_dim=128)
    assert odd.hidden_size == 256 and odd.vocab_size == 1024


def test_nanochat_master_features_are_on_for_new_configs():
    config = L3GPTConfig.from_depth(12, vocab_size=32768)
    assert config.value_embedding_layers == [1, 3, 5, 7, 9, 11]  # nanochat's has_ve: alternating, last included
    assert L3GPTConfig.from_depth(3, vocab_size=64).value_embedding_layers == [0, 2]
    assert config.use_smear_gate and config.use_backout
    assert (config.value_embedding_gate_channels, config.smear_gate_channels) == (12, 24)
    off = tiny_config(**copy.deepcopy(LEGACY_FIELD_VALUES))
    model = L3GPTForCausalLM(off)
    assert not len(model.model.value_embeddings) and model.model.smear is None and model.model.backout_lambda is None


def test_auto_classes_build_l3gpt():
    config = AutoConfig.for_model("l3gpt", vocab_size=64, hidden_size=32, num_attention_heads=2, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, L3GPTForCausalLM)
    assert hfl3.__version__


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(l3_n_emb=VOCAB - 1), "l3_n_emb"),
        (dict(l3_after_layers=[2]), "l3_after_layers"),
        (dict(l3_k_max=0), "l3_k_max"),
        (dict(window_pattern="SXL"), "window_pattern"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(value_embedding_layers=[2]), "value_embedding_layers"),
        (dict(value_embedding_gate_channels=0), "value_embedding_gate_channels"),
        (dict(smear_gate_channels=65), "smear_gate_channels"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(ValueError, match="hidden_size"):
        L3GPTConfig(vocab_size=64, hidden_size=30, num_attention_heads=4)


@pytest.mark.parametrize("tie_kv", [True, False])
@pytest.mark.parametrize("chunk_size", [1 << 16, 5])
def test_lookup_matches_padded_reference(tie_kv, chunk_size):
    config = tiny_config(l3_tie_kv=tie_kv)
    model = skewed_model(config).double()
    layer = model.model.l3_layers["0"]
    layer.pair_chunk_size = chunk_size
    ids = torch.randint(0, VOCAB, (70,))
    x = torch.randn(70, config.hidden_size, dtype=torch.float64, requires_grad=True)
    fast = layer.lookup(x, l3_routing(ids, model.model.l3_bounds))
    x_ref = x.detach().clone().requires_grad_()
    values = layer.key_table.weight if tie_kv else layer.value_table.weight
    ref = padded_lookup_reference(x_ref, layer.key_table.weight, values, model.model.l3_bounds, ids, config.l3_k_max)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(fast)
    params = [layer.key_table.weight] + ([] if tie_kv else [layer.value_table.weight])
    for fast_grad, ref_grad in zip(
        torch.autograd.grad(fast, [x, *params], grad_out), torch.autograd.grad(ref, [x_ref, *params], grad_out)
    ):
        torch.testing.assert_close(fast_grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_fresh_l3_layer_is_a_noop():
    with_l3 = L3GPTForCausalLM(tiny_config())
    dense = L3GPTForCausalLM(tiny_config(l3_after_layers=[]))
    missing, unexpected = dense.load_state_dict(with_l3.state_dict(), strict=False)
    assert not missing and all(key.startswith("model.l3_") for key in unexpected)
    ids = torch.randint(0, VOCAB, (2, 20))
    torch.testing.assert_close(with_l3(ids).logits, dense(ids).logits, rtol=0, atol=0)


def test_loss_is_shifted_and_honours_num_items_in_batch():
    # eval mode: the logits path (training mode's chunked loss is checked against it in test_loss.py)
    model = skewed_model(tiny_config()).eval()
    ids = torch.randint(0, VOCAB, (2, 12))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, model.config.vocab_size)
    targets = labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    n_targets = int((targets != -100).sum())
    torch.testing.assert_close(out.loss, expected / n_targets)
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(3 * n_targets)).loss
    torch.testing.assert_close(summed, expected / (3 * n_targets))


def test_logit_softcap_bounds_logits():
    model = skewed_model(tiny_config(final_logit_softcapping=2.0))
    with torch.no_grad():
        model.lm_head.weight.mul_(1000)
    logits = model(torch.randint(0, VOCAB, (1, 8))).logits
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padding_and_packing_masks(attn):
    model = skewed_model(tiny_config())
    model.config._attn_implementation = attn
    doc_a, doc_b = torch.randint(0, VOCAB, (1, 7)), torch.randint(0, VOCAB, (1, 5))
    alone_a, alone_b = model(doc_a).logits, model(doc_b).logits
    # left padding with attention_mask gives the unpadded logits on the real tokens
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), doc_b], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(padded, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(out[:, 3:], alone_b, rtol=1e-5, atol=1e-5)
    # packed documents with restarting position_ids do not attend to each other
    packed = torch.cat([doc_a, doc_b], dim=1)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    out = model(packed, position_ids=positions).logits
    torch.testing.assert_close(out[:, :7], alone_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 7:], alone_b, rtol=1e-5, atol=1e-5)


def test_sdpa_equals_eager_with_sliding_window():
    model = skewed_model(tiny_config())
    ids = torch.randint(0, VOCAB, (2, 30))  # longer than the window of 8
    model.config._attn_implementation = "sdpa"
    sdpa = model(ids).logits
    model.config._attn_implementation = "eager"
    torch.testing.assert_close(model(ids).logits, sdpa, rtol=1e-5, atol=1e-5)
    model.config._attn_implementation = "sdpa"
    full = skewed_model(tiny_config(window_pattern="L"))
    full.load_state_dict(model.state_dict())
    assert not torch.allclose(full(ids).logits[:, 10:], sdpa[:, 10:], atol=1e-4)  # the window changes the result


def test_whole_causal_rows_skip_the_mask_for_sdpa(monkeypatch):
    """Rows without position_ids, padding or cache reach SDPA with no mask (its causal flash kernel) and give the
    logits of the masked path; eager attention still gets its mask."""
    from hfl3.models.l3gpt import modeling_l3gpt

    built = []
    original = modeling_l3gpt.create_causal_mask
    monkeypatch.setattr(modeling_l3gpt, "create_causal_mask", lambda **kw: built.append(1) or original(**kw))
    model = skewed_model(tiny_config(window_pattern="L"))
    ids = torch.randint(0, VOCAB, (2, 30))
    plain = model(ids).logits
    assert built == []
    masked = model(ids, position_ids=torch.arange(30)[None].expand(2, -1)).logits
    assert built == [1]
    torch.testing.assert_close(plain, masked, rtol=1e-5, atol=1e-5)
    model.config._attn_implementation = "eager"
    torch.testing.assert_close(model(ids).logits, plain, rtol=1e-5, atol=1e-5)
    assert built == [1, 1]


def test_greedy_generate_with_cache_equals_full_recompute():
    model = skewed_model(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # sharpen so greedy choices are not near-ties
    prompt = torch.randint(0, VOCAB, (1, 5))
    generated = model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(20):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)


@pytest.mark.parametrize("with_config", [True, False], ids=["cache_from_config", "lazy_cache"])
def test_cached_chunks_equal_one_full_forward(with_config, monkeypatch):
    """Several tokens at a time through a DynamicCache (prefill, then a chunk of 1, then of 11): the smear of each
    chunk's first token reads the previous token's embedding from the cache, so the logits are the full forward's."""
    model = skewed_model(tiny_config()).eval()
    ids = torch.randint(0, VOCAB, (2, 19))
    bounds = ((0, 7), (7, 8), (8, 19))

    def chunked():
        cache = DynamicCache(config=model.config) if with_config else DynamicCache()
        with torch.no_grad():
            logits = [model(ids[:, a:b], past_key_values=cache, use_cache=True).logits for a, b in bounds]
        return torch.cat(logits, dim=1), cache

    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    logits, cache = chunked()
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    assert len(cache.layers) == model.config.num_hidden_layers + 1  # the smear's layer
    # the guard: forgetting the previous token at the chunk boundaries changes exactly those positions
    monkeypatch.setattr(L3GPTSmear, "previous_embedding", lambda self, embeds, cache: None)
    forgetful, _ = chunked()
    assert not torch.allclose(forgetful[:, [7, 8]], full[:, [7, 8]], atol=1e-3)
    torch.testing.assert_close(forgetful[:, :7], full[:, :7], rtol=1e-5, atol=1e-5)


def test_left_padded_batch_generates_like_each_prompt_alone():
    model = skewed_model(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)
    long, short = torch.randint(1, VOCAB, (1, 6)), torch.randint(1, VOCAB, (1, 3))
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(together[0], model.generate(long, **kwargs)[0])
    assert torch.equal(together[1, 3:], model.generate(short, **kwargs)[0])


def test_smear_mixes_in_the_previous_token_except_at_document_starts():
    torch.manual_seed(3)
    smear = L3GPTSmear(tiny_config()).double()
    with torch.no_grad():
        smear.smear_lambda.fill_(0.7)
        smear.gate.weight.normal_()
    embeds = torch.randn(2, 6, 64, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed documents
    gate = 0.7 * torch.sigmoid(embeds[..., :24] @ smear.gate.weight.T)  # (B, T, 1)
    expected = embeds.clone()
    for t in (1, 2, 4, 5):
        expected[:, t] += gate[:, t] * embeds[:, t - 1]
    torch.testing.assert_close(smear(embeds, positions), expected, rtol=1e-12, atol=1e-12)
    previous = torch.randn(2, 1, 64, dtype=torch.float64)  # a cached token before a document start is not mixed in
    torch.testing.assert_close(smear(embeds, positions, previous), expected, rtol=1e-12, atol=1e-12)
    continued = smear(embeds, positions + 5, previous)  # positions > 0: the cached token mixes into position 0
    torch.testing.assert_close(continued[:, 0], embeds[:, 0] + gate[:, 0] * previous[:, 0], rtol=1e-12, atol=1e-12)


def test_gradient_checkpointing_gives_equal_grads():
    model = skewed_model(tiny_config()).train()
    ids = torch.randint(0, VOCAB, (2, 16))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = grads()
    model.activation_checkpointing_enable()
    checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_parameter_gets_a_gradient_after_one_step():
    model = skewed_model(tiny_config(l3_tie_kv=False), randomize_zero_inits=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 16))
    for _ in range(2):  # zero-init projections block some gradients until the first step moves them
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
    without_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not without_grad


def test_save_pretrained_round_trip(tmp_path):
    model = skewed_model(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.model.l3_bounds, model.model.l3_bounds)
    ids = torch.randint(0, VOCAB, (2, 10))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_l3gpt.L3GPTForCausalLM"
    assert config["auto_map"]["AutoModel"] == "modeling_l3gpt.L3GPTModel"


NANOCHAT_MASTER_FIELDS = (
    "value_embedding_layers", "value_embedding_gate_channels", "use_smear_gate", "smear_gate_channels", "use_backout",
)


def test_config_json_from_before_nanochat_master_features_loads_them_off(tmp_path):
    """A checkpoint saved before value embeddings, smear and backout existed has no key for their fields: it loads with its own architecture (no
    missing or unexpected weights) and gives its own logits; a new config of the same fields gets them on."""
    model = skewed_model(tiny_config(**copy.deepcopy(LEGACY_FIELD_VALUES))).eval()
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert set(NANOCHAT_MASTER_FIELDS) <= set(written)  # files written now carry them
    old_format = {key: value for key, value in written.items() if key not in NANOCHAT_MASTER_FIELDS}
    (tmp_path / "config.json").write_text(json.dumps(old_format))
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = loaded.config
    assert (config.value_embedding_layers, config.use_smear_gate, config.use_backout) == ([], False, False)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
    # the guard: the same dict as a new config has the features on, so the test could tell
    new = L3GPTConfig(**old_format)
    assert new.use_smear_gate and new.use_backout and new.value_embedding_layers == [1]
    # a field passed to from_pretrained still wins, resolved as for a new config
    assert L3GPTConfig.from_pretrained(tmp_path, use_smear_gate=True).use_smear_gate
    assert L3GPTConfig.from_pretrained(tmp_path, value_embedding_layers=None).value_embedding_layers == [1]


REMOTE_SCRIPT = """
import torch
from transformers import AutoModel, AutoModelForCausalLM

try:
    import hfl3  # noqa: F401
    raise SystemExit("hfl3 should not be importable here")
except ImportError:
    pass
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
assert "hfl3" not in type(model).__module__, type(model).__module__
ids = torch.load(folder + "/ids.pt")
with torch.no_grad():
    torch.save(model(ids).logits, folder + "/remote_logits.pt")
base = AutoModel.from_pretrained(folder, trust_remote_code=True)  # auto_map.AutoModel, as vLLM's Transformers backend
assert type(base).__name__ == "L3GPTModel" and "hfl3" not in type(base).__module__, type(base)
"""


def test_remote_code_loads_without_hfl3(tmp_path, run_without_hfl3):
    model = skewed_model(tiny_config()).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 10))
    torch.save(ids, tmp_path / "ids.pt")
    result = run_without_hfl3(REMOTE_SCRIPT, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "remote_logits.pt"), expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.extended)])
def test_torch_compile_compiles_the_training_forward_once_as_one_graph(backend):
    """The pair count P = sum of the routed tokens' table sizes changes with every batch; no tensor of size P
    crosses the graph (the lookup and its backward are custom ops that expand the pairs inside), so the training
    forward compiles once, whole, and new batches reuse it. Before the routing ran outside the graphs, and before that
    every new P compiled a new graph (~9 s each on this CPU). The graph, its guards and the custom ops' autograd are
    the same for every backend: `aot_eager` in make test; `inductor`, which also generates and builds C++ kernels
    (~1 min of CPU here), in make test-extended (and on the GPU, `make bench-gpu`'s compiled sections)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = skewed_model(tiny_config())
    compiled, graphs = torch.compile(model, fullgraph=True, backend=backend), counters["stats"]["unique_graphs"]
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 16)) for _ in range(5)]
    assert len({int(model.model.l3_counts()[ids].sum()) for ids in batches}) == 5
    for ids in batches[:2]:
        compiled(input_ids=ids, labels=ids).loss.backward()
    for ids in batches[2:]:
        model.zero_grad()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        compiled_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        eager = model(input_ids=ids, labels=ids).loss
        eager.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(compiled_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one whole graph, compiled once for all pair counts


def test_output_hidden_states_and_attentions_come_back():
    """`_can_record_outputs`: hidden states per decoder layer (num_hidden_layers + 1, the last the final-normed
    `last_hidden_state`, the first the first layer's input), eager attention weights per layer; nothing by default."""
    config = tiny_config(attn_implementation="eager")
    model = skewed_model(config).eval()
    input_ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids)
        out = model(input_ids, output_hidden_states=True, output_attentions=True)
        base = model.model(input_ids)
        inputs = {}
        hook = model.model.layers[0].register_forward_hook(lambda m, args, o: inputs.setdefault("first", args[0]))
        model(input_ids)
        hook.remove()
    assert plain.hidden_states is None and plain.attentions is None
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert all(h.shape == (2, 10, config.hidden_size) for h in out.hidden_states)
    torch.testing.assert_close(out.hidden_states[-1], base.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(out.hidden_states[0], inputs["first"], rtol=0, atol=0)
    assert not torch.equal(out.hidden_states[0], out.hidden_states[1])
    assert len(out.attentions) == config.num_hidden_layers
    assert out.attentions[0].shape == (2, config.num_attention_heads, 10, 10)
    torch.testing.assert_close(out.logits, plain.logits, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_come_back_in_the_model_dtype_and_the_loss_from_float32(dtype):
    model = skewed_model(tiny_config()).to(dtype).eval()
    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids, labels=input_ids)
        hidden = model.model(input_ids).last_hidden_state
    cap = model.config.final_logit_softcapping
    reference = cap * torch.tanh(model.lm_head(hidden).float() / cap)  # the float32 softcap of nanochat
    vocab = reference.shape[-1]  # padded to a multiple of 64
    expected_loss = torch.nn.functional.cross_entropy(reference[:, :-1].reshape(-1, vocab), input_ids[:, 1:].flatten())
    assert out.logits.dtype == dtype
    torch.testing.assert_close(out.logits, reference.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(out.loss, expected_loss, rtol=1e-6, atol=1e-6)
