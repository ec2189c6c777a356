"""The Large Lookup Layer ("L³: Large Lookup Layers", Tseng & De Sa, arXiv 2601.21461, §3.1) and its lookup on
(token, row) pairs, as `torch.library` custom ops, so that `torch.compile` keeps a training forward with L3 layers in
one graph.

Token t owns the rows `bounds[t]:bounds[t + 1]` of the tables; a batch of N tokens routes to P = Σ_t d_t pairs. P
depends on the token ids, and a traced graph cannot hold a tensor whose size depends on data without a graph break
(or a global `torch._dynamo` setting). So nothing of size P crosses the graph: the routing is three `(N,)` tensors
and the pair count as a CPU scalar (one device→host copy per forward, which the host waits for only where the first
L3 layer reads it: `pair_count_on_host`), and the lookup op and its backward op expand the pairs inside, where the
code is plain PyTorch (`embedding_bag`, its backward kernels, and score gathers in chunks of pairs), so no `(P, C)`
tensor is built. The backward recomputes the softmax instead of keeping `(P,)` tensors between the passes.

Self-contained (relative imports only; ships with the modeling file as Hub remote code). Each copy of this folder
registers its ops under a namespace named after its module, so hfl3's copy and a Hub copy loaded in the same process
do not collide.
"""

import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .allocation import bounds_from_counts, uniform_allocation
from .configuration_l3gpt import L3GPTConfig
from .layers import L3GPTRMSNorm, initialize, uniform_bound, with_init
from .offload import HostTable, L3Prefetch, fetched_tables, host_tables, prefetch_routed_rows

NAMESPACE = "_".join(["l3gpt", *re.findall(r"[A-Za-z0-9]+", __name__)])


class L3Routing(NamedTuple):
    """Static routing of N = batch·seq tokens to their L3 table rows: token n owns the pairs
    `pair_offsets[n] : pair_offsets[n] + sizes[n]`, which read the table rows `starts[n] : starts[n] + sizes[n]`.

    starts, sizes, pair_offsets: `(N,)` on the ids' device; num_pairs: P = Σ sizes, a 0-d CPU tensor, whose value
    is there once `num_pairs_copied` (a CUDA event; None: at once) has completed (`pair_count_on_host`).
    prefetch: the routed rows of offloaded tables, being fetched to the compute device (`offload.L3Prefetch`).
    """

    starts: torch.LongTensor
    sizes: torch.LongTensor
    pair_offsets: torch.LongTensor
    num_pairs: torch.LongTensor
    num_pairs_copied: "torch.cuda.Event | None" = None
    prefetch: L3Prefetch | None = None


def l3_routing(input_ids: torch.LongTensor, l3_bounds: torch.LongTensor) -> L3Routing:
    """Routing of `input_ids` (any shape) to the rows of allocation `l3_bounds` `(vocab_size + 1,)`.

    Costs one device→host copy (the pair count), not waited for here (`pair_count_on_host`); shared by all L3 layers
    of a forward pass.
    """
    ids = input_ids.reshape(-1)
    starts = l3_bounds[ids]
    sizes = l3_bounds[ids + 1] - starts  # (N,)
    num_pairs, copied = pair_count_on_host(sizes)
    return L3Routing(starts, sizes, torch.cumsum(sizes, 0) - sizes, num_pairs, copied)


def pair_count_on_host(sizes: torch.LongTensor) -> tuple[torch.LongTensor, "torch.cuda.Event | None"]:
    """P = Σ `sizes` as a 0-d CPU tensor, and on CUDA the event after which it holds its value (else None).

    On CUDA the count is copied into pinned memory without blocking, so the host goes on queueing the decoder layers
    before the first L3 layer and waits only there (`pair_lookup`), with that work still queued: a blocking `.cpu()`
    at the routing drained the device's queue at every forward. The CPU takes the same path (its copy is synchronous);
    other devices copy blocking. Inside a compiled graph the copy is the graph's own (`.cpu()`).
    """
    total = sizes.sum()
    if torch.compiler.is_compiling():
        return total.cpu(), None
    host = torch.empty((), dtype=total.dtype, pin_memory=total.is_cuda)
    host.copy_(total, non_blocking=total.device.type in ("cpu", "cuda"))
    if not total.is_cuda:
        return host, None
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(total.device))
    return host, copied


def expand_pairs(starts, sizes, pair_offsets, num_pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """`(token_of_pair, row_of_pair)`, both `(P,)`: the token index and the table row of every pair."""
    total = int(num_pairs)  # a CPU tensor: no device sync
    token_of_pair = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), sizes,
                                            output_size=total)
    row_of_pair = torch.arange(total, device=starts.device) - pair_offsets[token_of_pair] + starts[token_of_pair]
    return token_of_pair, row_of_pair


def pair_scores(x: torch.Tensor, keys: torch.Tensor, token_of_pair: torch.Tensor, row_of_pair: torch.Tensor,
                dtype: torch.dtype, chunk_size: int) -> torch.Tensor:
    """`scores[p] = <x[token_of_pair[p]], keys[row_of_pair[p]]>`, `(P,)` in `dtype`, gathering `chunk_size` pairs at
    a time (never a `(P, C)` tensor). Gathered rows are fresh, aligned copies, so scores do not depend on where the
    table lives in memory (aten's fused per-pair dot product does: a model and its reloaded checkpoint differed)."""
    out = torch.empty(token_of_pair.numel(), device=x.device, dtype=dtype)
    for start in range(0, token_of_pair.numel(), chunk_size):
        chunk = slice(start, start + chunk_size)
        out[chunk] = (x[token_of_pair[chunk]].to(dtype) * keys[row_of_pair[chunk]].to(dtype)).sum(-1)
    return out


def pair_row_sums(source: torch.Tensor, weights: torch.Tensor, token_of_pair: torch.Tensor, row_of_pair: torch.Tensor,
                  sizes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`grad[r] = Σ_{p: row_of_pair[p] = r} weights[p] · source[token_of_pair[p]]`, shaped and typed like `table`: the
    gradient of `embedding_bag` wrt its table (aten's kernel, deterministic; no `(P, C)` tensor)."""
    return torch.ops.aten._embedding_bag_dense_backward(
        source.to(table.dtype), row_of_pair, token_of_pair, sizes, sizes.new_empty(0), table.shape[0], False, 0,
        weights.to(table.dtype),  # scale_grad_by_freq=False, mode 0: sum
    )


def pair_softmax(x, keys, token_of_pair, row_of_pair, chunk_size) -> torch.Tensor:
    """`softmax(K_t x_t / √C)` over each token's own rows, `(P,)`, in at least float32 (float64 for a float64
    model). The √C keeps unit-variance scores for RMS-normed x and N(0, 1) keys (see `LargeLookupLayer`)."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, keys.dtype), torch.float32)
    scores = pair_scores(x, keys, token_of_pair, row_of_pair, dtype, chunk_size) * x.shape[-1] ** -0.5
    segment_max = scores.new_full((x.shape[0],), -math.inf).scatter_reduce(0, token_of_pair, scores, reduce="amax")
    exp_scores = torch.exp(scores - segment_max[token_of_pair])  # (P,)
    normaliser = scores.new_zeros(x.shape[0]).index_add(0, token_of_pair, exp_scores)  # (N,)
    return exp_scores / normaliser[token_of_pair]


@torch.library.custom_op(f"{NAMESPACE}::l3_lookup", mutates_args=())
def lookup_pairs(
    x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor,
    pair_offsets: torch.Tensor, num_pairs: torch.Tensor, chunk_size: int,
) -> torch.Tensor:
    """`V_tᵀ softmax(K_t x_t / √C)` for every token, `(N, C)` in `x`'s dtype; see `pair_lookup`."""
    token_of_pair, row_of_pair = expand_pairs(starts, sizes, pair_offsets, num_pairs)
    probs = pair_softmax(x, keys, token_of_pair, row_of_pair, chunk_size)
    looked_up = F.embedding_bag(row_of_pair, values, pair_offsets, mode="sum", per_sample_weights=probs.to(values.dtype))
    return looked_up.to(x.dtype)


@lookup_pairs.register_fake
def _(x, keys, values, starts, sizes, pair_offsets, num_pairs, chunk_size):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::l3_lookup_backward", mutates_args=())
def lookup_pairs_backward(
    grad_out: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
    sizes: torch.Tensor, pair_offsets: torch.Tensor, num_pairs: torch.Tensor, chunk_size: int,
    needs_grads: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients wrt `(x, keys, values)` of `lookup_pairs` (empty where `needs_grads` says no). With π the
    probabilities (recomputed) and g the output gradient: dπ_p = ⟨g_t, V_r⟩; dV_r += π_p g_t; softmax backward
    ds_p = π_p (dπ_p − Σ_{p' of t} π_p' dπ_p') / √C; dx_t = Σ_p ds_p K_r; dK_r += ds_p x_t."""
    needs_x, needs_keys, needs_values = needs_grads
    token_of_pair, row_of_pair = expand_pairs(starts, sizes, pair_offsets, num_pairs)
    probs = pair_softmax(x, keys, token_of_pair, row_of_pair, chunk_size)
    grad_looked_up = grad_out.to(values.dtype)  # the output was cast from the values' dtype
    grad_probs = torch.ops.aten._embedding_bag_per_sample_weights_backward(  # ⟨g_t, V_r⟩ per pair, fused
        grad_looked_up, values, row_of_pair, pair_offsets, token_of_pair, 0  # mode 0: sum
    ).to(probs.dtype)
    expected = probs.new_zeros(x.shape[0]).index_add(0, token_of_pair, probs * grad_probs)  # (N,)
    grad_scores = probs * (grad_probs - expected[token_of_pair]) * x.shape[-1] ** -0.5  # (P,)
    grad_x, grad_keys, grad_values = x.new_empty(0), keys.new_empty(0), values.new_empty(0)
    if needs_x:
        grad_x = F.embedding_bag(
            row_of_pair, keys, pair_offsets, mode="sum", per_sample_weights=grad_scores.to(keys.dtype)
        ).to(x.dtype)
    if needs_keys:
        grad_keys = pair_row_sums(x, grad_scores, token_of_pair, row_of_pair, sizes, keys)
    if needs_values:
        grad_values = pair_row_sums(grad_looked_up, probs, token_of_pair, row_of_pair, sizes, values)
    return grad_x, grad_keys, grad_values


@lookup_pairs_backward.register_fake
def _(grad_out, x, keys, values, starts, sizes, pair_offsets, num_pairs, chunk_size, needs_grads):
    return tuple(torch.empty_like(tensor) if needed else tensor.new_empty(0)
                 for tensor, needed in zip((x, keys, values), needs_grads))


def _setup_lookup_context(ctx, inputs, output):
    *tensors, chunk_size = inputs
    ctx.save_for_backward(*tensors)
    ctx.chunk_size = chunk_size


def _lookup_backward(ctx, grad_out):
    needs_grads = list(ctx.needs_input_grad[:3])
    grads = lookup_pairs_backward(grad_out.contiguous(), *ctx.saved_tensors, ctx.chunk_size, needs_grads)
    return *(grad if needed else None for grad, needed in zip(grads, needs_grads)), None, None, None, None, None


lookup_pairs.register_autograd(_lookup_backward, setup_context=_setup_lookup_context)


def default_chunk_size(x: torch.Tensor) -> int:
    """Pairs gathered at a time for the scores: 65,536 on CUDA (few launches), 8 MiB of float32 rows per operand
    elsewhere (4,096 pairs at C = 512: 4.8× faster than 65,536 on the CPU box, whose large temporaries are fresh
    pages each time; the scores are the same whatever the chunk)."""
    return 1 << 16 if x.device.type == "cuda" else max(1, (8 << 20) // (4 * x.shape[-1]))


def pair_lookup(x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, routing: L3Routing,
                starts: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """`V_tᵀ softmax(K_t x_t / √C)` for every token t: softmax over the token's own rows only.

    Args:
        x: normed hidden states `(N, C)`.
        keys, values: tables `(rows, C)` (the same tensor when tied; gradients then add up).
        routing: `l3_routing` of the N tokens.
        starts: `(N,)` first row of each token in `keys`/`values`, instead of `routing.starts` (offloaded tables
            fetched row by row).
        chunk_size: pairs gathered at a time for the scores; default `default_chunk_size(x)`.

    Returns:
        `(N, C)` in `x`'s dtype; scores and softmax in at least float32.
    """
    starts = routing.starts if starts is None else starts
    chunk_size = default_chunk_size(x) if chunk_size is None else chunk_size
    if routing.num_pairs_copied is not None:  # the host waits here, the layers before this one queued on the device
        routing.num_pairs_copied.synchronize()
    return lookup_pairs(x, keys, values, starts, routing.sizes, routing.pair_offsets, routing.num_pairs, chunk_size)


class LargeLookupLayer(GradientCheckpointingLayer):
    """Large Lookup Layer (arXiv 2601.21461, §3.1), added to the residual stream after a decoder layer:

        h ← h + W_mix [ Norm(W_up(V_tᵀ softmax(K_t x / √C))) ; x ],   x = Norm(h)  (h itself in W_mix's input when
        `config.l3_mix_input == "residual"`)

    where token t (static routing by id) owns the rows `bounds[t]:bounds[t+1]` of the key table K and value
    table V (the same table when `l3_tie_kv`). Softmax runs over the token's own rows only.

    Score scale: keys are N(0, 1) and scores are divided by √C (C = hidden_size) so that, with x RMS-normed,
    scores start with unit variance as in dot-product attention. nanochat's PR #559 used no scaling (scores of
    std √C: a near one-hot softmax whose gradient reaches one row per token); scaling the init by C^-½ as well
    makes the softmax near-uniform. Unit-variance logits keep both the choice and the gradient spread.

    `W_mix` (`mix_proj`) is zero-initialised, so a fresh layer is an exact no-op.

    Memory: the lookup works on (token, row) pairs, so activations grow with the routed tokens' actual table sizes
    (P = Σ d_t scalars for scores and probabilities), never with `k_max`; no `(N, k_max, C)` tensor is built.
    """

    pair_chunk_size = None  # `default_chunk_size`

    def __init__(self, config: L3GPTConfig):
        super().__init__()
        table = lambda: with_init(nn.Embedding(config.l3_n_emb, config.hidden_size), "normal", 1.0)  # noqa: E731
        self.key_table = table()
        self.value_table = None if config.l3_tie_kv else table()
        up_proj = nn.Linear(config.hidden_size, config.l3_d_up, bias=False)
        self.up_proj = with_init(up_proj, "uniform", uniform_bound(config))
        mix_proj = nn.Linear(config.l3_d_up + config.hidden_size, config.hidden_size, bias=False)
        self.mix_proj = with_init(mix_proj, "zeros")
        self.norm = L3GPTRMSNorm(config.rms_norm_eps)
        self.mix_residual = config.l3_mix_input == "residual"

    def lookup(self, x: torch.Tensor, routing: L3Routing) -> torch.Tensor:
        """`V_tᵀ softmax(K_t x / √C)` for normed hidden states `x` of shape `(N, C)`; returns `(N, C)`
        (`pair_lookup`: a custom op that `torch.compile` keeps in the graph).

        Raises:
            RuntimeError: for offloaded tables that would need gradients, or that the forward did not fetch.
        """
        value_table = self.key_table if self.value_table is None else self.value_table
        keys, values, starts = self.key_table.weight, value_table.weight, routing.starts
        if isinstance(self.key_table, HostTable):  # offloaded: the copies of the rows this forward fetched
            keys, values, starts = fetched_tables(routing.prefetch, self.key_table, value_table)
        return pair_lookup(x, keys, values, routing, starts, self.pair_chunk_size)

    def forward(self, hidden_states: torch.Tensor, routing: L3Routing) -> torch.Tensor:
        """`hidden_states` `(batch_size, seq_len, hidden_size)` → same shape, with the layer's output added."""
        x = self.norm(hidden_states).reshape(-1, hidden_states.size(-1))  # (N, C)
        looked_up = self.norm(self.up_proj(self.lookup(x, routing)))  # (N, d_up)
        mixed_input = hidden_states.reshape(-1, hidden_states.size(-1)) if self.mix_residual else x  # (N, C)
        mixed = self.mix_proj(torch.cat([looked_up, mixed_input], dim=-1))  # (N, C)
        return hidden_states + mixed.view_as(hidden_states)


class L3TablesMixin:
    """`L3GPTModel`'s L3 allocation and its tables indexed by token id: the uniform allocation a model starts with,
    `set_l3_allocation`, rows per token, the routing of a forward (and the prefetch of offloaded rows), and the
    resizing that `resize_token_embeddings` asks for."""

    def uniform_bounds(self) -> torch.LongTensor:
        """CSR bounds `(vocab_size + 1,)` of the uniform allocation (all zeros-width when there is no L3 layer)."""
        config = self.config
        if not config.l3_after_layers:
            return torch.zeros(config.vocab_size + 1, dtype=torch.long)
        return bounds_from_counts(uniform_allocation(config.vocab_size, config.l3_n_emb, config.l3_k_max))

    def set_l3_allocation(self, counts: torch.Tensor) -> None:
        """Install per-token row counts `(vocab_size,)` (e.g. from `allocation.lzw_allocation`) for all L3 layers.

        Raises:
            ValueError: if the shape, the sum (`l3_n_emb`) or a count outside `[1, l3_k_max]` is wrong.
        """
        config = self.config
        counts = torch.as_tensor(counts, dtype=torch.long)
        if counts.shape != (config.vocab_size,):
            raise ValueError(f"allocation has shape {tuple(counts.shape)}, expected ({config.vocab_size},)")
        if int(counts.sum()) != config.l3_n_emb:
            raise ValueError(f"allocation sums to {int(counts.sum())}, expected l3_n_emb={config.l3_n_emb}")
        if int(counts.min()) < 1 or int(counts.max()) > config.l3_k_max:
            raise ValueError(
                f"allocation counts span [{int(counts.min())}, {int(counts.max())}], expected [1, {config.l3_k_max}]"
            )
        self.l3_bounds.copy_(bounds_from_counts(counts).to(self.l3_bounds.device))

    @torch.no_grad()
    def resize_token_tables(self, old_vocab_size: int, mean_resizing: bool = True) -> None:
        """Resize the tables indexed by token id beside `embed_tokens` (value embeddings, L3 allocation and tables)
        from `old_vocab_size` tokens to `config.vocab_size`; called by `resize_token_embeddings`, which has resized
        `embed_tokens` and set the config. Updates `config.l3_n_emb` when there are L3 layers."""
        vocab_size = self.config.vocab_size
        for table in self.value_embeddings.values():
            self.resized_table(table, vocab_size, mean_resizing)
        counts = self.l3_counts()  # (old_vocab_size,)
        if vocab_size < old_vocab_size:
            counts = counts[:vocab_size]
        else:  # without L3 layers every token owns zero rows
            counts = torch.cat([counts, counts.new_full((vocab_size - old_vocab_size,), int(bool(self.l3_layers)))])
        self.l3_bounds = bounds_from_counts(counts)
        if not self.l3_layers:
            return
        self.config.l3_n_emb = int(self.l3_bounds[-1])
        for layer in self.l3_layers.values():
            for table in (layer.key_table, layer.value_table):
                if table is not None:
                    self.resized_table(table, self.config.l3_n_emb, mean_resizing)

    def l3_counts(self) -> torch.LongTensor:
        """Rows owned by each token, `(vocab_size,)`."""
        return self.l3_bounds[1:] - self.l3_bounds[:-1]

    def route_l3(self, input_ids: torch.LongTensor) -> L3Routing:
        """`l3_routing` of `input_ids` for every L3 layer; with offloaded tables (`offload_l3_tables`) it also starts
        fetching the routed rows to `input_ids`' device (on CUDA asynchronously, on a side stream)."""
        routing, tables = l3_routing(input_ids, self.l3_bounds), host_tables(self.l3_layers)
        if not tables:
            return routing
        return routing._replace(prefetch=prefetch_routed_rows(input_ids, self.l3_bounds, routing, tables))


class TokenTablesResizeMixin:
    """`L3GPTPreTrainedModel`'s `resize_token_embeddings`, extended to every table indexed by token id."""

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """transformers' `resize_token_embeddings` (input embedding, output head, `config.vocab_size`) extended to every
        table indexed by token id: value-embedding tables get rows for the new tokens; the L3 allocation gives each
        new token one row (the fewest any token owns: there is no frequency data for it), appended to the L3 tables,
        and `config.l3_n_emb` follows (removed tokens give theirs back). Old tokens keep their rows and outputs. New
        rows follow `mean_resizing` as transformers': the old rows' mean and covariance, or else the table's init.

        Returns:
            The input embedding (`nn.Embedding`), as transformers'.

        Raises:
            RuntimeError: if the L3 tables are offloaded (`offload_l3_tables`): resize before offloading.
        """
        base, old_vocab_size = self.base_model, self.config.vocab_size
        if host_tables(base.l3_layers):
            raise RuntimeError("resize_token_embeddings: the L3 tables are offloaded to CPU memory (offload_l3_tables"
                               " / l3_offload); resize the model before offloading its tables")
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        if self.config.vocab_size != old_vocab_size:
            if not mean_resizing:
                for module in (self.get_input_embeddings(), self.get_output_embeddings()):
                    if module is not None and module.weight.shape[0] > old_vocab_size:
                        initialize(module.weight[old_vocab_size:], module.hfl3_init)
            base.resize_token_tables(old_vocab_size, mean_resizing)
        return embeddings

    def resized_table(self, table: nn.Embedding, num_rows: int, mean_resizing: bool) -> None:
        """Resize `table` in place to `num_rows` rows with transformers' `_get_resized_embeddings` (ZeRO-3 aware);
        added rows as described in `resize_token_embeddings`."""
        old_rows, requires_grad = table.num_embeddings, table.weight.requires_grad
        self._get_resized_embeddings(table, num_rows, mean_resizing=mean_resizing)
        table.weight.requires_grad_(requires_grad)
        if not mean_resizing and num_rows > old_rows:
            initialize(table.weight[old_rows:], table.hfl3_init)
