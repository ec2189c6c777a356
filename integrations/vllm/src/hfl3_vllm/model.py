"""L3GPT as a native vLLM model: nanochat's GPT (karpathy/nanochat 92d63d4, nanochat/gpt.py) with Large Lookup Layers
("L³: Large Lookup Layers", Tseng & De Sa, arXiv 2601.21461), computing what hfl3's `modeling_l3gpt.py` computes.

Built from vLLM's own parts: `Attention` with each layer's sliding window (its paged KV cache and kernels),
`get_rope` (neox-style rotation, which is hfl3's textbook convention), weightless `RMSNorm`s for the norms and the
QK-norm, `QKVParallelLinear`/`RowParallelLinear` projections (so LoRA adapters of q/k/v/o and the MLP apply),
`ReLUSquaredActivation`, `VocabParallelEmbedding` for the token and value-embedding tables, `ParallelLMHead` and
`LogitsProcessor` with the logit softcap. The smear's previous token is per-sequence state (`smear.py`), the L3
layers are `lookup.py`. File order as hfl3's: attention → MLP → decoder layer → model → causal LM.

Per token, with x0 the smeared normed embedding: for each layer i, `h = resid_lambdas[i]·h + x0_lambdas[i]·x0`, the
pre-norm attention (value embeddings gated into the values on `value_embedding_layers`) and ReLU² MLP, then the L3
layer after layer i if any; `h ← h − backout_lambda·h_mid` (h after layer `num_hidden_layers // 2`), the final norm,
`lm_head` and `c·tanh(logits/c)`.
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.activation import ReLUSquaredActivation
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsLoRA
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sequence import IntermediateTensors

from .config import UnservableConfigError
from .lookup import LargeLookupLayer
from .smear import L3GPTSmear, smear_state_copy_funcs, smear_state_dtype, smear_state_shape

# nanochat 6ed7d1d: value-embedding gates are 3·sigmoid(·).
VALUE_EMBEDDING_GATE_RANGE = 3.0


class L3GPTAttention(nn.Module):
    """Causal self-attention with QK-norm (weightless RMSNorm × `qk_norm_scale`), rotary embeddings, GQA, the
    layer's sliding window, and on `value_embedding_layers` the gated value embedding
    `v ← v + 3·σ(W_g·h[:, :g]) ⊙ E_i[t]` (nanochat e85db6b; hfl3's `L3GPTAttention`)."""

    def __init__(self, config, layer_idx: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_norm_scale = config.qk_norm_scale
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads,
                                          bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=False, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.qk_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, has_weight=False)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters=config.rope_parameters)
        is_sliding = config.decoder_layer_types[layer_idx] == "sliding_attention"
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=cache_config, quant_config=quant_config,
                              per_layer_sliding_window=config.sliding_window if is_sliding else None,
                              prefix=f"{prefix}.attn")
        self.value_embedding_gate = None
        if layer_idx in config.value_embedding_layers:
            self.gate_channels = config.value_embedding_gate_channels
            self.value_embedding_gate = ReplicatedLinear(self.gate_channels, self.num_kv_heads, bias=False,
                                                         prefix=f"{prefix}.value_embedding_gate")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                value_embeds: torch.Tensor | None) -> torch.Tensor:
        """`hidden_states` `(num_tokens, hidden_size)` (normed), `value_embeds` `(num_tokens, kv_size)` or None."""
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.qk_norm(q.view(-1, self.num_heads, self.head_dim)) * self.qk_norm_scale  # (T, H, D)
        k = self.qk_norm(k.view(-1, self.num_kv_heads, self.head_dim)) * self.qk_norm_scale  # (T, Hkv, D)
        if value_embeds is not None:
            gate, _ = self.value_embedding_gate(hidden_states[:, : self.gate_channels])  # (T, Hkv)
            gate = VALUE_EMBEDDING_GATE_RANGE * torch.sigmoid(gate)
            v = (v.view(-1, self.num_kv_heads, self.head_dim)
                 + gate[..., None] * value_embeds.view(-1, self.num_kv_heads, self.head_dim).to(v.dtype))
        q, k = self.rotary_emb(positions, q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size))
        attn_output = self.attn(q, k, v.reshape(-1, self.kv_size))
        output, _ = self.o_proj(attn_output)
        return output


class L3GPTMLP(nn.Module):
    """ReLU² MLP (Primer, arXiv 2109.08668; nanochat): `down_proj(relu(up_proj(x))²)`."""

    def __init__(self, config, quant_config, prefix: str):
        super().__init__()
        self.up_proj = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=False,
                                            quant_config=quant_config, prefix=f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = ReLUSquaredActivation()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, _ = self.up_proj(x)
        down, _ = self.down_proj(self.act_fn(up))
        return down


class L3GPTDecoderLayer(nn.Module):
    """Pre-norm block: `h + attn(norm(h))`, then `h + mlp(norm(h))`."""

    def __init__(self, config, layer_idx: int, cache_config, quant_config, prefix: str):
        super().__init__()
        self.self_attn = L3GPTAttention(config, layer_idx, cache_config, quant_config, f"{prefix}.self_attn")
        self.mlp = L3GPTMLP(config, quant_config, f"{prefix}.mlp")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, has_weight=False)

    def forward(self, positions, hidden_states, value_embeds):
        hidden_states = hidden_states + self.self_attn(positions, self.norm(hidden_states), value_embeds)
        return hidden_states + self.mlp(self.norm(hidden_states))


@support_torch_compile
class L3GPTModel(nn.Module):
    """The decoder stack with hfl3's module and parameter names (`model.*` in hfl3's checkpoints)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config, quant_config = vllm_config.cache_config, vllm_config.quant_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        kv_size = config.num_key_value_heads * config.head_dim
        self.value_embeddings = nn.ModuleDict({
            str(i): VocabParallelEmbedding(config.vocab_size, kv_size, prefix=f"{prefix}.value_embeddings.{i}")
            for i in config.value_embedding_layers
        })  # fmt: skip
        self.smear = None
        if config.use_smear_gate:
            self.smear = L3GPTSmear(config, vllm_config.model_config, cache_config, f"{prefix}.smear")
        self.backout_lambda = nn.Parameter(torch.zeros(1)) if config.use_backout else None
        self.layers = nn.ModuleList(
            L3GPTDecoderLayer(config, i, cache_config, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.l3_layers = nn.ModuleDict({
            str(i): LargeLookupLayer(config, f"{prefix}.l3_layers.{i}") for i in config.l3_after_layers
        })  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, has_weight=False)
        self.resid_lambdas = nn.Parameter(torch.ones(config.num_hidden_layers))
        self.x0_lambdas = nn.Parameter(torch.zeros(config.num_hidden_layers))
        self.register_buffer("l3_bounds", torch.zeros(config.vocab_size + 1, dtype=torch.long))
        self.backout_layer = config.num_hidden_layers // 2 if config.use_backout else None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`input_ids`, `positions` `(num_tokens,)` → final-normed hidden states `(num_tokens, hidden_size)`.

        Raises:
            ValueError: if only `inputs_embeds` is given to a model with value embeddings or L3 layers (they read
                rows by token id).
        """
        if input_ids is None and (len(self.value_embeddings) or len(self.l3_layers)):
            raise ValueError("L3 layers and value embeddings read rows by token id: prompt embeddings cannot be served")
        hidden_states = self.norm(self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds)
        if self.smear is not None:
            hidden_states = self.smear(hidden_states, positions)
        x0 = hidden_states  # (T, C)
        mid_stack = None
        for i, layer in enumerate(self.layers):
            hidden_states = self.resid_lambdas[i] * hidden_states + self.x0_lambdas[i] * x0
            key = str(i)
            value_embeds = self.value_embeddings[key](input_ids) if key in self.value_embeddings else None
            hidden_states = layer(positions, hidden_states, value_embeds)
            if key in self.l3_layers:
                hidden_states = self.l3_layers[key](hidden_states, input_ids, self.l3_bounds)
            if i == self.backout_layer:
                mid_stack = hidden_states
        if mid_stack is not None:
            hidden_states = hidden_states - self.backout_lambda.to(hidden_states.dtype) * mid_stack
        return self.norm(hidden_states)


class L3GPTForCausalLM(nn.Module, SupportsLoRA):
    """L3GPT for vLLM: the decoder stack, an untied (or tied, `tie_word_embeddings`) `lm_head` and the logit softcap
    `c·tanh(logits/c)`, c = `final_logit_softcapping` (applied by vLLM's `LogitsProcessor`). Loads hfl3's
    `model.safetensors` as saved (q/k/v stacked into vLLM's `qkv_proj`). This class serves models without the smear;
    `L3GPTSmearForCausalLM` those with it (the serving config names the one that fits, `config.py`).

    Raises:
        UnservableConfigError: for tensor or pipeline parallelism (the value-embedding, L3 and smear tables are not
            sharded), naming the setting.
    """

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    embedding_modules = {}
    stacked_params_mapping = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                              (".qkv_proj", ".v_proj", "v")]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        parallel = vllm_config.parallel_config
        for setting in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(parallel, setting) != 1:
                raise UnservableConfigError(f"{setting}={getattr(parallel, setting)}: the L3GPT plugin serves on one "
                                            "device (its value-embedding, L3 and smear tables are not sharded)")
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = L3GPTModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load hfl3's tensors by name; q/k/v go into `qkv_proj`'s shards, `l3_bounds` into its buffer."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for stacked, single, shard in self.stacked_params_mapping:
                if single in name:
                    name = name.replace(single, stacked)
                    params[name].weight_loader(params[name], tensor, shard)
                    break
            else:
                if name in buffers:
                    buffers[name].copy_(tensor)
                else:
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


class L3GPTSmearForCausalLM(L3GPTForCausalLM, HasInnerState, IsHybrid):
    """`L3GPTForCausalLM` with the smear, whose previous token is per-sequence state: vLLM serves state layers only
    in a model class declared hybrid (`IsHybrid`: attention plus state layers), and refuses such a class without
    any ("no mamba layers in the model"), hence two classes. The state is the smear's width-2 short-convolution
    state (`smear.py`)."""

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, int]]:
        return smear_state_shape(vllm_config.model_config.hf_config.hidden_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype]:
        return smear_state_dtype(vllm_config.model_config, vllm_config.cache_config)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return smear_state_copy_funcs()
