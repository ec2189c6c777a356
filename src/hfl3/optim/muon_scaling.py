"""MuonEq and Muon+: rescalings of Muon's update before and after its orthogonalisation (nanochat 4e014d3, where
both are always on: "very slight improvements at both d12 and d24"). `update.muon_direction` applies them on
`(k, rows, cols)` stacks when a group's `muon_eq` / `muon_plus` say so."""

import math

import torch

MUON_EQ_MODES = ("row", "column")


def equilibrate(matrix: torch.Tensor, mode: str) -> torch.Tensor:
    """MuonEq equilibration (Chang et al., arXiv 2603.28254; nanochat 4e014d3 uses the row form, its default).

    `"row"`: every row of each matrix is rescaled to the mean row norm, `X_i ← X_i · (‖X‖_F / √rows) / ‖X_i‖`;
    `"column"`: the same for columns with `√cols`. Either keeps `‖X‖_F` and evens out the scales that Polar Express
    then sees (better conditioned input). Norms are taken in at least float32, the row/column norm clamped at 1e-6
    (nanochat's constants). Rows are output features of an `nn.Linear` weight `(out_features, in_features)`.

    Args:
        matrix (`torch.Tensor` of shape `(rows, cols)` or `(k, rows, cols)`): the momentum update(s).
        mode: `"row"` or `"column"`.

    Returns:
        `torch.Tensor` of the input's shape and dtype.

    Raises:
        ValueError: for another `mode`.
    """
    if mode not in MUON_EQ_MODES:
        raise ValueError(f"equilibrate: mode={mode!r}; expected one of {MUON_EQ_MODES}")
    x = matrix.to(torch.promote_types(matrix.dtype, torch.float32))
    reduce_dim, count = (-1, x.size(-2)) if mode == "row" else (-2, x.size(-1))
    target = x.norm(dim=(-2, -1), keepdim=True) / math.sqrt(count)
    return matrix * (target / x.norm(dim=reduce_dim, keepdim=True).clamp_min(1e-6)).to(matrix.dtype)


def renormalize(update: torch.Tensor) -> torch.Tensor:
    """Muon+ (arXiv 2602.21545, nanochat 4e014d3): scale each matrix to `‖O‖_F = sqrt(min(rows, cols))`, the norm of an
    exactly semi-orthogonal matrix, correcting the polar iteration's under-convergence. The result is in at least
    float32; the norm is clamped at 1e-6 (nanochat). `update`: `(rows, cols)` or `(k, rows, cols)`."""
    update = update.to(torch.promote_types(update.dtype, torch.float32))
    target = math.sqrt(min(update.shape[-2:]))
    return update * (target / update.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6))
