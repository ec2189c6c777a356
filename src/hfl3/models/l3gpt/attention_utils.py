"""L3GPT's attention helpers in transformers' form: rotary position embeddings (RoFormer, arXiv 2104.09864) with
`rope_parameters`, and the eager (reference) attention behind `config._attn_implementation == "eager"`.

nanochat rotates by -θ (its apply_rotary_emb, the transpose of this textbook convention): the same model up to
negating the second half of every query and key head's projection rows.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .configuration_l3gpt import L3GPTConfig


class L3GPTRotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer, arXiv 2104.09864) with transformers' `rope_parameters`: every
    `rope_type` of `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` (linear, dynamic NTK, YaRN, LongRoPE, Llama
    3, proportional) besides the default, with `dynamic_rope_update` recomputing the frequencies of the dynamic types
    (dynamic NTK beyond the cached length, LongRoPE's long factors beyond `original_max_position_embeddings`), as
    transformers' Llama and Qwen3 do."""

    def __init__(self, config: L3GPTConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @property
    def rope_init_fn(self) -> Callable:
        if self.rope_type == "default":
            return self.compute_default_rope_parameters
        return ROPE_INIT_FUNCTIONS[self.rope_type]

    @staticmethod
    def compute_default_rope_parameters(config: L3GPTConfig, **kwargs) -> tuple[torch.Tensor, float]:
        """Inverse frequencies `base^(-2i/head_dim)`, shape `(head_dim // 2,)`, and the scaling 1.0."""
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape `(batch_size, seq_len, head_dim)` for `position_ids` of shape `(batch_size, seq_len)`,
        scaled by the RoPE type's attention factor (1 except YaRN and LongRoPE)."""
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)  # (B, T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Apply rotary embeddings to q and k of shape `(batch_size, heads, seq_len, head_dim)`."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`(batch, kv_heads, seq_len, head_dim)` → `(batch, kv_heads * n_rep, seq_len, head_dim)`."""
    batch, kv_heads, seq_len, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, seq_len, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, seq_len, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Reference attention (softmax in float32); `attention_mask` is an additive float mask or None."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights
