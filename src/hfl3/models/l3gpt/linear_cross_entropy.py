"""Linear + logit softcap + cross-entropy without materialising the `(rows, vocab)` float32 logits.

`linear_cross_entropy` runs Liger-Kernel's fused kernel (`liger_fused_linear_cross_entropy`, softcap included) on
CUDA when `liger_kernel` is importable — always outside `torch.compile` graphs (`liger_linear_cross_entropy`) — and
`chunked_linear_cross_entropy` elsewhere: rows in chunks, each chunk's
logits computed, turned into the gradients wrt the hidden states and the weight, and freed, so the extra memory is
one chunk's `(chunk_size, vocab)` float32 plus the weight gradient — Liger's scheme (gradients computed in the
forward pass), in PyTorch. The chunked function is a `torch.library` custom op (its backward scales the gradients it
computed), so `torch.compile` keeps a training forward with the loss in one graph. `causal_lm_loss` is transformers'
`ForCausalLMLoss` on top of it.

Self-contained (ships with the L3GPT remote code): optional packages (liger_kernel, deepspeed) are imported through
`importlib` when present. The op's namespace is named after this module, so two copies of the folder in one process
(hfl3's and Hub remote code) do not collide.
"""

import contextlib
import importlib
import importlib.util
import re

import torch
import torch.nn.functional as F

CHUNK_BYTES = 32 * 2**20
"""Default budget for one chunk's float32 logits: `chunk_size = CHUNK_BYTES // (4 * vocab_size)` rows (256 rows at
vocab 32768, 55 at Qwen3's 151,936)."""

NAMESPACE = "_".join(["l3gpt", *re.findall(r"[A-Za-z0-9]+", __name__)])
LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the logits matmul runs in: autocast's when autocast is on (as `nn.Linear` would), else the inputs'."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return torch.promote_types(hidden.dtype, weight.dtype)


@torch.library.custom_op(f"{NAMESPACE}::chunked_linear_cross_entropy", mutates_args=())
def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None, ignore_index: int,
    chunk_size: int, dtype: torch.dtype, needs_grads: list[bool], return_predictions: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sum_i CE(softcap(hidden_i @ weightᵀ), targets_i)` over the rows whose target is not `ignore_index`.

    Per chunk of rows: logits `(chunk, vocab)` in `dtype` (the compute dtype), then float32; softcap `c·tanh(z/c)`;
    log-sum-exp; and, for the inputs `needs_grads` names, `softmax − onehot` times the softcap's derivative
    `1 − tanh²`, multiplied into the gradients wrt `hidden` (in its dtype) and `weight` (accumulated in float32).

    Returns:
        `(nll_sum, grad_hidden, grad_weight, predictions)`: float32 scalar, the gradients of `nll_sum` (empty where
        not needed), the `(rows,)` argmax tokens after the softcap (empty unless `return_predictions`).
    """
    needs_hidden_grad, needs_weight_grad = needs_grads
    rows = hidden.shape[0]
    valid = targets != ignore_index  # (N,)
    safe_targets = targets.masked_fill(~valid, 0)  # (N,)
    nll_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if needs_hidden_grad else hidden.new_empty(0)
    grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if needs_weight_grad else weight.new_empty(0)
    predictions = targets.new_empty(rows if return_predictions else 0)
    with torch.autocast(hidden.device.type, enabled=False):
        weight_c = weight.to(dtype)
        for start in range(0, rows, chunk_size):
            end = min(start + chunk_size, rows)
            hidden_c = hidden[start:end].to(dtype)  # (c, C)
            target_c, valid_c = safe_targets[start:end, None], valid[start:end, None]
            logits = (hidden_c @ weight_c.t()).float()  # (c, V)
            tanh = None
            if softcap is not None:
                tanh = logits.div_(softcap).tanh_()
                logits = tanh * softcap
            if return_predictions:
                predictions[start:end] = logits.argmax(dim=-1)
            log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # (c, 1)
            nll = log_norm - logits.gather(1, target_c)  # (c, 1)
            nll_sum += torch.where(valid_c, nll, 0.0).sum()
            if not (needs_hidden_grad or needs_weight_grad):
                continue
            grad_logits = logits.sub_(log_norm).exp_()  # softmax, in place: (c, V)
            grad_logits.scatter_add_(1, target_c, torch.full_like(nll, -1.0)).mul_(valid_c)
            if tanh is not None:
                grad_logits.mul_(tanh.square_().neg_().add_(1.0))
            if needs_hidden_grad:
                grad_hidden[start:end] = grad_logits.to(dtype) @ weight_c
            if needs_weight_grad:
                grad_weight.addmm_(grad_logits.t(), hidden_c.float())
    return nll_sum, grad_hidden, grad_weight, predictions


@chunked_linear_cross_entropy.register_fake
def _(hidden, weight, targets, softcap, ignore_index, chunk_size, dtype, needs_grads, return_predictions):
    return (
        hidden.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden) if needs_grads[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape, dtype=torch.float32) if needs_grads[1] else weight.new_empty(0),
        targets.new_empty(hidden.shape[0] if return_predictions else 0),
    )


def _setup_chunked_context(ctx, inputs, output):
    _, grad_hidden, grad_weight, predictions = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.weight_dtype = inputs[1].dtype
    ctx.mark_non_differentiable(grad_hidden, grad_weight, predictions)


def _chunked_backward(ctx, grad_nll_sum, *unused):
    grad_hidden, grad_weight = ctx.saved_tensors
    hidden_grad = grad_hidden * grad_nll_sum.to(grad_hidden.dtype) if ctx.needs_input_grad[0] else None
    weight_grad = (grad_weight * grad_nll_sum).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
    return hidden_grad, weight_grad, None, None, None, None, None, None, None


chunked_linear_cross_entropy.register_autograd(_chunked_backward, setup_context=_setup_chunked_context)


def register_zero3_owner(owner: torch.nn.Module, weight: torch.Tensor) -> None:
    """Under DeepSpeed ZeRO-3, register `weight` (the output embedding, read here without calling `lm_head`) as an
    external parameter of `owner`, the module whose forward runs the loss (DeepSpeed's `register_external_parameter`):
    from owner's next forward on, ZeRO-3 gathers the weight for owner's whole forward, waiting for a prefetch in
    flight. Call it in every forward, evaluation included: a gather of our own while ZeRO prefetches the weight (it
    does after an evaluation called `lm_head`) fails with "Cannot partition a param in flight". A no-op otherwise."""
    if getattr(weight, "ds_id", None) is not None:
        zero = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
        zero.register_external_parameter(owner, weight)


def gathered_weight(weight: torch.Tensor):
    """Context in which a DeepSpeed ZeRO-3 partitioned `weight` is whole (`GatheredParameters`) when ZeRO-3 has not
    gathered it already (the first forward after `register_zero3_owner`); a null context for any other tensor. The
    weight gradient is computed inside the forward pass, so the backward needs no gather."""
    if getattr(weight, "ds_id", None) is None:
        return contextlib.nullcontext()
    zero = importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    if weight.ds_status == zero.ZeroParamStatus.AVAILABLE:
        return contextlib.nullcontext()
    return zero.GatheredParameters([weight])


def liger_applies(hidden: torch.Tensor) -> bool:
    """Whether `linear_cross_entropy`'s `backend="auto"` picks Liger's kernel: a CUDA tensor and `liger_kernel`
    installed."""
    return hidden.device.type == "cuda" and LIGER_INSTALLED


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.LongTensor,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    return_predictions: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.LongTensor | None]:
    """Summed cross-entropy of `softcap(hidden @ weightᵀ)` over the rows whose target is not `ignore_index`.

    Args:
        hidden (`torch.Tensor` of shape `(rows, hidden_size)`): final hidden states.
        weight (`torch.Tensor` of shape `(vocab_size, hidden_size)`): the output embedding (lm_head) weight; a
            ZeRO-3 partitioned one is gathered for the call if ZeRO has not (`gathered_weight`; see
            `register_zero3_owner`), outside `torch.compile` graphs.
        targets (`torch.LongTensor` of shape `(rows,)`): next-token ids.
        softcap (`float`, *optional*): logits become `softcap * tanh(logits / softcap)` in float32 (Gemma 2,
            nanochat); None for none.
        chunk_size (`int`, *optional*): rows per chunk of the PyTorch function; default
            `CHUNK_BYTES // (4 * vocab_size)`.
        return_predictions: also return each row's argmax token (after the softcap).
        backend: `"chunked"` (`chunked_linear_cross_entropy`, a custom op that `torch.compile` keeps in the graph),
            `"liger"` (Liger's `liger_fused_linear_cross_entropy` with `reduction="sum"` and its `softcap`; CUDA;
            run eagerly inside compiled models, see `liger_linear_cross_entropy`) or `"auto"`: Liger when
            `liger_applies(hidden)` and no predictions are asked for, else chunked.

    Returns:
        `(nll_sum, predictions)`: float32 scalar (nats; differentiable wrt `hidden` and `weight`) and `(rows,)` token
        ids, or None without `return_predictions`.
    """
    if backend == "auto":
        backend = "liger" if liger_applies(hidden) and not return_predictions else "chunked"
    arguments = (hidden, weight, targets, softcap, ignore_index, chunk_size, return_predictions, backend)
    if getattr(weight, "ds_id", None) is not None:
        return zero3_linear_cross_entropy(*arguments)
    return whole_weight_cross_entropy(*arguments)


def whole_weight_cross_entropy(hidden, weight, targets, softcap, ignore_index, chunk_size, return_predictions,
                               backend):
    """`linear_cross_entropy` once the backend is chosen and `weight` is whole."""
    if backend == "liger":
        return liger_linear_cross_entropy(hidden, weight, targets, softcap, ignore_index), None
    if chunk_size is None:
        chunk_size = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    grad_on = torch.is_grad_enabled()
    needs_grads = [grad_on and hidden.requires_grad, grad_on and weight.requires_grad]
    nll_sum, _, _, predictions = chunked_linear_cross_entropy(
        hidden, weight, targets, softcap, ignore_index, chunk_size, compute_dtype(hidden, weight), needs_grads,
        return_predictions,
    )
    return nll_sum, predictions if return_predictions else None


@torch.compiler.disable
def liger_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               softcap: float | None, ignore_index: int) -> torch.Tensor:
    """Liger's `liger_fused_linear_cross_entropy` (`reduction="sum"`) in the compute dtype: the float32 summed NLL.

    Never traced by `torch.compile` (a graph break; Liger's Triton kernels gain nothing from Inductor): dynamo traced
    into `LigerFusedLinearCrossEntropyFunction.forward`, failed to wrap its kernel and compiled the chunk slicing around
    it, and the first compiled hfl3 step on an H100 died with "an illegal memory access" (torch 2.11, Triton 3.6,
    liger-kernel 0.8.5; dev/LOG.md 2026-11-26). Upstream reports the same crash (github.com/linkedin/Liger-Kernel/issues/916)
    and a silently wrong loss under `torch.compile` whenever a target is `ignore_index` (Liger-Kernel pull 1338).
    """
    functional = importlib.import_module("liger_kernel.transformers.functional")
    dtype = compute_dtype(hidden, weight)
    result = functional.liger_fused_linear_cross_entropy(
        hidden.to(dtype), weight.to(dtype), targets, ignore_index=ignore_index, reduction="sum", softcap=softcap,
    )
    return getattr(result, "loss", result).float()  # newer Liger may return a CrossEntropyOutput


@torch.compiler.disable
def zero3_linear_cross_entropy(*arguments):
    """`linear_cross_entropy` of a DeepSpeed ZeRO-3 partitioned weight, whole for the call (`gathered_weight`);
    outside `torch.compile` graphs, which cannot trace DeepSpeed's gather."""
    with gathered_weight(arguments[1]):
        return whole_weight_cross_entropy(*arguments)


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.LongTensor | None,
    softcap: float | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.LongTensor | None = None,
    backend: str = "auto",
    **kwargs,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss` of the logits `softcap(hidden_states @ weightᵀ)`, without building them.

    `labels` `(batch_size, seq_len)` are unshifted (position t is scored on `labels[t + 1]`; or pass pre-shifted
    `shift_labels`); `ignore_index` targets add nothing. The result is the summed NLL divided by
    `num_items_in_batch` when given (exact gradient accumulation), else by the number of non-ignored targets (NaN
    when there is none, as `ForCausalLMLoss`). `hidden_states` `(batch_size, seq_len, hidden_size)`; `backend` as
    `linear_cross_entropy`'s; other `kwargs` are ignored, as in transformers.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.size(-1))  # (B·T, C)
    targets = shift_labels.reshape(-1).to(hidden.device)  # (B·T,)
    nll_sum = linear_cross_entropy(hidden, weight, targets, softcap, ignore_index, backend=backend)[0]
    if num_items_in_batch is None:
        return nll_sum / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(nll_sum.device)
    return nll_sum / num_items_in_batch
