"""MuonAdamW under DDP (2 gloo processes on CPU) equals the single-process run on the same global batch."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.optim import MuonAdamW, param_groups_by_kind

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8


def _model() -> L3GPTForCausalLM:
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        2, vocab_size=256, aspect_ratio=64, head_dim=64, max_position_embeddings=32, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=512, l3_k_max=8, l3_d_up=64, l3_tie_kv=True,
    )  # fmt: skip
    model = L3GPTForCausalLM(config)
    with torch.no_grad():  # the zero-initialised output projections leave the scalars with round-off gradients
        for param in model.parameters():  # (~1e-10) that Adam would blow up to ±lr: give every weight a real gradient
            if param.ndim == 2 and not param.any():
                param.normal_(0.0, 0.02)
        if model.model.smear is not None:  # zero-initialised too: the smear gate would get no gradient
            model.model.smear.smear_lambda.fill_(0.5)
    return model


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (GLOBAL_BATCH, 24), generator=generator) for _ in range(STEPS)]


def _optimizer(model) -> MuonAdamW:
    # momentum warm-up and weight-decay decay on, so the step count matters too. Cautious weight decay is off here:
    # its mask [update ⊙ W >= 0] is discontinuous, so a coordinate with update·W ≈ 0 flips with round-off and moves
    # by lr·wd·|W| (1.7e-5 = 85× the tolerance below, seen when the loss's summation order changed), which says
    # nothing about DDP. Plain decoupled decay keeps the step-count dependence.
    groups = param_groups_by_kind(model)
    for group in groups:
        if group["kind"] == "muon":
            group.update(weight_decay=0.2, momentum_warmup_steps=2, cautious_weight_decay=False)
    return MuonAdamW(groups, num_training_steps=STEPS)


def _train(model, module, rows: slice) -> None:
    optimizer = _optimizer(model)
    for input_ids in _batches():
        local = input_ids[rows]
        module(input_ids=local, labels=local).loss.backward()  # every row has the same token count: mean of means
        optimizer.step()
        optimizer.zero_grad()


def _worker(rank: int, store_path: str, result_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        model = _model()
        per_rank = GLOBAL_BATCH // WORLD_SIZE
        _train(model, DistributedDataParallel(model), slice(rank * per_rank, (rank + 1) * per_rank))
        if rank == 0:
            torch.save(model.state_dict(), result_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_equals_single_process_on_the_global_batch(tmp_path):
    result_path = tmp_path / "ddp.pt"
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(result_path)), nprocs=WORLD_SIZE, join=True)
    ddp_state = torch.load(result_path, weights_only=True)

    single = _model()
    _train(single, single, slice(0, GLOBAL_BATCH))
    first_half_only = _model()  # what a rank would compute without the gradient all-reduce
    _train(first_half_only, first_half_only, slice(0, GLOBAL_BATCH // WORLD_SIZE))

    # Tolerances in units of each group's LR: the same update up to round-off. Muon's orthogonalisation is smooth
    # (measured <= 1.6e-5·lr with MuonEq and Muon+ on); AdamW divides by sqrt(v), which magnifies the round-off of
    # elements whose gradient is near zero (measured <= 1.2e-3·lr on the L3 table). Skipping the all-reduce moves
    # weights by ~0.1-0.7·lr.
    groups = param_groups_by_kind(single)
    learning_rates = {id(p): (g["lr"], g["kind"]) for g in groups for p in g["params"]}
    param_group_names = {id(p): "muon" if g["kind"] == "muon" else g["name"] for g in groups for p in g["params"]}
    half_parameters = dict(first_half_only.named_parameters())
    for name, value in single.named_parameters():
        lr, kind = learning_rates[id(value)]
        # The scalars that gate the residual stream read by the final norm (smear, backout) get gradients that
        # nearly cancel over the batch; Adam's first steps, ~sign(g), magnify their round-off most (measured
        # 6.5e-3·lr on backout_lambda), while skipping the all-reduce moves them by ≥ 0.1·lr.
        tolerance = {"muon": 5e-5, "smear": 2e-2}.get(param_group_names[id(value)], 5e-3) * lr
        difference = (ddp_state[name] - value.detach()).abs().max().item()
        assert difference <= tolerance, f"{name}: DDP differs from single-process by {difference:.3g} > {tolerance:.3g}"
        assert (half_parameters[name] - value).abs().median() > max(1e-2 * lr, 5 * tolerance), f"{name}: cannot tell"
