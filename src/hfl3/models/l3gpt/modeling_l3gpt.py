"""L3GPT: nanochat's GPT (karpathy/nanochat, nanochat/gpt.py) in transformers' shape, with Large Lookup Layers
("L³: Large Lookup Layers", Tseng & De Sa, arXiv 2601.21461).

Self-contained (relative imports only) so that the folder can be shipped as Hub remote code. File order follows
transformers' modeling files: constants → attention → MLP → value embeddings and smear → decoder layer →
PreTrainedModel → base model → causal LM. Beside it: the norm and nanochat's init tags in `layers.py`, the rotary
embeddings and the eager attention in `attention_utils.py`, the L3 layer, its lookup ops and the management of its
tables (allocation, routing, resizing: `L3TablesMixin`, `TokenTablesResizeMixin`) in `lookup.py`, the tables'
offloading (`L3OffloadMixin`: `offload_l3_tables`, `from_pretrained(l3_offload=...)`) in `offload.py`, the loss in
`linear_cross_entropy.py`.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, LinearAttentionLayer
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .attention_utils import L3GPTRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward
from .configuration_l3gpt import L3GPTConfig
from .layers import L3GPTRMSNorm, initialize, uniform_bound, with_init
from .linear_cross_entropy import causal_lm_loss, liger_applies, register_zero3_owner
from .lookup import L3TablesMixin, LargeLookupLayer, TokenTablesResizeMixin, l3_routing
from .offload import L3OffloadMixin


# nanochat 6ed7d1d: value-embedding gates are 3·sigmoid(·), in (0, 3), 1.5 at a zero gate input.
VALUE_EMBEDDING_GATE_RANGE = 3.0
# nanochat a825e63 (init fixed in 94b73ad): the backout scalar starts at 0.2.
BACKOUT_LAMBDA_INIT = 0.2
# Attention implementations that apply causality themselves when given no mask (`is_causal` / `causal=True`).
CAUSAL_FLAG_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
# How the training loss is computed (`L3GPTForCausalLM.loss_implementation`): "logits" builds the logits as eval mode
# does (nanochat's loss; Inductor fuses softcap and cross-entropy into the graph), "chunked" and "liger" are
# `linear_cross_entropy`'s memory-light backends, "auto" picks one (`L3GPTForCausalLM.training_loss_path`).
LOSS_IMPLEMENTATIONS = ("auto", "logits", "chunked", "liger")


class L3GPTAttention(nn.Module):
    """Causal self-attention: rotary embeddings, parameter-free QK-norm scaled by `qk_norm_scale`, GQA, optional
    sliding window; computed by transformers' attention interface (`config._attn_implementation`)."""

    def __init__(self, config: L3GPTConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        bound = uniform_bound(config)
        q_width, kv_width = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = with_init(nn.Linear(config.hidden_size, q_width, bias=False), "uniform", bound)
        self.k_proj = with_init(nn.Linear(config.hidden_size, kv_width, bias=False), "uniform", bound)
        self.v_proj = with_init(nn.Linear(config.hidden_size, kv_width, bias=False), "uniform", bound)
        self.o_proj = with_init(nn.Linear(q_width, config.hidden_size, bias=False), "zeros")
        self.qk_norm = L3GPTRMSNorm(config.rms_norm_eps)
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None
        self.value_embedding_gate = None
        if layer_idx in config.value_embedding_layers:
            gate = nn.Linear(config.value_embedding_gate_channels, config.num_key_value_heads, bias=False)
            self.value_embedding_gate = with_init(gate, "positive_uniform", 0.02)

    def forward(
        self, hidden_states, position_embeddings, attention_mask, past_key_values=None, value_embeds=None, **kwargs
    ):
        """`value_embeds` (`(batch_size, seq_len, kv_dim)`): this layer's value embeddings of the tokens, added to the
        values through the gate (see `L3GPTConfig.value_embedding_layers`); None when the layer has none."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        scale = self.config.qk_norm_scale
        query = (self.qk_norm(self.q_proj(hidden_states).view(hidden_shape)) * scale).transpose(1, 2)  # (B, H, T, D)
        key = (self.qk_norm(self.k_proj(hidden_states).view(hidden_shape)) * scale).transpose(1, 2)  # (B, Hkv, T, D)
        value = self.v_proj(hidden_states).view(hidden_shape)  # (B, T, Hkv, D)
        if value_embeds is not None:
            channels = self.value_embedding_gate.in_features
            gate = VALUE_EMBEDDING_GATE_RANGE * torch.sigmoid(self.value_embedding_gate(hidden_states[..., :channels]))
            value = value + gate[..., None] * value_embeds.view(hidden_shape).to(value.dtype)  # gate: (B, T, Hkv)
        value = value.transpose(1, 2)  # (B, Hkv, T, D)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (B, T, H*D)
        return self.o_proj(attn_output), attn_weights


class L3GPTMLP(nn.Module):
    """ReLU² MLP (Primer, arXiv 2109.08668; nanochat): `down_proj(relu(up_proj(x))²)`."""

    def __init__(self, config: L3GPTConfig):
        super().__init__()
        bound = 0.4 * uniform_bound(config)
        self.up_proj = with_init(nn.Linear(config.hidden_size, config.intermediate_size, bias=False), "uniform", bound)
        self.down_proj = with_init(nn.Linear(config.intermediate_size, config.hidden_size, bias=False), "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class L3GPTValueEmbeddings(nn.ModuleDict):
    """Per-layer value-embedding tables, `str(layer) → nn.Embedding(vocab_size, kv_dim)`, for the layers of
    `config.value_embedding_layers` (nanochat's `value_embeds`). Plain embeddings: a token reads one row per table,
    so memory is that of a token embedding (the L3 layers' pair-based rules concern tables with many rows per token).
    `hfl3.optim.param_groups_by_kind` recognises this class: the tables get their own AdamW group, as in nanochat."""

    def __init__(self, config: L3GPTConfig):
        kv_dim = config.num_key_value_heads * config.head_dim
        super().__init__({
            str(i): with_init(nn.Embedding(config.vocab_size, kv_dim), "uniform", uniform_bound(config))
            for i in config.value_embedding_layers
        })  # fmt: skip


class L3GPTSmear(nn.Module):
    """nanochat's smear (a825e63): `x_t ← x_t + λ·σ(gate(x_t[:s]))·x_{t-1}` on the normed embeddings, skipped where
    `position_ids` is 0 (see `L3GPTConfig.use_smear_gate`). `hfl3.optim.param_groups_by_kind` recognises this class
    (nanochat's smear group).

    Cached decoding reads the previous token's normed embedding from one more cache layer after the attention layers
    (index `num_hidden_layers`), which the cache moves with the keys and values (beam reordering, reset, cropping):
    - in a compileable cache (`StaticCache`), a `LinearAttentionLayer`: the smear is a causal convolution of width 2
      whose state `(batch_size, hidden_size, 1)` has a fixed shape, so the cache stays compileable (decoding masks
      are built, `torch.compile` of the decoding step works);
    - in a `DynamicCache`, a `DynamicLayer` with every token's embedding as keys `(batch_size, 1, seen, hidden_size)`
      (zero-width values): croppable at any time, as assisted decoding needs for a draft model's cache."""

    def __init__(self, config: L3GPTConfig):
        super().__init__()
        self.gate = with_init(nn.Linear(config.smear_gate_channels, 1, bias=False), "positive_uniform", 0.02)
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        self.cache_layer_idx = config.num_hidden_layers

    def previous_embedding(self, embeds: torch.Tensor, past_key_values: Cache | None) -> torch.Tensor | None:
        """Record `embeds` `(batch_size, seq_len, hidden_size)` in the cache's smear layer; return the embedding of the
        token before them `(batch_size, 1, hidden_size)`, or None when there is no cache or nothing before them.

        Raises:
            ValueError: if the cache's layer `num_hidden_layers` is another kind (a cache built for another model).
        """
        if past_key_values is None:
            return None
        layers, index = past_key_values.layers, self.cache_layer_idx
        if len(layers) < index and past_key_values.layer_class_to_replicate is not None:  # a lazily filled cache
            layers.extend(past_key_values.layer_class_to_replicate() for _ in range(index - len(layers)))
        if len(layers) == index:
            layers.append(LinearAttentionLayer() if past_key_values.is_compileable else DynamicLayer())
        layer = layers[index]
        if type(layer) is DynamicLayer:
            keys, _ = past_key_values.update(embeds[:, None], embeds[:, None, :, :0], index)  # (B, 1, seen, C)
            seen = keys.shape[2] - embeds.shape[1]
            return keys[:, 0, seen - 1 : seen] if seen > 0 else None
        if not isinstance(layer, LinearAttentionLayer):
            raise ValueError(
                f"past_key_values layer {index} is a {type(layer).__name__}; L3GPT keeps the smear's previous token in "
                f"the layer after its {index} attention layers: pass a cache built for this model "
                "(DynamicCache(config=model.config), StaticCache(config=model.config, ...)) or none"
            )
        has_previous = layer.has_previous_state[0]
        states = past_key_values.update_conv_state(embeds.transpose(1, 2), index, conv_kernel_size=1)  # (B, C, ·)
        return states[:, :, -embeds.shape[1] - 1, None].transpose(1, 2) if has_previous else None

    def forward(self, embeds, position_ids, previous=None):
        """`embeds` `(batch_size, seq_len, hidden_size)` → same shape; `position_ids` `(batch_size or 1, seq_len)`.

        The result is built by one `torch.cat` over time (the first position, which reads `previous`, and the rest),
        as nanochat's smear is: it becomes the stream's `x0`, which every layer reads (`x0_lambdas[i]·x0`), and
        Inductor's partitioner bans recomputing a fusible product of a tensor far from its first matmul
        (`ban_if_used_far_apart`), but a `cat` is never a fusion producer, so with it each layer's input is recomputed
        in the backward instead of saved (torch 2.13 `_functorch/partitioners.py`; d12 at 16 × 2048 saves 0.60 GB
        less; dev/LOG.md 2026-11-28, `tests/test_l3gpt_conventions.py`)."""
        if previous is None:
            previous = torch.zeros_like(embeds[:, :1])
        # the gate reads a copy of its channels: a view would keep the whole normed embedding alive for the backward
        channels = embeds[..., : self.gate.in_features].contiguous()
        gate = self.smear_lambda * torch.sigmoid(self.gate(channels))  # (B, T, 1)
        gate = (gate * (position_ids > 0)[..., None]).to(embeds.dtype)
        return torch.cat([embeds[:, :1] + gate[:, :1] * previous.to(embeds.dtype),  # (B, T, C): token t-1 added at t
                          embeds[:, 1:] + gate[:, 1:] * embeds[:, :-1]], dim=1)


class L3GPTDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: `h + attn(norm(h))`, then `h + mlp(norm(h))`."""

    def __init__(self, config: L3GPTConfig, layer_idx: int):
        super().__init__()
        self.self_attn = L3GPTAttention(config, layer_idx)
        self.mlp = L3GPTMLP(config)
        self.norm = L3GPTRMSNorm(config.rms_norm_eps)

    def forward(
        self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, value_embeds=None,
        **kwargs,
    ):
        attn_output, _ = self.self_attn(
            self.norm(hidden_states), position_embeddings, attention_mask, past_key_values=past_key_values,
            value_embeds=value_embeds, **kwargs,
        )
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.norm(hidden_states))


class L3GPTPreTrainedModel(TokenTablesResizeMixin, L3OffloadMixin, PreTrainedModel):
    """Capability flags, nanochat's init and the remote-code `auto_map`; `resize_token_embeddings` over every table
    indexed by token id comes from `lookup.TokenTablesResizeMixin`, `offload_l3_tables` and `from_pretrained(...,
    l3_offload=...)` from `offload.L3OffloadMixin`."""

    config_class = L3GPTConfig
    config: L3GPTConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["L3GPTDecoderLayer", "LargeLookupLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # the L3 lookup and the chunked loss are custom ops; the smear state is static
    # `output_hidden_states=True` / `output_attentions=True` (transformers' `capture_outputs` hooks): the input of the
    # first decoder layer and each decoder layer's output (before an L3 layer after it), the last replaced by the
    # final-normed `last_hidden_state`; the attention weights where the backend returns them (eager)
    _can_record_outputs = {"hidden_states": L3GPTDecoderLayer, "attentions": L3GPTAttention}

    @torch.no_grad()
    def _init_weights(self, module):
        """nanochat's init (gpt.py `init_weights`), kept by transformers v5 which applies this to every module:
        embeddings and L3 tables N(0, 1); q/k/v and L3 up-projection uniform with std 1/√C; MLP up-projection at
        0.4× that; output projections (o_proj, down_proj, L3 mix_proj) zero; lm_head N(0, initializer_range =
        0.001); resid_lambdas 1.15 → 1.05 and x0_lambdas 0.20 → 0.05 over depth; value-embedding tables as v_proj,
        their gates and the smear gate uniform in [0, 0.02], smear_lambda 0, backout_lambda 0.2; L3 bounds uniform
        until an allocation is set. Per-module schemes come from `with_init` tags."""
        scheme = getattr(module, "hfl3_init", None)
        if scheme is not None:
            initialize(module.weight, scheme)
        elif isinstance(module, L3GPTModel):
            depth = self.config.num_hidden_layers
            init.copy_(module.resid_lambdas, torch.linspace(1.15, 1.05, depth))
            init.copy_(module.x0_lambdas, torch.linspace(0.20, 0.05, depth))
            init.copy_(module.l3_bounds, module.uniform_bounds())
            if module.backout_lambda is not None:
                init.constant_(module.backout_lambda, BACKOUT_LAMBDA_INIT)
        elif isinstance(module, L3GPTSmear):
            init.zeros_(module.smear_lambda)
        elif isinstance(module, L3GPTRotaryEmbedding):
            inv_freq, _ = module.rope_init_fn(module.config)
            init.copy_(module.inv_freq, inv_freq)
            init.copy_(module.original_inv_freq, inv_freq)

    @property
    def dtype(self) -> torch.dtype:
        """The model's floating dtype, read from its per-layer scalars (`resid_lambdas`): transformers takes the first
        floating parameter's, the token embedding's here, which `--embedding_dtype` may store in bfloat16 beside
        float32 master weights (what `save_pretrained` writes as `config.dtype` and a reload then casts to); the
        matrices themselves may be 4- or 8-bit integers (QLoRA), the scalars are never quantized."""
        decoder = self.model if isinstance(self, L3GPTForCausalLM) else self
        return decoder.resid_lambdas.dtype

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """transformers' `save_pretrained`; a folder saved with remote code also names `L3GPTModel` under
        `auto_map.AutoModel` (transformers writes only the saved class's entry; `AutoModel` with
        `trust_remote_code=True`, and so vLLM's Transformers backend, look the base model up there)."""
        if self._auto_class is not None:
            auto_map = getattr(self.config, "auto_map", None) or {}
            self.config.auto_map = {**auto_map, "AutoModel": f"{L3GPTModel.__module__.rsplit('.', 1)[-1]}.L3GPTModel"}
        return super().save_pretrained(save_directory, *args, **kwargs)


class L3GPTModel(L3TablesMixin, L3GPTPreTrainedModel):
    """The decoder stack. `x0 = smear(norm(embedding))`; per layer i: `h = resid_lambdas[i]·h + x0_lambdas[i]·x0`, the
    decoder layer (with layer i's value embeddings, if any), then the L3 layer if `i in config.l3_after_layers`;
    finally `h − backout_lambda·h_mid` (h_mid: h after layer `num_hidden_layers // 2`) and the final norm. Smear,
    value embeddings and backout follow their config fields (see `L3GPTConfig`)."""

    def __init__(self, config: L3GPTConfig):
        super().__init__(config)
        self.embed_tokens = with_init(nn.Embedding(config.vocab_size, config.hidden_size), "normal", 1.0)
        self.value_embeddings = L3GPTValueEmbeddings(config)
        self.smear = L3GPTSmear(config) if config.use_smear_gate else None
        self.backout_lambda = nn.Parameter(torch.full((1,), BACKOUT_LAMBDA_INIT)) if config.use_backout else None
        self.layers = nn.ModuleList(L3GPTDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.l3_layers = nn.ModuleDict({str(i): LargeLookupLayer(config) for i in config.l3_after_layers})
        self.norm = L3GPTRMSNorm(config.rms_norm_eps)
        self.rotary_emb = L3GPTRotaryEmbedding(config)
        self.resid_lambdas = nn.Parameter(torch.ones(config.num_hidden_layers))
        self.x0_lambdas = nn.Parameter(torch.zeros(config.num_hidden_layers))
        self.l3_bounds = nn.Buffer(self.uniform_bounds(), persistent=True)
        self.gradient_checkpointing = False
        self.post_init()

    def residual_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the residual stream: bfloat16 under bf16 autocast (nanochat runs its whole stream in its
        compute dtype: half the bytes of every activation it saves and of every elementwise op over it), else the
        model's dtype (`dtype`: so embedding tables stored in bf16 beside float32 weights are upcast)."""
        if torch.is_autocast_enabled(device.type) and torch.get_autocast_dtype(device.type) == torch.bfloat16:
            return torch.bfloat16
        return self.dtype

    def attention_masks(
        self,
        attention_mask: torch.Tensor | dict | None,
        inputs_embeds: torch.Tensor,
        past_key_values: Cache | None,
        position_ids: torch.LongTensor,
        plain_causal_rows: bool,
    ) -> dict:
        """The mask of each layer type (`"full_attention"`, `"sliding_attention"`), from transformers' mask helpers; a
        dict given as `attention_mask` is taken as is. For `plain_causal_rows` (no mask, positions or cache: training
        and scoring) the full-attention mask is None, so that SDPA and flash run their causal kernels, and a mask that
        is still needed (sliding windows; eager or flex attention) is built for one row, `(1, 1, T, T)`, which the
        attention broadcasts over the batch: every row's mask is the same, and a `(B, 1, T, T)` one was written at
        every forward and kept for the backward (134 MB at 16 × 2048 in bf16; nanochat's is `(T, T)`)."""
        if isinstance(attention_mask, dict):
            return attention_mask
        mask_kwargs = dict(
            config=self.config,
            inputs_embeds=inputs_embeds[:1] if plain_causal_rows else inputs_embeds,  # shape, dtype, device only
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=None if plain_causal_rows else position_ids,
        )
        if plain_causal_rows and self.config._attn_implementation in CAUSAL_FLAG_ATTENTION:
            # transformers' helper would build a dense (B, 1, T, T) mask under torch.compile with torch < 2.14
            # (`_ignore_causal_mask_sdpa`), which keeps SDPA off its flash kernel.
            masks = {"full_attention": None}
        else:
            masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if "sliding_attention" in self.config.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        return masks

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`): token ids; required when the model has
                L3 layers (they route by id).
            attention_mask (`torch.Tensor` of shape `(batch_size, seq_len)`, *optional*): 1 = attend, 0 = padding.
            position_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`, *optional*): positions; restarting
                positions mark packed documents, which then do not attend to each other (transformers' masks).
            past_key_values (`Cache`, *optional*): a `DynamicCache` or `StaticCache` (built with this model's config)
                for incremental decoding.
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`, *optional*).
            output_hidden_states, output_attentions (in `kwargs`): also return `hidden_states` (`num_hidden_layers +
                1` tensors `(batch_size, seq_len, hidden_size)`: the first layer's input, then each layer's output,
                the last being `last_hidden_state`) / `attentions` (see `_can_record_outputs`).

        Returns:
            `BaseModelOutputWithPast` with `last_hidden_state` `(batch_size, seq_len, hidden_size)` (final-normed).

        Raises:
            ValueError: if both or neither of `input_ids` / `inputs_embeds` are given, or L3 layers or value
                embeddings lack `input_ids`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        elif len(self.l3_layers) + len(self.value_embeddings) and input_ids is None:
            raise ValueError("L3 layers and value embeddings read rows by token id: pass input_ids, not inputs_embeds")
        inputs_embeds = inputs_embeds.to(self.residual_dtype(inputs_embeds.device))
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        plain_causal_rows = position_ids is None and attention_mask is None and past_key_values is None
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None] + past_seen

        mask_mapping = self.attention_masks(attention_mask, inputs_embeds, past_key_values, position_ids,
                                            plain_causal_rows)
        hidden_states = self.norm(inputs_embeds)  # (B, T, C)
        if self.smear is not None:
            previous = self.smear.previous_embedding(hidden_states, past_key_values)
            hidden_states = self.smear(hidden_states, position_ids, previous)
        x0 = hidden_states
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        routing = self.route_l3(input_ids) if len(self.l3_layers) else None
        backout_layer = self.config.num_hidden_layers // 2 if self.backout_lambda is not None else None
        for i, layer in enumerate(self.layers):
            hidden_states = self.resid_lambdas[i] * hidden_states + self.x0_lambdas[i] * x0
            value_embeds = self.value_embeddings[str(i)](input_ids) if str(i) in self.value_embeddings else None
            hidden_states = layer(
                hidden_states,
                attention_mask=mask_mapping[self.config.layer_types[i]],
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                value_embeds=value_embeds,  # (B, T, kv_dim) or None
                **kwargs,
            )
            if str(i) in self.l3_layers:
                hidden_states = self.l3_layers[str(i)](hidden_states, routing)
            if i == backout_layer:
                mid_stack = hidden_states
        if backout_layer is not None:
            hidden_states = hidden_states - self.backout_lambda.to(hidden_states.dtype) * mid_stack
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states),
            past_key_values=past_key_values if use_cache else None,
        )


class L3GPTForCausalLM(L3GPTPreTrainedModel, GenerationMixin):
    """L3GPT with an untied output head and a logit softcap `c·tanh(logits/c)` (computed in float32 or wider, c =
    `config.final_logit_softcapping`; the returned logits are in the head's dtype, as Qwen3's). Loss: transformers'
    `ForCausalLMLoss` semantics on unshifted `labels` (the shift is inside; -100 ignored), exact under gradient
    accumulation when the Trainer passes `num_items_in_batch`.

    In training mode with `labels`, `logits` is None (unless `return_logits=True`) and the loss is computed as
    `loss_implementation` says (`training_loss_path`): from the logits inside a `torch.compile` graph (nanochat's
    loss: Inductor fuses the softcap and the cross-entropy, no float32 `(batch, seq, vocab)` tensor is kept), or by
    `linear_cross_entropy.causal_lm_loss` without building them (Liger's fused kernel on CUDA when installed, a
    chunked PyTorch function elsewhere). In eval mode, or without labels, the logits are returned and the loss is
    `self.loss_function` of them."""

    _tied_weights_keys = {}
    loss_implementation = "auto"
    """One of `LOSS_IMPLEMENTATIONS`; set it with `set_loss_implementation` (not saved with the model)."""

    def __init__(self, config: L3GPTConfig):
        super().__init__(config)
        self.model = L3GPTModel(config)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head = with_init(lm_head, "normal", config.initializer_range)
        self.post_init()

    def set_l3_allocation(self, counts: torch.Tensor) -> None:
        """See [`L3GPTModel.set_l3_allocation`]."""
        self.model.set_l3_allocation(counts)

    def set_loss_implementation(self, name: str) -> None:
        """How the training loss is computed: "auto" (`training_loss_path`), "logits", "chunked" or "liger".

        Raises:
            ValueError: for another name, or "liger" where `liger_kernel` is not installed.
        """
        if name not in LOSS_IMPLEMENTATIONS:
            raise ValueError(f"loss_implementation={name!r}; expected one of {', '.join(LOSS_IMPLEMENTATIONS)}")
        if name == "liger" and not liger_applies(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu")):
            raise ValueError("loss_implementation='liger' needs CUDA and liger-kernel (pip install liger-kernel)")
        self.loss_implementation = name

    def training_loss_path(self, hidden_states: torch.Tensor) -> str:
        """The training loss's path for `hidden_states`: `loss_implementation`, or for "auto": "logits" inside a
        `torch.compile` graph (one graph, no graph break; Inductor fuses what nanochat's compiled loss fuses), else
        "liger" on CUDA with liger-kernel installed, else "chunked" (eager steps keep the memory-light loss)."""
        if self.loss_implementation != "auto":
            return self.loss_implementation
        if torch.compiler.is_compiling():
            return "logits"
        return "liger" if liger_applies(hidden_states) else "chunked"

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        """Install `new_embeddings` as `lm_head`; a head without an init scheme (the one `resize_token_embeddings`
        builds) keeps the current head's, so that `_init_weights` still knows how to initialise it."""
        if not hasattr(new_embeddings, "hfl3_init"):
            new_embeddings.hfl3_init = self.lm_head.hfl3_init
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_logits: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """
        Args:
            labels (`torch.LongTensor` of shape `(batch_size, seq_len)`, *optional*): targets aligned with
                `input_ids` (unshifted); -100 is ignored.
            logits_to_keep (`int` or `torch.Tensor`): compute logits only for the last N positions (0 = all).
            return_logits: in training mode with `labels`, also build the logits and take the loss from them (the
                memory-heavy path of eval mode) instead of the fused/chunked loss.
            return_dict (in `kwargs`, default `config.return_dict`): False returns `to_tuple()` of the output (its
                fields that are not None, in order).
            num_items_in_batch (in `kwargs`): count of target tokens across gradient-accumulation steps.
            Other arguments: see [`L3GPTModel.forward`].

        Returns:
            `CausalLMOutputWithPast`: `loss` (nats per target token) when `labels` is given; `logits`
            `(batch_size, kept_len, vocab_size)` in `lm_head.weight`'s dtype (the softcap and the loss run in float32
            or wider), or None in training mode with `labels` unless `return_logits`; `hidden_states` / `attentions`
            when asked for (see [`L3GPTModel.forward`]).
        """
        register_zero3_owner(self, self.lm_head.weight)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # read by field below; `can_return_tuple` makes this model's own output a tuple
            **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, keep, :]  # (B, T, C)
        if labels is not None and self.training and not return_logits:
            path = self.training_loss_path(hidden_states)
            if path == "logits":  # the logits stay inside the graph: only the loss leaves it
                loss = self.loss_function(logits=self.capped_logits(hidden_states), labels=labels,
                                          vocab_size=self.config.vocab_size, **kwargs)
            else:
                loss = causal_lm_loss(hidden_states, self.lm_head.weight, labels,
                                      softcap=self.config.final_logit_softcapping, backend=path, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                          hidden_states=outputs.hidden_states, attentions=outputs.attentions)
        logits = self.capped_logits(hidden_states)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits.to(self.lm_head.weight.dtype),
                                      past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                                      attentions=outputs.attentions)


    def capped_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`lm_head(hidden_states)` `(batch_size, seq_len, vocab_size)`, softcapped `c·tanh(logits/c)` in float32 or
        wider when `config.final_logit_softcapping` is set (as nanochat's; a float64 model keeps float64)."""
        logits = self.lm_head(hidden_states)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return cap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / cap)


__all__ = [
    "L3GPTForCausalLM",
    "L3GPTModel",
    "L3GPTPreTrainedModel",
    "L3GPTSmear",
    "L3GPTValueEmbeddings",
    "LargeLookupLayer",
    "l3_routing",
]
