"""nanochat's smear (karpathy/nanochat a825e63) with its previous token kept as vLLM per-sequence state.

The smear mixes the previous token's normed embedding into each token: `x_t ← x_t + λ·σ(w·x_t[:s])·x_{t-1}`, skipped
where the position is 0 (hfl3's `L3GPTSmear`). `x_{t-1}` is the output of a width-2 causal convolution with the shift
kernel `[1, 0]` over the normed embeddings, so its state is a short-convolution state of `hidden_size` values per
sequence, which vLLM already keeps for LFM2's `ShortConv` (vllm/model_executor/layers/mamba/short_conv.py): the layer
is a `MambaBase` of type `SHORT_CONV`, its state lives in vLLM's cache blocks (prefix caching in `align` mode copies
it with `get_conv_copy_spec`), its metadata is `ShortConvAttentionMetadata`, and it runs vLLM's own causal-convolution
ops (the plain-torch CPU path, or the Triton kernels on GPUs), as `ShortConv` does. `1·a + 0·b = a` in floating
point, so the previous embedding is copied exactly.
"""

import torch
from torch import nn
from vllm.config import CacheConfig, ModelConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

# The smear reads the token before: a causal convolution of width 2 (state of 1 token).
CONV_KERNEL = 2


def smear_state_shape(hidden_size: int) -> tuple[tuple[int, int]]:
    """vLLM's short-convolution state shape for a width-2 convolution over `hidden_size` channels."""
    return MambaStateShapeCalculator.short_conv_state_shape(tp_world_size=1, intermediate_size=hidden_size,
                                                            conv_kernel=CONV_KERNEL)


def smear_state_dtype(model_config: ModelConfig, cache_config: CacheConfig) -> tuple[torch.dtype]:
    """The state's dtype: the model's, or `--mamba-cache-dtype` (vLLM's rule for short convolutions)."""
    return MambaStateDtypeCalculator.short_conv_state_dtype(model_config.dtype, cache_config.mamba_cache_dtype)


smear_state_copy_funcs = MambaStateCopyFuncCalculator.short_conv_state_copy_func


class SmearState(MambaBase, nn.Module):
    """The smear's per-sequence state: the last normed embedding of each sequence, kept by vLLM as a width-2
    short-convolution state (see the module docstring), and `previous_tokens`, which reads and updates it.

    Raises:
        ValueError: under speculative decoding (the state would need one slot per draft token; not supported).
    """

    def __init__(self, hidden_size: int, model_config: ModelConfig, cache_config: CacheConfig, prefix: str):
        super().__init__()
        vllm_config = get_current_vllm_config()
        if vllm_config.num_speculative_tokens:
            raise ValueError("speculative decoding: the L3GPT plugin keeps the smear's state for one token per step; "
                             "serve without a speculative config")
        self.hidden_size = hidden_size
        self.model_config, self.cache_config, self.prefix = model_config, cache_config, prefix
        shift = torch.zeros(hidden_size, CONV_KERNEL)  # the shift kernel [1, 0] per channel: out_t = x_{t-1}
        shift[:, 0] = 1.0
        self.register_buffer("shift_kernel", shift, persistent=False)
        forward_context = vllm_config.compilation_config.static_forward_context
        if prefix in forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        forward_context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> tuple[tuple[int, int]]:
        return smear_state_shape(self.hidden_size)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return smear_state_dtype(self.model_config, self.cache_config)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """`embeds` `(num_tokens, hidden_size)` → the embedding of each token's predecessor (zero at a sequence's
        start), through an op that `torch.compile` leaves opaque."""
        previous = torch.zeros_like(embeds)
        torch.ops.vllm.l3gpt_smear_previous(embeds, previous, self.prefix)
        return previous

    def previous_tokens(self, embeds: torch.Tensor, previous: torch.Tensor) -> None:
        """Write into `previous` `(num_tokens, hidden_size)` the embedding of each token's predecessor in its sequence
        (from the state for the first token of a step; zero at a sequence's start) and record each sequence's last
        embedding in the state. Tokens come decodes first, then prefills (vLLM's order for state layers)."""
        attn_metadata = get_forward_context().attn_metadata
        metadata = attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
        if metadata is None:  # profile run: no state
            return
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        num_decodes, num_prefill_tokens = metadata.num_decode_tokens, metadata.num_prefill_tokens
        kernel = self.shift_kernel.to(conv_state.dtype)
        on_cpu = current_platform.is_cpu()
        if num_prefill_tokens:
            tokens = slice(num_decodes, num_decodes + num_prefill_tokens)
            if on_cpu:
                from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu as conv_fn
            else:
                from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn as conv_fn
            previous[tokens] = conv_fn(
                embeds[tokens].transpose(0, 1), kernel, None, conv_states=conv_state,
                query_start_loc=metadata.query_start_loc_p, cache_indices=metadata.state_indices_tensor_p.flatten(),
                has_initial_state=metadata.has_initial_states_p, activation=None, metadata=metadata,
            ).transpose(0, 1)[:num_prefill_tokens]
        if num_decodes:
            indices = metadata.state_indices_tensor_d.flatten()
            if on_cpu:
                from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu as update
            else:
                from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update as update
            previous[:num_decodes] = update(embeds[:num_decodes].contiguous(), conv_state, kernel, None,
                                            activation=None, conv_state_indices=indices)


class L3GPTSmear(nn.Module):
    """The smear with hfl3's parameters (`model.smear.gate.weight` `(1, smear_gate_channels)`,
    `model.smear.smear_lambda` `(1,)`) and its state layer, keyed by its cache layer index `num_hidden_layers` (after
    the attention layers, as in hfl3's transformers cache): vLLM orders state and attention layers by the one
    integer in their names."""

    def __init__(self, config, model_config: ModelConfig, cache_config: CacheConfig, prefix: str):
        super().__init__()
        self.gate_channels = config.smear_gate_channels
        self.gate = ReplicatedLinear(config.smear_gate_channels, 1, bias=False, prefix=f"{prefix}.gate")
        self.smear_lambda = nn.Parameter(torch.zeros(1))
        index = str(config.num_hidden_layers)
        self.state = nn.ModuleDict({index: SmearState(config.hidden_size, model_config, cache_config,
                                                      f"{prefix}.state.{index}")})

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`embeds` `(num_tokens, hidden_size)` (normed embeddings), `positions` `(num_tokens,)` → smeared embeds:
        `x_t + λ·σ(gate(x_t[:s]))·x_{t-1}`, nothing added at position 0."""
        (state,) = self.state.values()
        previous = state(embeds)  # (T, C)
        gate = self.smear_lambda * torch.sigmoid(self.gate(embeds[:, : self.gate_channels])[0])  # (T, 1)
        return embeds + (gate * (positions > 0)[:, None]).to(embeds.dtype) * previous


def l3gpt_smear_previous(embeds: torch.Tensor, previous: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].previous_tokens(embeds, previous)


def l3gpt_smear_previous_fake(embeds: torch.Tensor, previous: torch.Tensor, layer_name: str) -> None:
    return None


# an opaque op for torch.compile, as vLLM's `short_conv` op: the state update reads the forward context
direct_register_custom_op(op_name="l3gpt_smear_previous", op_func=l3gpt_smear_previous, mutates_args=["previous"],
                          fake_impl=l3gpt_smear_previous_fake)
