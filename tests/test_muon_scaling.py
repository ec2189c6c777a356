"""MuonEq (row/column equilibration) and Muon+ (renormalisation), nanochat 4e014d3, as MuonAdamW group options:
each against a float64 reference of its formula, and a whole MuonAdamW step with them against the formulas."""

import math

import pytest
import torch
from torch import nn

from hfl3.optim import MuonAdamW, normuon_rescale, orthogonalize
from hfl3.optim.muon import MUON_DEFAULTS
from hfl3.optim.muon_scaling import equilibrate, renormalize

SHAPES = [(12, 40), (40, 12), (24, 24)]


def skewed(shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    """A matrix (or stack) whose rows and columns have very different scales, as momentum matrices do."""
    generator = torch.Generator().manual_seed(seed)
    rows, cols = shape[-2:]
    scales = torch.logspace(-2, 1, rows, dtype=torch.float64)[:, None] * torch.logspace(0, 1, cols, dtype=torch.float64)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * scales).to(dtype)


def test_defaults_are_nanochats():
    assert MUON_DEFAULTS["muon_eq"] == "row" and MUON_DEFAULTS["muon_plus"] is True


@pytest.mark.parametrize("shape", SHAPES + [(3, 12, 40)])
@pytest.mark.parametrize("mode", ["row", "column"])
def test_equilibrate_matches_the_formula(shape, mode):
    x = skewed(shape, seed=0)
    ours = equilibrate(x.float(), mode)
    # nanochat 4e014d3 (rows): X_i ← X_i · (‖X‖_F / √rows) / ‖X_i‖; columns the same with √cols
    axis, count = (-1, shape[-2]) if mode == "row" else (-2, shape[-1])
    target = torch.linalg.matrix_norm(x, keepdim=True) / math.sqrt(count)
    expected = x * target / torch.linalg.vector_norm(x, dim=axis, keepdim=True)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-7)
    norms = torch.linalg.vector_norm(ours.double(), dim=axis)
    torch.testing.assert_close(norms, norms[..., :1].expand_as(norms), rtol=1e-5, atol=0)  # all equal
    torch.testing.assert_close(torch.linalg.matrix_norm(ours.double()), torch.linalg.matrix_norm(x), rtol=1e-5, atol=0)
    assert ours.dtype == torch.float32
    with pytest.raises(ValueError, match="mode"):
        equilibrate(x, "rows")


@pytest.mark.parametrize("shape", SHAPES + [(3, 40, 12)])
def test_renormalize_matches_the_formula(shape):
    update = orthogonalize(skewed(shape, seed=1).float(), dtype=torch.float32)
    ours = renormalize(update)
    expected = update.double() * math.sqrt(min(shape[-2:])) / torch.linalg.matrix_norm(update.double(), keepdim=True)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.linalg.matrix_norm(ours.double()),
                               torch.full(shape[:-2], math.sqrt(min(shape[-2:])), dtype=torch.float64))  # fmt: skip
    assert not torch.allclose(ours, update, atol=1e-4)  # the polar iteration had not reached norm √min exactly


def reference_step(weight, grad, momentum_buffer, second_moment, *, lr, momentum, beta2, muon_eq, muon_plus):
    """One Muon step from the formulas (module docstring of hfl3.optim.muon), float64, no weight decay."""
    momentum_buffer = momentum_buffer.lerp(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum)  # Nesterov
    if muon_eq == "row":
        update = update * (update.norm() / math.sqrt(update.size(0))) / update.norm(dim=1, keepdim=True)
    elif muon_eq == "column":
        update = update * (update.norm() / math.sqrt(update.size(1))) / update.norm(dim=0, keepdim=True)
    update = orthogonalize(update, dtype=torch.float64)  # checked against the SVD polar factor in test_muon.py
    if muon_plus:
        update = update * math.sqrt(min(update.shape)) / update.norm()
    if beta2 is not None:
        update = normuon_rescale(update, second_moment, beta2).double()
    rows, cols = weight.shape
    return weight - lr * math.sqrt(max(1.0, rows / cols)) * update, momentum_buffer


CASES = [  # (name, muon_eq, muon_plus, beta2)
    ("defaults", "row", True, 0.95),
    ("column_eq", "column", False, 0.95),
    ("plus_only", None, True, None),
    ("neither", None, False, None),
]


@pytest.mark.parametrize("name, muon_eq, muon_plus, beta2", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_muon_step_with_the_options_matches_the_formulas(name, muon_eq, muon_plus, beta2, shape):
    weight = skewed(shape, seed=2)
    params = [nn.Parameter(weight.clone()), nn.Parameter(weight.clone() * 0.5)]  # a stack of two
    group = dict(params=params, kind="muon", lr=0.05, momentum=0.9, momentum_warmup_steps=0, beta2=beta2,
                 muon_eq=muon_eq, muon_plus=muon_plus, orthogonalize_dtype="float64")  # fmt: skip
    if name == "defaults":
        group = {key: value for key, value in group.items() if key not in ("muon_eq", "muon_plus")}
    optimizer = MuonAdamW([group])
    expected = [p.detach().clone() for p in params]
    buffers = [torch.zeros_like(p) for p in expected]
    moments = [torch.zeros((shape[0], 1) if shape[0] >= shape[1] else (1, shape[1]), dtype=torch.float32)
               for _ in params]  # fmt: skip
    for step in range(3):
        grads = [skewed(shape, seed=10 + 2 * step + i) for i in range(2)]
        for param, grad in zip(params, grads):
            param.grad = grad
        optimizer.step()
        for i, grad in enumerate(grads):
            expected[i], buffers[i] = reference_step(
                expected[i], grad, buffers[i], moments[i], lr=0.05, momentum=0.9, beta2=beta2, muon_eq=muon_eq,
                muon_plus=muon_plus,
            )  # fmt: skip
    for param, reference in zip(params, expected):
        torch.testing.assert_close(param.detach(), reference, rtol=1e-6, atol=1e-9)


def test_each_option_changes_the_step():
    """The guard: with skewed gradients, MuonEq and Muon+ each move the weights, so the equalities above could fail."""
    results = {}
    for muon_eq, muon_plus in (("row", True), (None, True), ("row", False), ("column", True)):
        param = nn.Parameter(skewed((16, 48), seed=3))
        optimizer = MuonAdamW([dict(params=[param], kind="muon", muon_eq=muon_eq, muon_plus=muon_plus,
                                    orthogonalize_dtype="float64")])  # fmt: skip
        param.grad = skewed((16, 48), seed=4)
        optimizer.step()
        results[(muon_eq, muon_plus)] = param.detach()
    values = list(results.values())
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            assert (values[i] - values[j]).abs().max() > 1e-4


def test_unknown_muon_eq_is_refused_at_construction():
    with pytest.raises(ValueError, match="muon_eq"):
        MuonAdamW([dict(params=[nn.Parameter(torch.zeros(4, 4))], kind="muon", muon_eq="both")])
