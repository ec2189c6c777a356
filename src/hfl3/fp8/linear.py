"""FP8 training for `nn.Linear`: dynamic tensorwise or rowwise scaling, e4m3 operands forward, e5m2 gradients.

`convert_to_float8_training(model, recipe=...)` turns the eligible `nn.Linear` layers of a model into
[`Float8Linear`] in place and returns the model (as torchao's function of that name does); `float8_disabled(model)`
switches them back to the plain high-precision matmul for evaluation and sampling. A `Float8Linear` *is* an `nn.Linear`
with the same `weight` / `bias` parameters, so its `state_dict` keys and values are those of the plain layer: a
checkpoint of a converted model loads into a model that was never converted.

Each of the three matmuls of a linear layer is quantised (``M`` tokens, ``K = in_features``, ``N = out_features``):

- output      ``y = x · Wᵀ``   x (M, K) and W (N, K) in e4m3,
- grad input  ``dx = g · W``   g (M, N) in e5m2, W in e4m3,
- grad weight ``dW = gᵀ · x``  g in e5m2, x in e4m3.

Scales are dynamic (recomputed from each tensor at every call, no history): ``scale = 2^ceil(log2(amax / fmt_max))``
with ``amax`` clamped to at least `AMAX_EPS`, and ``data = clamp(t / scale, ±fmt_max)`` cast to the format, so
``t ≈ data · scale``. Tensorwise: one amax per tensor. Rowwise: one amax per row *along the contraction dimension*
of the matmul the operand feeds, so an operand used by two matmuls (x, W, g) is quantised once per matmul.
Scales are powers of two (as torchao's rowwise recipe does): dequantisation is exact, so the emulated path below
and `torch._scaled_mm` see the same operand values.

Where the matmuls run:
- `torch._scaled_mm` (FP8 tensor cores) on CUDA devices of compute capability ≥ 8.9 (Ada, Hopper and later);
  the rowwise kernel accepts e5m2 only as its first operand, which is why g is always the left operand here.
- Elsewhere (CPU, older GPUs, ROCm) the matmuls are *emulated*: the quantised operands are dequantised
  (``data · scale``, exact) into the compute dtype and multiplied with an ordinary matmul in that dtype. The numerics
  are those of FP8 operands with a high-precision accumulator; there is no speed gain. torch 2.13's CPU
  build also has a `_scaled_mm`; `Float8Linear.use_scaled_mm = True` forces it (the tests use that to check both
  paths agree), but it is not the default off CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Largest finite values of the two formats (E4M3 max 448 = 1.75 · 2^8, E5M2 max 57344 = 1.75 · 2^15): Micikevicius
# et al., "FP8 Formats for Deep Learning", arXiv:2209.05433, Table 1, adopted as the OCP 8-bit Floating Point
# Specification (OFP8) rev. 1.0 (2023). torch.finfo gives the same numbers (checked by the tests).
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Lower bound on amax so an all-zero tensor gets a finite scale (torchao.float8.float8_utils.EPS).
AMAX_EPS = 1e-12
RECIPES = ("tensorwise", "rowwise")
# torch._scaled_mm needs K and N of each matmul divisible by 16 (cuBLASLt FP8 requirement, ATen ScaledBlas.cpp).
DIM_MULTIPLE = 16
# Below this size the casts cost more than the FP8 matmul saves (nanochat's FP8 layer filter uses the same bound).
MIN_DIM = 128
# transformers' names for the projections that read a decoder layer's input (Llama, Qwen3, L3GPT).
ATTENTION_INPUT_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r} is not one of {RECIPES}")


def quantize(tensor: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantisation with a power-of-two scale.

    Args:
        tensor: any floating tensor.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        dim: `None` for one scale per tensor; otherwise the dimension the amax is taken over (kept, size 1).

    Returns:
        `(data, scale)`: `data` has `tensor`'s shape in `dtype`; `scale` is float32, 0-dim (tensorwise) or of
        `tensor`'s shape with `dim` reduced to 1 (rowwise); `tensor ≈ data.float() * scale`.
    """
    fmt_max = FORMAT_MAX[dtype]
    magnitude = tensor.detach().abs()
    amax = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.float().clamp(min=AMAX_EPS) / fmt_max)))
    data = (tensor.detach().float() / scale).clamp(-fmt_max, fmt_max).to(dtype)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`data · scale` in `dtype` (exact for bfloat16/float32: FP8 values times a power of two)."""
    return (data.float() * scale).to(dtype)


def _pad_inner(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad the contraction dim of row-major `a` (M, K) and column-major `b` (K, N) to a multiple of 16
    (zeros add nothing), keeping both layouts."""
    pad = -a.shape[1] % DIM_MULTIPLE
    if not pad:
        return a, b
    # FP8 tensors have few kernels; pad their bytes (0x00 is +0.0 in both formats).
    a = F.pad(a.view(torch.uint8), (0, pad)).view(a.dtype)
    b = F.pad(b.t().view(torch.uint8), (0, pad)).view(b.dtype).t()
    return a, b


def scaled_matmul(
    a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
    out_dtype: torch.dtype, use_scaled_mm: bool, use_fast_accum: bool = False,
) -> torch.Tensor:
    """`(a_data · a_scale) @ (b_data · b_scale)` in `out_dtype`.

    Args:
        a_data: `(M, K)` FP8. a_scale: float32, 0-dim or `(M, 1)`.
        b_data: `(K, N)` FP8 (e4m3 when `a_data` is e5m2). b_scale: float32, 0-dim or `(1, N)`.
        out_dtype: dtype of the `(M, N)` result.
        use_scaled_mm: `torch._scaled_mm` (a row-major, b column-major, K padded to a multiple of 16) instead of
            the emulation (dequantise, matmul in `out_dtype`).
        use_fast_accum: fast accumulation (forward only, as torchao does).
    """
    if not use_scaled_mm:
        return dequantize(a_data, a_scale, out_dtype) @ dequantize(b_data, b_scale, out_dtype)
    a_data, b_data = _pad_inner(a_data.contiguous(), b_data.t().contiguous().t())
    if a_scale.dim() == 0:
        return torch._scaled_mm(a_data, b_data, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum)
    if use_fast_accum:  # CUTLASS rowwise kernel; it writes bfloat16 only
        out = torch._scaled_mm(a_data, b_data, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
        return out.to(out_dtype)
    # The rowwise kernel is slow without fast accumulation: use the tensorwise one with unit scales and apply the
    # row/column scales to its float32 output (torchao.float8.float8_ops.addmm_float8_unwrapped does the same).
    one = a_scale.new_ones(())
    out = torch._scaled_mm(a_data, b_data, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (out * (a_scale * b_scale)).to(out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """`x (M, K) @ weight (N, K)ᵀ → (M, N)` with FP8 operands in forward and backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, rowwise: bool, use_scaled_mm: bool, out_dtype: torch.dtype):
        dim = -1 if rowwise else None
        x_data, x_scale = quantize(x, E4M3, dim)  # (M, K), () or (M, 1)
        w_data, w_scale = quantize(weight, E4M3, dim)  # (N, K), () or (N, 1)
        out = scaled_matmul(x_data, x_scale, w_data.t(), w_scale.t(), out_dtype, use_scaled_mm, use_fast_accum=True)
        if rowwise:  # backward re-quantises along the other axis
            ctx.save_for_backward(x, weight)
        else:  # keep the FP8 copies: a quarter of float32, half of bfloat16
            ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
        ctx.rowwise, ctx.use_scaled_mm = rowwise, use_scaled_mm
        ctx.x_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        needs_x, needs_weight = ctx.needs_input_grad[:2]
        compute_dtype, mm = grad_out.dtype, ctx.use_scaled_mm
        grad_x = grad_weight = None
        if ctx.rowwise:
            x, weight = ctx.saved_tensors
            if needs_x:
                g_data, g_scale = quantize(grad_out, E5M2, -1)  # (M, N), (M, 1)
                w_data, w_scale = quantize(weight, E4M3, 0)  # (N, K), (1, K)
                grad_x = scaled_matmul(g_data, g_scale, w_data, w_scale, compute_dtype, mm)  # (M, K)
            if needs_weight:
                gt_data, gt_scale = quantize(grad_out.t(), E5M2, -1)  # (N, M), (N, 1)
                x_data, x_scale = quantize(x, E4M3, 0)  # (M, K), (1, K)
                grad_weight = scaled_matmul(gt_data, gt_scale, x_data, x_scale, compute_dtype, mm)  # (N, K)
        else:
            x_data, x_scale, w_data, w_scale = ctx.saved_tensors
            g_data, g_scale = quantize(grad_out, E5M2, None)  # (M, N)
            if needs_x:
                grad_x = scaled_matmul(g_data, g_scale, w_data, w_scale, compute_dtype, mm)  # (M, K)
            if needs_weight:
                grad_weight = scaled_matmul(g_data.t(), g_scale, x_data, x_scale, compute_dtype, mm)  # (N, K)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_x, grad_weight, None, None, None


def _supports_scaled_mm(device: torch.device) -> bool:
    """CUDA (not ROCm, whose FP8 formats are the fnuz variants) with compute capability ≥ 8.9."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor) >= (8, 9)


class Float8Linear(nn.Linear):
    """An `nn.Linear` whose forward and backward matmuls run with FP8 operands (module docstring).

    Same parameters, `state_dict` and `__init__` arguments as `nn.Linear`, plus:

    Args:
        recipe: `"tensorwise"` (one scale per tensor) or `"rowwise"` (one scale per row of each matmul operand).

    Attributes:
        fp8_enabled (`bool`): `False` makes `forward` exactly `nn.Linear.forward` (see `float8_disabled`).
        use_scaled_mm (`bool | None`): `None` picks `torch._scaled_mm` on CUDA with compute capability ≥ 8.9 and
            the emulation elsewhere; `True` / `False` force one of them.

    Forward: `input (*, in_features)` → `(*, out_features)` in the autocast dtype when autocast is on, else in
    `input.dtype`; gradients come back in the dtypes of `input` and `weight`.

    Raises:
        ValueError: on an unknown recipe, or (at forward time, `torch._scaled_mm` path) dims not multiples of 16.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 recipe: str = "tensorwise"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._set_float8(recipe)

    def _set_float8(self, recipe: str) -> None:
        _check_recipe(recipe)
        self.recipe = recipe
        self.fp8_enabled = True
        self.use_scaled_mm = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "tensorwise") -> Float8Linear:
        """Turn a plain `nn.Linear` into a `Float8Linear` in place (same object, parameters, hooks and attributes).

        Raises:
            TypeError: if `linear` is not exactly `nn.Linear` (a subclass would lose its own forward).
            ValueError: on an unknown recipe.
        """
        _check_recipe(recipe)
        if type(linear) is not nn.Linear:
            raise TypeError(f"expected a plain nn.Linear, got {type(linear).__module__}.{type(linear).__name__}")
        linear.__class__ = cls
        linear._set_float8(recipe)
        return linear

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return super().forward(input)
        device_type = input.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        use_scaled_mm = _supports_scaled_mm(input.device) if self.use_scaled_mm is None else self.use_scaled_mm
        if use_scaled_mm and (self.in_features % DIM_MULTIPLE or self.out_features % DIM_MULTIPLE):
            raise ValueError(
                f"torch._scaled_mm needs in_features ({self.in_features}) and out_features ({self.out_features}) "
                f"divisible by {DIM_MULTIPLE}; convert_to_float8_training skips such layers"
            )
        out = _Float8Matmul.apply(
            input.reshape(-1, self.in_features), self.weight, self.recipe == "rowwise", use_scaled_mm, out_dtype
        )  # (M, out_features)
        out = out.reshape(*input.shape[:-1], self.out_features)  # (*, out_features)
        if self.bias is not None:
            out = out + self.bias.to(out_dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fp8_enabled={self.fp8_enabled}"


def first_and_last_projections(model: nn.Module) -> tuple[set[str], set[str]]:
    """Names of the projections kept in high precision for stability (docs/design.md, decision 8).

    - **last**: the output head, i.e. `model.get_output_embeddings()` when the model has that method and it
      returns an `nn.Linear` (a transformers `lm_head`); otherwise the last `nn.Linear` in `named_modules()` order.
    - **first**: the projections that read the embedding output. When the model has `nn.Linear`s named `q_proj`,
      `k_proj` or `v_proj`, these are the ones of the first module holding any (for an L3GPT, Llama or Qwen3:
      `model.layers.0.self_attn.{q,k,v}_proj`; `o_proj` and the MLP of layer 0 read attention outputs and are not
      "first"; L3GPT's smear gate, registered before the layers, reads the embedding too but is 24 → 1 and never
      converted); otherwise the first `nn.Linear` in `named_modules()` order alone (accelerate's
      `find_first_last_linear_layers` rule).

    Returns:
        `(first, last)`, two sets of module names (empty when the model has no `nn.Linear`).
    """
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linears:
        return set(), set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = [name for name, module in model.named_modules() if head is not None and module is head]
    last = {head_names[0]} if head_names and isinstance(head, nn.Linear) else {linears[-1]}
    attention_inputs = [name for name in linears if name.rpartition(".")[2] in ATTENTION_INPUT_PROJECTIONS]
    if attention_inputs:
        parent = attention_inputs[0].rpartition(".")[0]
        first = {name for name in attention_inputs if name.rpartition(".")[0] == parent}
    else:
        first = {linears[0]}
    return first, last


def select_float8_layers(
    model: nn.Module, module_filter: Callable[[nn.Linear, str], bool] | None = None
) -> tuple[list[str], dict[str, str]]:
    """Decide which `nn.Linear` layers of `model` get FP8 matmuls.

    Rules, in order (the first that applies decides):
    1. not exactly `nn.Linear` (a subclass, e.g. an existing `Float8Linear`): skipped;
    2. `in_features` or `out_features` not a multiple of 16: skipped (`torch._scaled_mm` cannot run it);
    3. with `module_filter`: converted iff `module_filter(module, name)` is true (it replaces rules 4–5);
    4. `min(in_features, out_features) < 128`: skipped (the casts cost more than the matmul saves);
    5. a first or last projection (`first_and_last_projections`): skipped;
    otherwise converted.

    Returns:
        `(names to convert in named_modules() order, {skipped name: reason})`.
    """
    first, last = first_and_last_projections(model)
    selected, skipped = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        dims = f"in_features={module.in_features}, out_features={module.out_features}"
        if type(module) is not nn.Linear:
            skipped[name] = f"{type(module).__name__} is not a plain nn.Linear"
        elif module.in_features % DIM_MULTIPLE or module.out_features % DIM_MULTIPLE:
            skipped[name] = f"{dims} not both multiples of {DIM_MULTIPLE}"
        elif module_filter is not None:
            if module_filter(module, name):
                selected.append(name)
            else:
                skipped[name] = "module_filter returned False"
        elif min(module.in_features, module.out_features) < MIN_DIM:
            skipped[name] = f"{dims}: smaller dim < {MIN_DIM}"
        elif name in first:
            skipped[name] = "first projection (reads the embedding output)"
        elif name in last:
            skipped[name] = "last projection (output head)"
        else:
            selected.append(name)
    return selected, skipped


def convert_to_float8_training(
    model: nn.Module, recipe: str = "tensorwise", module_filter: Callable[[nn.Linear, str], bool] | None = None
) -> nn.Module:
    """Turn the eligible `nn.Linear` layers of `model` into `Float8Linear` in place (rules: `select_float8_layers`).

    Call it after building (or loading) the model and before creating the optimizer, `torch.compile` or
    `accelerator.prepare`; parameters keep their identity, so an optimizer built earlier still works.

    Args:
        model: any `nn.Module` (for a transformers model the skip rules know its `lm_head` and first layer).
        recipe: `"tensorwise"` or `"rowwise"`.
        module_filter: optional `(module, name) -> bool`, replacing the size and first/last rules (the
            multiple-of-16 rule always applies).

    Returns:
        `model` itself, like `torchao.float8.convert_to_float8_training`. The converted layers, and the skipped ones
        with their reasons, are logged at INFO; a WARNING says when no layer was converted, or when this machine has
        no GPU with FP8 matmuls (the converted layers then emulate them).

    Raises:
        ValueError: on an unknown recipe, or if the model already has FP8 layers (hfl3's or torchao's: convert once,
            with one backend).
    """
    _check_recipe(recipe)
    existing = sorted({type(m).__module__ + "." + type(m).__name__ for m in model.modules() if _is_float8(m)})
    if existing:
        raise ValueError(
            f"model already has FP8 layers ({', '.join(existing)}); convert once, and use either hfl3's --fp8 or "
            "accelerate's AO backend (accelerate_configs/fp8_ao.yaml), not both"
        )
    selected, skipped = select_float8_layers(model, module_filter)
    for name in selected:
        Float8Linear.from_linear(model.get_submodule(name), recipe)
    logger.info("FP8 %s: converted %d nn.Linear layers (%s), skipped %d", recipe, len(selected), ", ".join(selected),
                len(skipped))
    for name, reason in skipped.items():
        logger.info("FP8 skip %s: %s", name, reason)
    if not selected:
        reasons = sorted({re.sub(r"in_features=\d+, out_features=\d+:? ?", "", reason) for reason in skipped.values()})
        logger.warning("FP8 %s converted no layer of this model, so it trains in high precision (skipped %d: %s); "
                       "FP8 needs matmuls with both dims multiples of %d and >= %d, other than the first and last "
                       "projections: use a larger model or drop --fp8", recipe, len(skipped), "; ".join(reasons),
                       DIM_MULTIPLE, MIN_DIM)
    elif not (torch.cuda.is_available() and _supports_scaled_mm(torch.device("cuda", torch.cuda.current_device()))):
        logger.warning("FP8 %s: no CUDA GPU with FP8 matmuls (compute capability >= 8.9) here, so the %d converted "
                       "layers emulate them (quantize, dequantize, high-precision matmul): the numerics of FP8, "
                       "slower than without --fp8", recipe, len(selected))
    return model


def _is_float8(module: nn.Module) -> bool:
    return isinstance(module, Float8Linear) or (
        type(module).__name__ == "Float8Linear" and type(module).__module__.startswith("torchao")
    )


@contextlib.contextmanager
def float8_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run hfl3's `Float8Linear` layers as plain `nn.Linear` (bf16 under bf16 autocast) inside the block.

    For evaluation and sampling: the outputs are exactly those of the unconverted model. The flags are restored on
    exit, also after an exception. Under `torch.compile` the flag is guarded, so the first eval compiles once more.
    torchao's layers (AO backend) are not affected.

    Yields:
        `model`.
    """
    layers = [module for module in model.modules() if isinstance(module, Float8Linear)]
    previous = [layer.fp8_enabled for layer in layers]
    for layer in layers:
        layer.fp8_enabled = False
    try:
        yield model
    finally:
        for layer, enabled in zip(layers, previous):
            layer.fp8_enabled = enabled
