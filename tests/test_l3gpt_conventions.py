"""L3GPT keeps transformers' conventions: `return_dict=False`, `resize_token_embeddings` (value embeddings and L3
tables grow with the vocabulary), RoPE scaling types, attention implementation switching, static cache and compiled
decoding, whole-graph compilation of the training forward."""

import pytest
import torch

from hfl3 import L3GPTConfig
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


def test_resize_token_embeddings_grows_every_token_table_then_saves_reloads_and_trains(tmp_path):
    """New tokens (a special token added for SFT) get value-embedding rows and one L3 row each; old tokens keep
    theirs, so their logits are unchanged; the resized model saves, reloads to the same logits and trains."""
    model = skewed_model(tiny_config(l3_tie_kv=False)).eval()
    config, base = model.config, model.model
    old_vocab, old_rows, old_counts = config.vocab_size, config.l3_n_emb, base.l3_counts().clone()
    ids = torch.randint(0, old_vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(old_vocab + 3)
    assert config.vocab_size == old_vocab + 3 and config.l3_n_emb == old_rows + 3
    assert torch.equal(base.l3_counts(), torch.cat([old_counts, torch.ones(3, dtype=torch.long)]))
    layer = base.l3_layers["0"]
    assert layer.key_table.weight.shape[0] == layer.value_table.weight.shape[0] == old_rows + 3
    assert all(table.weight.shape[0] == old_vocab + 3 for table in base.value_embeddings.values())
    assert model.lm_head.hfl3_init == ("normal", config.initializer_range)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after[..., :old_vocab], before, rtol=0, atol=0)
    new_ids = ids.clone()
    new_ids[:, 3::4] = old_vocab + 1  # the new token, inside the sequences
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert loaded.config.l3_n_emb == old_rows + 3 and torch.equal(loaded.model.l3_bounds, base.l3_bounds)
    with torch.no_grad():
        torch.testing.assert_close(loaded(new_ids).logits, model(new_ids).logits, rtol=0, atol=0)
    loaded.train()
    new_row = int(loaded.model.l3_bounds[old_vocab + 1])
    rows_of_new_token = {
        "embedding": lambda m: m.model.embed_tokens.weight[old_vocab + 1],
        "value embedding": lambda m: m.model.value_embeddings["1"].weight[old_vocab + 1],
        "L3 key": lambda m: m.model.l3_layers["0"].key_table.weight[new_row],
        "L3 value": lambda m: m.model.l3_layers["0"].value_table.weight[new_row],
    }
    start = {name: row(loaded).detach().clone() for name, row in rows_of_new_token.items()}
    optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = loaded(new_ids, labels=new_ids).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    unchanged = [name for name, row in rows_of_new_token.items() if torch.equal(row(loaded), start[name])]
    assert not unchanged


@pytest.mark.parametrize("mean_resizing", [True, False])
def test_resize_token_embeddings_shrinks_and_pads_like_transformers(mean_resizing):
    model = skewed_model(tiny_config())
    config, base = model.config, model.model
    counts, vocab = base.l3_counts().clone(), config.vocab_size
    model.resize_token_embeddings(vocab - 10, mean_resizing=mean_resizing)
    assert torch.equal(base.l3_counts(), counts[: vocab - 10]) and config.l3_n_emb == int(counts[: vocab - 10].sum())
    model.resize_token_embeddings(vocab + 1, pad_to_multiple_of=64, mean_resizing=mean_resizing)
    assert config.vocab_size == vocab + 64 and base.l3_bounds.shape == (vocab + 65,)
    assert torch.equal(base.l3_counts()[vocab - 10 :], torch.ones(74, dtype=torch.long))
    # added rows follow the tables' init scale: lm_head N(0, 0.001) (nanochat), not torch's default Linear init
    assert model.lm_head.weight[vocab - 10 :].abs().max() < 0.01
    dense = skewed_model(tiny_config(l3_after_layers=[]))
    dense.resize_token_embeddings(vocab + 5)
    assert dense.model.l3_bounds.shape == (vocab + 6,) and not dense.model.l3_bounds.any()


def test_resize_token_embeddings_refuses_offloaded_tables():
    model = skewed_model(tiny_config()).offload_l3_tables()
    with pytest.raises(RuntimeError, match="resize the model before offloading"):
        model.resize_token_embeddings(VOCAB + 64)


def test_set_attn_implementation_switches_the_attention_that_runs():
    """`set_attn_implementation` switches between transformers' attention functions (SDPA ↔ eager): eager returns
    its attention weights and gives SDPA's logits, through sliding-window and full layers, with padding."""
    model = skewed_model(tiny_config()).eval()
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(0))  # longer than the window (8)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        sdpa = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation("eager")
        eager = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation("sdpa")
        back = model(ids, attention_mask=mask, output_attentions=True)
    assert model.config._attn_implementation == "sdpa"
    assert not [weights for weights in sdpa.attentions + back.attentions if weights is not None]  # SDPA has none
    positions = torch.arange(30)
    in_window = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - 8)
    sliding, full = eager.attentions  # (batch, heads, query, key); padded queries (row 1, first 4) are not read
    assert sliding.shape == (2, 4, 30, 30) and not sliding[0][:, ~in_window].any()
    assert not sliding[1, :, 4:][:, ~in_window[4:]].any() and not full[1, :, 4:, :4].any()
    # float32 logits of attention computed in two orders (softmax(QKᵀ)V vs SDPA's kernel): a few ulp of the
    # O(1)-sized activations, amplified by two layers; 1e-5 is ~100 float32 ulp at magnitude 1
    torch.testing.assert_close(eager.logits[mask.bool()], sdpa.logits[mask.bool()], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(back.logits, sdpa.logits, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2"])
def test_eager_sdpa_and_flash_attention_agree_on_cuda(implementation):
    pytest.importorskip("flash_attn") if implementation == "flash_attention_2" else None
    model = skewed_model(tiny_config()).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB, (2, 30), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(ids).logits.float()
        model.set_attn_implementation(implementation)
        other = model(ids).logits.float()
    # bfloat16 keeps 8 mantissa bits: one rounding of an O(1) activation is 2^-8 ≈ 4e-3 relative; two layers of
    # attention and MLP compound a few of them, so 3e-2 absolute on logits of magnitude ≲ 15 (the softcap)
    torch.testing.assert_close(other, eager, rtol=3e-2, atol=3e-2)


def decoding_model(l3: bool) -> torch.nn.Module:
    model = skewed_model(tiny_config(l3_after_layers=[0] if l3 else [])).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # sharpen the logits so that no greedy choice is a near-tie
    return model


@pytest.mark.parametrize("l3", [False, True], ids=["dense", "l3"])
def test_static_cache_gives_the_dynamic_caches_logits_with_sdpa(l3):
    """A `StaticCache` holds the smear's state as a convolution state, so it stays compileable and transformers
    builds the decoding masks: attention never reads the cache's empty slots (which shifted the logits by 1e-2 to
    8e-2 from the first decoded token when the smear's extra layer made the cache non-compileable)."""
    model = decoding_model(l3)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    dynamic = model.generate(prompt, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert type(static.past_key_values).__name__ == "StaticCache" and static.past_key_values.is_compileable
    assert torch.equal(static.sequences, dynamic.sequences)
    # float32 logits (|logit| ≤ 15, the softcap) of the same tokens through two cache layouts: SDPA over the
    # static cache's masked full length vs the dynamic cache's exact length sums in another order, a few float32
    # ulp (1e-7 relative) of each activation; 1e-4 is far below the 1e-2 error of a mask that was dropped
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-4, atol=1e-4)


def test_compiled_static_cache_decoding_gives_the_dynamic_caches_tokens():
    """`generate` with a static cache compiles the decoding step (`torch.compile(fullgraph=True)`, as it does on
    CUDA; `_compile_all_devices` asks for it on the CPU) and gives the dynamic cache's tokens and logits. With an L3
    layer, whose model holds every part of the dense one (smear, value embeddings, sliding and full attention)."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = decoding_model(l3=True)
    prompt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    dynamic = model.generate(prompt, **kwargs)
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True
    compiled = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **kwargs)
    assert hasattr(model, "_compiled_call")  # the guard: decoding did go through torch.compile
    assert torch.equal(compiled.sequences, dynamic.sequences)
    # see test_static_cache_gives_the_dynamic_caches_logits_with_sdpa for the tolerance
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(dynamic.logits), rtol=1e-4, atol=1e-4)


HEAD_DIM = 16
ROPE_CASES = [  # (rope_type, its parameters beyond rope_type and rope_theta)
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("dynamic", {"factor": 4.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 32}),
    ("longrope", {"factor": 2.0, "original_max_position_embeddings": 32, "short_factor": [1.0] * (HEAD_DIM // 2),
                  "long_factor": torch.linspace(1.0, 6.0, HEAD_DIM // 2).tolist()}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    ("proportional", {"partial_rotary_factor": 0.5}),
]


def test_rope_cases_cover_every_type_transformers_offers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert {name for name, _ in ROPE_CASES} == {"default", *ROPE_INIT_FUNCTIONS}


@pytest.mark.parametrize("rope_type,parameters", ROPE_CASES, ids=[name for name, _ in ROPE_CASES])
def test_rotary_embedding_equals_transformers_qwen3_for_every_rope_type(rope_type, parameters):
    """cos and sin equal transformers' own rotary embedding (Qwen3's) for the same `rope_parameters`, over a short
    input, one beyond `max_position_embeddings` (where the dynamic types rescale) and a short one again."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from hfl3.models.l3gpt.attention_utils import L3GPTRotaryEmbedding

    rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, **parameters}
    config = tiny_config(max_position_embeddings=64, rope_parameters=dict(rope_parameters))
    reference_config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=64,
                                   rope_parameters=dict(rope_parameters))
    assert config.head_dim == HEAD_DIM
    ours, reference = L3GPTRotaryEmbedding(config), Qwen3RotaryEmbedding(reference_config)
    x = torch.ones(1, dtype=torch.float32)
    for length in (10, 150, 10):
        positions = torch.arange(length)[None]
        for got, expected in zip(ours(x, positions), reference(x, positions)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    default = L3GPTRotaryEmbedding(tiny_config(max_position_embeddings=64))
    scaled = not torch.equal(ours(x, torch.arange(150)[None])[0], default(x, torch.arange(150)[None])[0])
    assert scaled == (rope_type != "default")  # the guard: each type does change the embedding somewhere


def test_dynamic_rope_changes_the_model_only_beyond_its_context():
    torch.manual_seed(0)
    default = skewed_model(tiny_config(max_position_embeddings=64)).eval()
    dynamic = skewed_model(tiny_config(max_position_embeddings=64,
                                       rope_parameters={"rope_type": "dynamic", "factor": 4.0})).eval()
    dynamic.load_state_dict(default.state_dict())
    short, long = torch.randint(0, VOCAB, (1, 20)), torch.randint(0, VOCAB, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(dynamic(short).logits, default(short).logits, rtol=0, atol=0)
        assert not torch.allclose(dynamic(long).logits, default(long).logits, atol=1e-3)


@pytest.mark.parametrize(
    "rope_parameters,match",
    [
        ({"rope_type": "ntk-by-parts", "factor": 2.0}, "not a RoPE type of transformers"),
        ({"rope_type": "dynamic"}, "Missing required keys.*factor"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "rotates whole heads"),
        ({"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}, "per layer type"),
    ],
)
def test_unsupported_rope_parameters_are_refused_naming_the_field(rope_parameters, match):
    with pytest.raises(ValueError, match=f"rope_parameters.*{match}"):
        tiny_config(rope_parameters=rope_parameters)


@pytest.mark.parametrize("loss_implementation", ["auto", "chunked"])
def test_dense_training_forward_compiles_as_one_graph_with_the_eager_loss_and_gradients(loss_implementation):
    """The dense training forward (labels given) compiles with `fullgraph=True` and gives eager's loss and gradients,
    with the loss from the logits inside the graph ("auto" when compiling) or the chunked custom op; eager runs the
    chunked loss on the CPU. With an L3 layer: `test_l3gpt.py`'s
    `test_torch_compile_compiles_the_training_forward_once_as_one_graph` (inductor in make test-extended)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = skewed_model(tiny_config(l3_after_layers=[])).train()
    model.set_loss_implementation(loss_implementation)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    compiled, graphs_before = torch.compile(model, fullgraph=True, backend="aot_eager"), counters["stats"]["unique_graphs"]
    for ids in batches:
        results = []
        for forward in (compiled, model):
            model.zero_grad()
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}))
        (compiled_loss, compiled_grads), (eager_loss, eager_grads) = results
        # the same float32 kernels, traced: equal up to a few ulp where the traced graph reorders an addition
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


@pytest.mark.parametrize("loss_implementation, chunked_op_in_graph", [("auto", False), ("logits", False),
                                                                      ("chunked", True)])
def test_the_compiled_training_loss_takes_the_path_asked_for(loss_implementation, chunked_op_in_graph):
    """Under `torch.compile`, "auto" computes the loss from the logits inside the graph (nanochat's: no custom op for
    Inductor to work around), "chunked" calls the chunked custom op; eagerly on the CPU "auto" is chunked."""
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    model = skewed_model(tiny_config(l3_after_layers=[])).train()
    model.set_loss_implementation(loss_implementation)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    out = torch.compile(model, fullgraph=True, backend=recording_backend)(input_ids=ids, labels=ids)
    assert out.logits is None  # training mode with labels: the graph writes no logits out
    targets = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert any("chunked_linear_cross_entropy" in target for target in targets) == chunked_op_in_graph, targets
    assert model.training_loss_path(out.loss) == ("chunked" if loss_implementation == "auto" else loss_implementation)
    with pytest.raises(ValueError, match="loss_implementation='fused'"):
        model.set_loss_implementation("fused")


def test_assisted_decoding_with_an_l3gpt_draft_gives_the_greedy_tokens():
    """Assisted decoding rolls back (crops) the draft's and the target's caches, smear state included: with another
    L3GPT as the draft model, the tokens are the target's own greedy ones."""
    model, draft = decoding_model(l3=True).double(), skewed_model(tiny_config(), seed=7).double().eval()
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    greedy = model.generate(prompt, **kwargs)
    assisted = model.generate(prompt, assistant_model=draft, **kwargs)
    assert torch.equal(assisted, greedy)
    assert not torch.equal(draft.generate(prompt, **kwargs), greedy)  # the guard: the draft proposes other tokens


def test_bf16_embedding_tables_keep_the_models_dtype_and_a_bf16_residual_stream_under_autocast(tmp_path):
    """Token and value-embedding tables stored in bf16 beside float32 matrices (`--embedding_dtype`, nanochat's): the
    model's `dtype` is the matrices' (so `save_pretrained` writes float32 and a reload is float32 throughout); without
    autocast the stream is upcast to the matrices' dtype (the forward runs, the logits are the fp32 model's on the
    bf16-rounded tables); under bf16 autocast the residual stream is bf16, as nanochat's is."""
    from transformers import AutoModelForCausalLM

    model = skewed_model(tiny_config(l3_after_layers=[])).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    model.model.embed_tokens.to(torch.bfloat16)
    model.model.value_embeddings.to(torch.bfloat16)
    assert model.dtype == model.model.dtype == torch.float32
    streams = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: streams.append(args[0].dtype))
    with torch.no_grad():
        logits = model(ids).logits
        reference = skewed_model(tiny_config(l3_after_layers=[])).eval()
        reference.load_state_dict({name: value.float() for name, value in model.state_dict().items()})
        torch.testing.assert_close(logits, reference(ids).logits, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(ids)
    hook.remove()
    assert streams == [torch.float32, torch.bfloat16]
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.dtype == torch.float32
    assert {param.dtype for param in reloaded.parameters()} == {torch.float32}


def test_the_compiled_training_forward_saves_two_residual_tensors_per_layer_as_nanochat():
    """What Inductor keeps from the compiled training forward for the backward, counted in the forward graphs its
    partitioner cuts (captured before code generation, never run): each layer adds two `(batch, seq, hidden)` tensors
    of the residual stream (the block's mid-point and its output; nanochat's count), and recomputes its input
    `resid_lambdas[i]·h + x0_lambdas[i]·x0` from them and `x0`. When `x0` (the smear's output) was a fusible add,
    the partitioner's `ban_if_used_far_apart` kept every layer's input as well: 0.55 GB at d12, 16 × 2048."""
    from torch._inductor.compile_fx import compile_fx

    def residual_tensors_saved(depth: int) -> int:
        model = skewed_model(L3GPTConfig.from_depth(depth, vocab_size=VOCAB, aspect_ratio=32, head_dim=16,
                                                    num_key_value_heads=2, l3_after_layers=[]))
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        width = model.config.hidden_size
        forward_outputs = []

        def inner_compile(graph_module, example_inputs, **kwargs):
            outputs = next(node for node in graph_module.graph.nodes if node.op == "output").args[0]
            if not kwargs.get("is_backward", False):
                forward_outputs.extend(outputs)
            metas = [node.meta.get("val") if isinstance(node, torch.fx.Node) else node for node in outputs]
            return lambda *args: [torch.zeros(meta.shape, dtype=meta.dtype) if isinstance(meta, torch.Tensor) else meta
                                  for meta in metas]

        torch._dynamo.reset()
        compiled = torch.compile(model.train(), backend=lambda gm, inputs: compile_fx(gm, inputs,
                                                                                     inner_compile=inner_compile))
        compiled(input_ids=ids, labels=ids)
        torch._dynamo.reset()
        return sum(1 for node in forward_outputs if isinstance(node, torch.fx.Node) and node.op == "call_function"
                   and tuple(node.meta["val"].shape) == (2, 16, width))

    assert residual_tensors_saved(6) - residual_tensors_saved(4) == 2 * 2  # (depth 2 has its backout at its last layer)


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flex_attention"])
def test_plain_rows_get_one_rows_masks_and_the_batch_gives_each_rows_logits(implementation):
    """Without padding, positions or a cache every row's mask is the same: the masks still needed (sliding windows;
    every mask in eager and flex attention) are built for one row and broadcast over the batch, not written and kept
    for the backward at `(batch, 1, T, T)`; the batch's logits are each row's alone."""
    model = skewed_model(tiny_config(l3_after_layers=[])).eval()
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    embeds = model.model.embed_tokens(ids)
    masks = model.model.attention_masks(None, embeds, None, torch.arange(20)[None], plain_causal_rows=True)
    assert masks["sliding_attention"] is not None and (implementation == "sdpa") == (masks["full_attention"] is None)
    for mask in (mask for mask in masks.values() if mask is not None):
        assert mask.shape[0] == 1, mask.shape
    with torch.no_grad():
        batch, rows = model(ids).logits, torch.cat([model(ids[i : i + 1]).logits for i in range(3)])
    torch.testing.assert_close(batch, rows, rtol=1e-5, atol=1e-6)  # float32; rows summed in another order
