"""MuonAdamW under DDP (2 gloo processes on CPU) equals the single-process run on the same global batch.

What is compared is what is deterministic up to float round-off, not weights after several Adam steps (Adam's first
steps are ~sign(g): a gradient that nearly cancels over the batch turns reduction-order round-off into ±lr):
- at every step, the gradients after DDP's all-reduce: bit for bit the mean of the two ranks' own gradients, and equal
  to the single-process gradient of the global batch within a tolerance derived from float32 (`gradient_tolerance`,
  tests/distributed/equivalence.py: float32 eps, the reduction length and the values' magnitude);
- the optimizer steps, fed the identical (all-reduced) gradients on both sides: the same code path on the same
  numbers, so the weights after the last step are bit for bit the ranks' weights. Three steps, so that the
  step-count dependent schedules (Muon momentum warm-up, weight-decay decay) run too.
"""

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.optim import MuonAdamW, param_groups_by_kind

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
from equivalence import gradient_tolerance, spawn_gloo_ranks  # noqa: E402

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH, SEQ_LEN = 8, 24
PER_RANK = GLOBAL_BATCH // WORLD_SIZE


def _model() -> L3GPTForCausalLM:
    """Depth 3: the backout scalar subtracts the stream after layer 1 from the last layer's output. At depth 2 it
    would subtract a multiple of that output itself, which the final RMSNorm cancels: its gradient would be pure
    round-off (measured 0.18·|g| apart between DDP and one process) and no tolerance could be derived for it."""
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        3, vocab_size=256, aspect_ratio=32, head_dim=64, max_position_embeddings=32, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=512, l3_k_max=8, l3_d_up=64, l3_tie_kv=True,
    )  # fmt: skip
    model = L3GPTForCausalLM(config)
    with torch.no_grad():  # zero-initialised output projections would leave the scalars round-off gradients only
        for param in model.parameters():
            if param.ndim == 2 and not param.any():
                param.normal_(0.0, 0.02)
        if model.model.smear is not None:  # zero-initialised too: the smear gate would get no gradient
            model.model.smear.smear_lambda.fill_(0.5)
    return model


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS)]


def _rows(rank: int) -> slice:
    return slice(rank * PER_RANK, (rank + 1) * PER_RANK)


def _optimizer(model) -> MuonAdamW:
    """Momentum warm-up and weight-decay decay within the 3 steps, so that the step count matters."""
    groups = param_groups_by_kind(model)
    for group in groups:
        if group["kind"] == "muon":
            group.update(weight_decay=0.2, momentum_warmup_steps=2)
    return MuonAdamW(groups, num_training_steps=STEPS)


@contextlib.contextmanager
def one_thread():
    """The ranks' thread count (torchrun's too): the same kernels on the same numbers give the same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _gradients(model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model(input_ids=input_ids, labels=input_ids).loss.backward()  # equal-length rows: the mean of means is the mean
    gradients = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    return gradients


def _worker(rank: int, result_path: str) -> None:
    model = _model()
    ddp, optimizer = DistributedDataParallel(model), _optimizer(model)
    gradients = []
    for input_ids in _batches():
        local = input_ids[_rows(rank)]
        ddp(input_ids=local, labels=local).loss.backward()
        gradients.append({name: param.grad.clone() for name, param in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    torch.save({"gradients": gradients, "weights": weights}, f"{result_path}.rank{rank}")


@pytest.mark.distributed
def test_ddp_equals_single_process_on_the_global_batch(tmp_path):
    result_path = tmp_path / "ddp"
    spawn_gloo_ranks(_worker, WORLD_SIZE, tmp_path / "store", str(result_path))
    ranks = [torch.load(f"{result_path}.rank{rank}", weights_only=True) for rank in range(WORLD_SIZE)]

    with one_thread():
        single = _model()
        optimizer = _optimizer(single)
        hidden_size = single.config.hidden_size
        tolerance_guards = {}
        for step, input_ids in enumerate(_batches()):
            global_batch = _gradients(single, input_ids)
            own = [_gradients(single, input_ids[_rows(rank)]) for rank in range(WORLD_SIZE)]
            all_reduced = ranks[0]["gradients"][step]
            for name, expected in global_batch.items():
                where = f"step {step + 1} {name}"
                assert torch.equal(ranks[1]["gradients"][step][name], all_reduced[name]), f"{where}: ranks differ"
                # DDP divides by the world size and sums: a/2 + b/2 is exact and commutative for 2 ranks
                assert torch.equal(all_reduced[name], (own[0][name] + own[1][name]) / 2), f"{where}: not the mean"
                # guard: the ranks' own gradients differ, so a rank that skipped the all-reduce fails the line above
                assert not torch.equal(own[0][name], own[1][name]), f"{where}: the ranks' gradients are equal"
                tolerance = gradient_tolerance(expected, GLOBAL_BATCH * SEQ_LEN, hidden_size)
                difference = (all_reduced[name] - expected).abs().max().item()
                assert difference <= tolerance, f"{where}: DDP differs by {difference:.3g} > {tolerance:.3g}"
                without_all_reduce = (own[0][name] - expected).abs().max().item() / tolerance
                tolerance_guards[name] = max(tolerance_guards.get(name, 0.0), without_all_reduce)
            for name, param in single.named_parameters():  # the optimizer fed exactly DDP's gradients
                param.grad = all_reduced[name].clone()
            optimizer.step()
            optimizer.zero_grad()

    for name, param in single.named_parameters():
        for rank in range(WORLD_SIZE):
            assert torch.equal(ranks[rank]["weights"][name], param.detach()), f"{name}: rank {rank} differs"
    # guard for the tolerance: a rank's own gradient lands far outside it for every tensor whose elements sum over
    # token positions. A 1-D scalar's gradient sums all B·T·hidden products, so both halves of a random batch give
    # nearly the same value (smear_lambda: 1.2× the bound); the exact mean check above tells those apart.
    shapes = {name: param.shape for name, param in single.named_parameters()}
    matrices = {name: ratio for name, ratio in tolerance_guards.items() if len(shapes[name]) > 1}
    assert min(matrices.values()) > 100, f"the tolerance cannot tell a missing all-reduce: {matrices}"
