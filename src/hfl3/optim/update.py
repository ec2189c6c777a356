"""Muon's update as functions of tensors (the formulas of `hfl3.optim.muon`'s docstring): Polar Express
orthogonalisation, NorMuon, the momentum and weight-decay steps and the schedules. `MuonAdamW` runs them on stacks of
whole matrices (`muon_update`); the sharded step (`hfl3.optim.sharded`) runs the element-wise parts on each rank's
shard and `muon_direction` on whole matrices gathered on an owner rank. Both take a group's constants as one
`MuonSettings` (`hfl3.optim.settings`, where each default and its source is declared)."""

import math
from collections.abc import Sequence

import torch

from .muon_scaling import equilibrate, renormalize
from .settings import POLAR_EXPRESS_COEFFICIENTS, POLAR_EXPRESS_NORM_SAFETY, MuonSettings


def orthogonalize(
    matrix: torch.Tensor,
    coefficients: Sequence[tuple[float, float, float]] = POLAR_EXPRESS_COEFFICIENTS,
    *,
    norm_safety: float = POLAR_EXPRESS_NORM_SAFETY,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximate the polar factor `U Vᵀ` of `matrix = U S Vᵀ` by odd quintic Newton–Schulz steps.

    Each step `i` applies `X <- a_i X + (b_i A + c_i A²) X` with `A = X Xᵀ`, on the wide orientation
    (a tall input is transposed first, so the Gram matrix is the small one). With the Polar Express
    coefficients the singular values of the result land near 1 (in [0.85, 1.15] for inputs whose
    singular values all exceed 1e-3 of the Frobenius norm); with Keller Jordan's fixed
    (3.4445, -4.7750, 2.0315) repeated five times this is exactly `torch.optim.Muon`'s iteration.
    A stack of matrices is orthogonalised matrix by matrix with batched matmuls (`bmm`/`baddbmm`,
    `3 · len(coefficients)` calls whatever `k`); a single matrix with `mm`/`addmm`.

    Args:
        matrix (`torch.Tensor` of shape `(rows, cols)` or `(k, rows, cols)`): the update(s), any float dtype.
        coefficients: one `(a, b, c)` per step; the number of steps is `len(coefficients)`.
        norm_safety: each matrix is divided by `norm_safety · ‖matrix‖_F` (clamped below by `eps`).
        dtype: dtype of the iteration; bf16 is what the coefficients were designed for.

    Returns:
        `torch.Tensor` of the input's shape, in `dtype`.

    Raises:
        ValueError: if `matrix` is neither 2-D nor 3-D.
    """
    if matrix.ndim not in (2, 3):
        raise ValueError(
            f"orthogonalize: expected a 2-D matrix or a 3-D stack of matrices, got shape {tuple(matrix.shape)}"
        )
    x = matrix.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)
    if norm_safety != 1.0:
        norm = norm * norm_safety
    x = x / norm.clamp(min=eps)
    # addmm rather than b·A + c·A@A: one rounding in bf16, and the same kernels as torch.optim.Muon
    multiply_add = torch.addmm if x.ndim == 2 else torch.baddbmm
    for a, b, c in coefficients:
        gram = x @ x.mT  # (k, rows, rows) with rows <= cols
        x = multiply_add(x, multiply_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def normuon_rescale(
    update: torch.Tensor, second_moment: torch.Tensor, beta2: float | torch.Tensor
) -> torch.Tensor:
    """NorMuon variance reduction (arXiv 2510.05491, as in nanochat/optim.py): per-neuron adaptive scale.

    Keeps an EMA of the mean squared update per row (when `rows >= cols`) or per column, divides the
    update by its square root, then rescales so that each matrix's Frobenius norm is unchanged.

    Args:
        update (`torch.Tensor` of shape `(rows, cols)` or `(k, rows, cols)`): the orthogonalised update(s).
        second_moment (`torch.Tensor` of shape `([k,] rows, 1)` or `([k,] 1, cols)`, fp32): EMA, updated in place.
        beta2: EMA decay of `second_moment`.

    Returns:
        `torch.Tensor` of the update's shape, fp32.
    """
    update = update.float()
    reduce_dim = -1 if update.size(-2) >= update.size(-1) else -2
    second_moment.lerp_(update.square().mean(dim=reduce_dim, keepdim=True), 1 - beta2)
    scaled = update * second_moment.clamp_min(1e-10).rsqrt()
    frobenius = (-2, -1)
    return scaled * (
        update.norm(dim=frobenius, keepdim=True) / scaled.norm(dim=frobenius, keepdim=True).clamp_min(1e-10)
    )


def muon_update(
    params: torch.Tensor,
    grads: torch.Tensor,
    momentum_buffer: torch.Tensor,
    second_moment: torch.Tensor | None,
    *,
    momentum: float | torch.Tensor,
    lr: float | torch.Tensor,
    weight_decay: float | torch.Tensor,
    settings: MuonSettings,
) -> None:
    """One Muon step of `k` same-shape matrices, in place (the formulas of the module docstring).

    The three parts are also public for the sharded step (`hfl3.optim.sharded`), which runs the element-wise ones on
    each rank's shard and only `muon_direction` on whole matrices: `momentum_update_`, `muon_direction`,
    `decay_weights_` + the shape-scaled step.

    The scheduled values `momentum`, `lr`, `weight_decay` are Python floats (eager: `add_`'s `alpha` then gives
    the same bits as `torch.optim.Muon`) or 0-D float32 CPU tensors (under `torch.compile`: a new value is not a
    recompile). `settings` is a constant of the graph.

    Args:
        params (`torch.Tensor` of shape `(k, rows, cols)`): the weights, updated in place.
        grads (`torch.Tensor` of shape `(k, rows, cols)`): their gradients (not modified).
        momentum_buffer (`torch.Tensor` of shape `(k, rows, cols)`): updated in place.
        second_moment (`torch.Tensor` of shape `(k, rows, 1)` or `(k, 1, cols)`, fp32, or None): NorMuon's EMA,
            updated in place; None (or `settings.beta2` None) turns NorMuon off.
        momentum, lr, weight_decay: this step's values (`weight_decay` already scaled by its schedule).
        settings: the group's `nesterov`, `cautious_weight_decay` and what `muon_direction` reads.
    """
    update = momentum_update_(grads, momentum_buffer, momentum, settings.nesterov)
    update = muon_direction(update, second_moment, settings)
    decay_weights_(params, update, lr, weight_decay, settings.cautious_weight_decay)
    rows, cols = params.shape[-2:]
    _add_scaled_(params, update, -lr * shape_lr_scale(rows, cols))


def momentum_update_(
    grads: torch.Tensor, momentum_buffer: torch.Tensor, momentum: float | torch.Tensor, nesterov: bool
) -> torch.Tensor:
    """`momentum_buffer <- momentum·B + (1 - momentum)·G` in place; returns the Nesterov blend (or the buffer).

    Element-wise: any shape, the same bits for a matrix, a stack or a shard of either.
    """
    if isinstance(momentum, torch.Tensor):  # lerp takes its weight in the tensors' dtype (nanochat casts it too)
        momentum = momentum.to(grads.dtype)
    momentum_buffer.lerp_(grads, 1 - momentum)
    return grads.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def muon_direction(update: torch.Tensor, second_moment: torch.Tensor | None, settings: MuonSettings) -> torch.Tensor:
    """MuonEq (when `settings.muon_eq`), Polar Express (`settings.ns_coefficients`, `ns_norm_safety`, `eps`, in
    `settings.orthogonalize_dtype_on(update.device)`), Muon+ (when `settings.muon_plus`) on each whole matrix, then
    NorMuon (when `second_moment` and `settings.beta2` are given).

    Args:
        update (`torch.Tensor` of shape `(k, rows, cols)` or `(rows, cols)`): the momentum (Nesterov) update.
        second_moment (`torch.Tensor` of shape `([k,] rows, 1)` or `([k,] 1, cols)`, fp32, or None): updated in place.
        settings: the group's `MuonSettings`.

    Returns:
        `torch.Tensor` of the update's shape: fp32 with NorMuon, else in the orthogonalisation dtype.
    """
    if settings.muon_eq is not None:
        update = equilibrate(update, settings.muon_eq)
    direction = orthogonalize(update, settings.ns_coefficients, norm_safety=settings.ns_norm_safety,
                              eps=settings.eps, dtype=settings.orthogonalize_dtype_on(update.device))
    if settings.muon_plus:
        direction = renormalize(direction)
    if second_moment is not None and settings.beta2 is not None:
        direction = normuon_rescale(direction, second_moment, settings.beta2)
    return direction


def decay_weights_(
    params: torch.Tensor,
    direction: torch.Tensor,
    lr: float | torch.Tensor,
    weight_decay: float | torch.Tensor,
    cautious: bool,
) -> None:
    """Weight decay in place, element-wise: cautious (only where `direction` and the weight agree in sign,
    arXiv 2510.12402) or plain `W <- (1 - lr·wd)·W`."""
    if cautious:
        _add_scaled_(params, params * (direction * params >= 0), -lr * weight_decay)
    else:
        params.mul_(1 - lr * weight_decay)


def shape_lr_scale(rows: int, cols: int) -> float:
    """Keller Jordan's shape-aware LR factor `sqrt(max(1, rows / cols))` for a `(rows, cols)` weight."""
    return math.sqrt(max(1.0, rows / cols))


def _add_scaled_(target: torch.Tensor, other: torch.Tensor, alpha: float | torch.Tensor) -> None:
    """`target += alpha · other`: a float through `add_`'s alpha (one rounding), a 0-D tensor through a product."""
    if isinstance(alpha, torch.Tensor):
        target.add_(other.to(torch.promote_types(other.dtype, target.dtype)) * alpha)
    else:
        target.add_(other, alpha=alpha)


def muon_momentum(step: int, momentum: float, warmup_start: float, warmup_steps: int) -> float:
    """Muon momentum at 0-based optimizer step `step`: linear `warmup_start -> momentum` over `warmup_steps`.

    The rule of nanochat base_train's `get_muon_momentum` (its master also warms the momentum down at the end); the
    defaults, 0.85 -> 0.95 over 300 steps, are `MuonSettings`'.
    """
    fraction = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - fraction) * warmup_start + fraction * momentum


def weight_decay_factor(step: int, num_training_steps: int | None) -> float:
    """Multiplier of the weight decay at 0-based step `step`: `1 - step / num_training_steps` (nanochat), 1 if None."""
    if num_training_steps is None:
        return 1.0
    return max(0.0, 1.0 - step / num_training_steps)
