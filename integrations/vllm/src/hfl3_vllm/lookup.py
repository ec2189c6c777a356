"""The Large Lookup Layer ("L³: Large Lookup Layers", Tseng & De Sa, arXiv 2601.21461, §3.1) for vLLM's flat batches.

After its decoder layer, for the hidden state h of a token with id t and x = Norm(h):

    h ← h + W_mix [ Norm(W_up(V_tᵀ softmax(K_t x / √C))) ; x ]      (h itself instead of x when l3_mix_input="residual")

K_t, V_t are token t's own rows `l3_bounds[t]:l3_bounds[t+1]` of the tables (one table when `l3_tie_kv`). The lookup
works on (token, row) pairs, as hfl3's `lookup.py` does (docs/design.md, decision 5): P = Σ_t d_t scalars for scores
and probabilities and an `embedding_bag` for the weighted sum, never a `(tokens, k_max, hidden)` tensor. Scores and
softmax run in at least float32.

Tables on the device by default. With `l3_offload` they stay in CPU memory (pinned where CUDA is available) and each
step copies only the routed tokens' rows to the device, the paper's offloading: routing depends only on the token
ids, so the rows are known before any layer runs. Outputs are the same either way (the same rows, copied).

The lookup is an opaque op for `torch.compile` (its pair count depends on the ids).
"""

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.utils.torch_utils import direct_register_custom_op

# Pairs whose scores are gathered at once: 8 MiB of float32 rows per operand at C = 256 (bounded temporaries).
SCORE_CHUNK_PAIRS = 8192


def routed_pairs(ids: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(token_of_pair, row_of_pair, offsets)` for `ids` `(N,)` and CSR `bounds` `(vocab_size + 1,)`: every token's
    rows in order, `(P,)` each, and `offsets` `(N,)`, where each token's pairs start."""
    starts = bounds[ids]
    sizes = bounds[ids + 1] - starts  # (N,)
    offsets = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    token_of_pair = torch.repeat_interleave(torch.arange(ids.numel(), device=ids.device), sizes, output_size=total)
    row_of_pair = torch.arange(total, device=ids.device) - offsets[token_of_pair] + starts[token_of_pair]
    return token_of_pair, row_of_pair, offsets


def pair_lookup(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, token_of_pair: torch.Tensor,
                row_of_pair: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`V_tᵀ softmax(K_t x_t / √C)` over each token's own rows: `x` `(N, C)`, tables `(rows, C)` → `(N, C)` in x's
    dtype (hfl3's `pair_softmax` + `embedding_bag`)."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, keys.dtype), torch.float32)
    scores = torch.empty(token_of_pair.numel(), device=x.device, dtype=dtype)  # (P,)
    for start in range(0, token_of_pair.numel(), SCORE_CHUNK_PAIRS):
        chunk = slice(start, start + SCORE_CHUNK_PAIRS)
        scores[chunk] = (x[token_of_pair[chunk]].to(dtype) * keys[row_of_pair[chunk]].to(dtype)).sum(-1)
    scores = scores * x.shape[-1] ** -0.5
    segment_max = scores.new_full((x.shape[0],), -torch.inf).scatter_reduce(0, token_of_pair, scores, reduce="amax")
    exp_scores = torch.exp(scores - segment_max[token_of_pair])
    normaliser = scores.new_zeros(x.shape[0]).index_add(0, token_of_pair, exp_scores)  # (N,)
    probs = exp_scores / normaliser[token_of_pair]
    looked_up = F.embedding_bag(row_of_pair, values, offsets, mode="sum", per_sample_weights=probs.to(values.dtype))
    return looked_up.to(x.dtype)


def fetched_rows(table: torch.Tensor, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`rows` `(R,)` (a CPU index) of the host `table`, copied to `device` (through pinned memory on CUDA)."""
    fetched = table.index_select(0, rows)
    if device.type == "cuda":
        fetched = fetched.pin_memory()
    return fetched.to(device, non_blocking=True)


class LargeLookupLayer(nn.Module):
    """An L3 layer with hfl3's parameter names: `key_table.weight` `(l3_n_emb, C)`, `value_table.weight` (untied),
    `up_proj.weight` `(l3_d_up, C)`, `mix_proj.weight` `(C, l3_d_up + C)`; `bounds` is the model's `l3_bounds`."""

    def __init__(self, config, prefix: str):
        super().__init__()
        self.offload = config.l3_offload
        table_device = "cpu" if self.offload else None  # None: the device vLLM builds the model on
        self.key_table = nn.Module()
        self.key_table.weight = nn.Parameter(torch.empty(config.l3_n_emb, config.hidden_size, device=table_device),
                                             requires_grad=False)
        self.value_table = None
        if not config.l3_tie_kv:
            self.value_table = nn.Module()
            self.value_table.weight = nn.Parameter(
                torch.empty(config.l3_n_emb, config.hidden_size, device=table_device), requires_grad=False)
        self.up_proj = ReplicatedLinear(config.hidden_size, config.l3_d_up, bias=False, prefix=f"{prefix}.up_proj")
        self.mix_proj = ReplicatedLinear(config.l3_d_up + config.hidden_size, config.hidden_size, bias=False,
                                         prefix=f"{prefix}.mix_proj")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, has_weight=False)
        self.up_norm = RMSNorm(config.l3_d_up, eps=config.rms_norm_eps, has_weight=False)
        self.mix_residual = config.l3_mix_input == "residual"
        self.prefix = prefix
        # reachable by name from the opaque op, as vLLM's attention and state layers are
        forward_context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        forward_context[prefix] = self

    def lookup(self, x: torch.Tensor, input_ids: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """`V_tᵀ softmax(K_t x / √C)` for normed `x` `(N, C)` of the tokens `input_ids` `(N,)`."""
        keys = self.key_table.weight
        values = keys if self.value_table is None else self.value_table.weight
        token_of_pair, row_of_pair, offsets = routed_pairs(input_ids, bounds)
        if self.offload:  # only the routed rows, once each; the pairs renumbered into them
            routed_rows, row_of_pair = torch.unique(row_of_pair.cpu(), return_inverse=True)
            tied = self.value_table is None
            keys = fetched_rows(keys, routed_rows, x.device)
            values = keys if tied else fetched_rows(values, routed_rows, x.device)
            row_of_pair = row_of_pair.to(x.device)
        return pair_lookup(x, keys, values, token_of_pair, row_of_pair, offsets)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """`hidden_states` `(num_tokens, hidden_size)` → the same with the layer's output added."""
        x = self.norm(hidden_states)  # (N, C)
        looked_up = torch.empty_like(x)
        torch.ops.vllm.l3gpt_lookup(x, input_ids, bounds, looked_up, self.prefix)
        up = self.up_norm(self.up_proj(looked_up)[0])  # (N, d_up)
        mixed_input = hidden_states if self.mix_residual else x
        return hidden_states + self.mix_proj(torch.cat([up, mixed_input], dim=-1))[0]


def l3gpt_lookup(x: torch.Tensor, input_ids: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor,
                 layer_name: str) -> None:
    out.copy_(get_forward_context().no_compile_layers[layer_name].lookup(x, input_ids, bounds))


def l3gpt_lookup_fake(x, input_ids, bounds, out, layer_name) -> None:
    return None


direct_register_custom_op(op_name="l3gpt_lookup", op_func=l3gpt_lookup, mutates_args=["out"],
                          fake_impl=l3gpt_lookup_fake)
