"""L3GPT's dense core against nanochat master's forward (karpathy/nanochat 92d63d4, nanochat/gpt.py), re-written here
in float64 from its formulas: same weights in, same logits out; and its FLOPs count (nanochat's `estimate_flops`).

Conventions of nanochat that differ from hfl3's defaults, matched here through the config or the weight copy:
- rotary: nanochat rotates by -θ (`y1 = x1·cos + x2·sin`); the same model in hfl3's textbook convention has the
  second half of every query and key head's projection rows negated (`copy_into_l3gpt`);
- sliding window: nanochat's window W (FA3 `window_size=(W, 0)`) attends to W + 1 keys, transformers' to W: hfl3's
  `sliding_window` is W + 1;
- RoPE base 100000 (nanochat since 6ed7d1d; hfl3's default stays 10000);
- RMSNorm epsilon: nanochat's `F.rms_norm` without eps uses float32's eps (2^-23, also in bf16 compute, whose norm
  runs in float32; the converters set `rms_norm_eps` to it); the reference uses hfl3's `rms_norm_eps` so that float64
  can compare to 1e-10.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.models.l3gpt.configuration_l3gpt import flops_per_token

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 64, 4, 2, 16, 3
SHORT_WINDOW = 5  # nanochat's W of the S layers (its formula gives 128 at this context: no window at all)
SOFTCAP = 15.0


def has_value_embedding(layer: int) -> bool:
    return layer % 2 == (LAYERS - 1) % 2  # nanochat has_ve


def nanochat_weights(seed: int = 0) -> dict:
    """nanochat's parameters (its names and shapes), random and non-zero so that every path matters."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=0.3):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * std

    weights = {
        "wte": randn(VOCAB, WIDTH, std=0.8), "lm_head": randn(VOCAB, WIDTH),
        "resid_lambdas": 1.1 + randn(LAYERS, std=0.05), "x0_lambdas": 0.1 + randn(LAYERS, std=0.05),
        "smear_gate": randn(1, 24), "smear_lambda": torch.tensor([0.6], dtype=torch.float64),
        "backout_lambda": torch.tensor([0.25], dtype=torch.float64),
    }  # fmt: skip
    for i in range(LAYERS):
        weights[f"h.{i}.c_q"] = randn(HEADS * HEAD_DIM, WIDTH)
        weights[f"h.{i}.c_k"] = randn(KV_HEADS * HEAD_DIM, WIDTH)
        weights[f"h.{i}.c_v"] = randn(KV_HEADS * HEAD_DIM, WIDTH)
        weights[f"h.{i}.c_proj"] = randn(WIDTH, WIDTH, std=0.1)
        weights[f"h.{i}.c_fc"] = randn(4 * WIDTH, WIDTH, std=0.2)
        weights[f"h.{i}.mlp_proj"] = randn(WIDTH, 4 * WIDTH, std=0.05)
        if has_value_embedding(i):
            weights[f"h.{i}.ve_gate"] = randn(KV_HEADS, 12)
            weights[f"value_embeds.{i}"] = randn(VOCAB, KV_HEADS * HEAD_DIM)
    return weights


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def nanochat_forward(w: dict, ids: torch.LongTensor, eps: float, drop: str | None = None):
    """nanochat master's GPT.forward from its formulas, float64: the final-normed hidden states `(B, T, C)` and the
    softcapped logits `(B, T, V)`; `drop` removes one feature."""
    batch, seq = ids.shape
    x = rms_norm(w["wte"][ids], eps)
    if drop != "smear":  # x_t += λ·σ(w·x_t[:24])·x_{t-1} for t ≥ 1
        gate = w["smear_lambda"] * torch.sigmoid(x[:, 1:, :24] @ w["smear_gate"].T)
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
    x0 = x
    half = HEAD_DIM // 2
    # inverse frequencies computed in float32, as both nanochat and transformers' rotary layers do
    inv_freq = (1.0 / (100000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))).double()
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq  # (T, D/2)
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]

    def rotate(v):  # nanochat's apply_rotary_emb: by -θ
        v1, v2 = v[..., :half], v[..., half:]
        return torch.cat([v1 * cos + v2 * sin, -v1 * sin + v2 * cos], dim=-1)

    windows = [SHORT_WINDOW if i % 2 == 0 else seq for i in range(LAYERS)]  # pattern "SL", last layer L
    windows[-1] = seq
    positions = torch.arange(seq)
    backout = None
    for i in range(LAYERS):
        x = w["resid_lambdas"][i] * x + w["x0_lambdas"][i] * x0
        h = rms_norm(x, eps)
        q = (h @ w[f"h.{i}.c_q"].T).view(batch, seq, HEADS, HEAD_DIM)
        k = (h @ w[f"h.{i}.c_k"].T).view(batch, seq, KV_HEADS, HEAD_DIM)
        v = (h @ w[f"h.{i}.c_v"].T).view(batch, seq, KV_HEADS, HEAD_DIM)
        if has_value_embedding(i) and drop != "value_embeddings":
            gate = 3 * torch.sigmoid(h[..., :12] @ w[f"h.{i}.ve_gate"].T)  # (B, T, KV_HEADS)
            v = v + gate[..., None] * w[f"value_embeds.{i}"][ids].view(batch, seq, KV_HEADS, HEAD_DIM)
        q, k = rms_norm(rotate(q), eps) * 1.2, rms_norm(rotate(k), eps) * 1.2
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=2) for t in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(HEAD_DIM)
        offset = positions[:, None] - positions[None, :]  # query − key
        allowed = (offset >= 0) & (offset <= windows[i])  # FA3 window (W, 0): keys t−W .. t
        y = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~allowed, -math.inf).softmax(-1), v)
        x = x + y.reshape(batch, seq, WIDTH) @ w[f"h.{i}.c_proj"].T
        x = x + F.relu(rms_norm(x, eps) @ w[f"h.{i}.c_fc"].T).square() @ w[f"h.{i}.mlp_proj"].T
        if i == LAYERS // 2:
            backout = x
    if drop != "backout":
        x = x - w["backout_lambda"] * backout
    hidden = rms_norm(x, eps)
    return hidden, SOFTCAP * torch.tanh(hidden @ w["lm_head"].T / SOFTCAP)


def l3gpt_config() -> L3GPTConfig:
    return L3GPTConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, num_hidden_layers=LAYERS, max_position_embeddings=64, window_pattern="SL",
        sliding_window=SHORT_WINDOW + 1, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        final_logit_softcapping=SOFTCAP,
    )  # fmt: skip


def copy_into_l3gpt(w: dict, model: L3GPTForCausalLM) -> None:
    """nanochat's weights into L3GPT's modules; q/k rows of each head's second half negated (rotary convention)."""
    flip = torch.ones(HEAD_DIM, 1, dtype=torch.float64)
    flip[HEAD_DIM // 2 :] = -1
    base = model.model
    with torch.no_grad():
        base.embed_tokens.weight.copy_(w["wte"])
        model.lm_head.weight.copy_(w["lm_head"])
        base.resid_lambdas.copy_(w["resid_lambdas"])
        base.x0_lambdas.copy_(w["x0_lambdas"])
        base.smear.gate.weight.copy_(w["smear_gate"])
        base.smear.smear_lambda.copy_(w["smear_lambda"])
        base.backout_lambda.copy_(w["backout_lambda"])
        for i, layer in enumerate(base.layers):
            attention = layer.self_attn
            for name, heads in (("q", HEADS), ("k", KV_HEADS)):
                rows = w[f"h.{i}.c_{name}"].view(heads, HEAD_DIM, WIDTH) * flip
                getattr(attention, f"{name}_proj").weight.copy_(rows.reshape(heads * HEAD_DIM, WIDTH))
            attention.v_proj.weight.copy_(w[f"h.{i}.c_v"])
            attention.o_proj.weight.copy_(w[f"h.{i}.c_proj"])
            layer.mlp.up_proj.weight.copy_(w[f"h.{i}.c_fc"])
            layer.mlp.down_proj.weight.copy_(w[f"h.{i}.mlp_proj"])
            if has_value_embedding(i):
                attention.value_embedding_gate.weight.copy_(w[f"h.{i}.ve_gate"])
                base.value_embeddings[str(i)].weight.copy_(w[f"value_embeds.{i}"])


# eager attention takes its softmax in float32 (transformers' eager_attention_forward), SDPA in the input's float64
@pytest.mark.parametrize("attention, tolerance", [("sdpa", 1e-10), ("eager", 1e-6)])
def test_logits_equal_nanochat_forward_in_float64(attention, tolerance):
    config = l3gpt_config()
    config._attn_implementation = attention
    model = L3GPTForCausalLM(config).double().eval()
    assert sorted(map(int, model.model.value_embeddings)) == [i for i in range(LAYERS) if has_value_embedding(i)]
    weights = nanochat_weights()
    copy_into_l3gpt(weights, model)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, logits = model.model(ids).last_hidden_state, model(ids).logits
    reference_hidden, reference_logits = nanochat_forward(weights, ids, config.rms_norm_eps)
    torch.testing.assert_close(hidden, reference_hidden, rtol=tolerance, atol=tolerance)  # the stack, in float64
    torch.testing.assert_close(logits, reference_logits, rtol=tolerance, atol=tolerance)  # in the model's float64
    # the guard: each feature moves the logits far beyond the tolerance, so the comparison could tell it missing
    for feature in ("smear", "value_embeddings", "backout"):
        _, without = nanochat_forward(weights, ids, config.rms_norm_eps, drop=feature)
        assert (without - reference_logits).abs().max() > 1e-2, feature


def test_flops_count_every_linear_weight_like_nanochat():
    """nanochat's `estimate_flops`: 6 × (weights of every Linear, gates included; embeddings and value embeddings
    are lookups) + 12·H·Q·min(window, T) per layer."""
    config = L3GPTConfig.from_depth(
        3, vocab_size=VOCAB, aspect_ratio=64, head_dim=64, max_position_embeddings=256, window_pattern="SL",
        l3_after_layers=[1], l3_n_emb=2 * VOCAB, l3_k_max=4,
    )  # fmt: skip
    model = L3GPTForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attended = sum(min(config.sliding_window, 256) if kind == "sliding_attention" else 256
                   for kind in config.layer_types)  # fmt: skip
    expected = 6 * linear + 12 * config.num_attention_heads * config.head_dim * attended
    assert flops_per_token(config, 256) == expected
    assert len(model.model.value_embeddings) == 2 and model.model.smear is not None  # the guard: the gates exist
