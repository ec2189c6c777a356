"""MuonAdamW under FSDP2 and DeepSpeed ZeRO-3 with `zero.Init` equals DDP (2 gloo CPU processes, one spawn).

FSDP2 runs at the level of accelerate's own preparation (`fsdp2_prepare_model`, then
`fsdp2_switch_optimizer_parameters`, as `Accelerator.prepare` does): accelerate 1.15 turns FSDP on only for GPU-type
setups, so the recipe cannot launch it on a CPU machine. Its resumption goes through accelerate's FULL_STATE_DICT
`save_fsdp_model`/`save_fsdp_optimizer` and `load_fsdp_*` (what the Trainer calls for fsdp2.yaml). ZeRO-3 runs with
the model built under `deepspeed.zero.Init` (parameters partitioned before the optimizer sees them: DeepSpeed's own
Muon turned itself off there, #8438). ZeRO-2 and ZeRO-3 through the recipe and the Trainer: test_recipes_distributed.

Tolerances are test_muon_ddp's (units of each group's LR: Muon 1e-5, AdamW 5e-3). Guards: AdamW on the matrices
and Muon orthogonalising each rank's row block separately (what a per-shard Muon would do) both land far outside.
"""

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.optim import MuonAdamW, MuonSettings, param_groups_by_kind
from hfl3.optim.settings import MUON_DEFAULTS
from hfl3.optim.sharded import moment_shape
from hfl3.optim.update import muon_momentum, muon_update, weight_decay_factor

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH = 8
# The schedules on, so the step count matters. Cautious weight decay off: its mask [update ⊙ W >= 0] flips with the
# round-off of a different reduction order (ZeRO-3's), moving such a weight by lr·wd·|W| (4.7e-5 seen, 230× the
# tolerance), which says nothing about sharding; tests/test_muon_sharded.py covers the cautious mask on shards.
MUON_SETTINGS = dict(weight_decay=0.2, momentum_warmup_steps=2, cautious_weight_decay=False)
ZERO3 = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD_SIZE, "gradient_accumulation_steps": 1,
         "train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}


def _config() -> L3GPTConfig:
    return L3GPTConfig.from_depth(
        2, vocab_size=256, aspect_ratio=64, head_dim=64, max_position_embeddings=32, window_pattern="L",
        l3_after_layers=[0], l3_n_emb=512, l3_k_max=8, l3_d_up=64,
    )  # fmt: skip


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = L3GPTForCausalLM(_config())
    with torch.no_grad():  # zero-initialised output projections would leave round-off gradients (see test_muon_ddp)
        for param in model.parameters():
            if param.ndim == 2 and not param.any():
                param.normal_(0.0, 0.02)
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def _model() -> L3GPTForCausalLM:
    model = L3GPTForCausalLM(_config())
    model.load_state_dict(_weights(), strict=False)
    return model


def _groups(model, matrices: str = "muon") -> list[dict]:
    """MuonAdamW's groups, the matrices on Muon with the schedules on, or on AdamW (the guard's silent fallback)."""
    groups = param_groups_by_kind(model)
    for group in groups:
        if group["kind"] == "muon":
            if matrices == "muon":
                group.update(MUON_SETTINGS)
            else:
                group["kind"] = "adamw"
    return groups


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (GLOBAL_BATCH, 24), generator=generator) for _ in range(STEPS)]


def _train(forward, optimizer, rows: slice, steps=range(STEPS), step=None) -> None:
    for index in steps:
        input_ids = _batches()[index][rows]
        forward(input_ids=input_ids, labels=input_ids).loss.backward()  # equal-length rows: mean of the ranks' means
        step() if step else (optimizer.step(), optimizer.zero_grad())


def _fsdp2(accelerator):
    """A fresh model and optimizer through the steps of accelerate's `Accelerator._prepare_fsdp2`: the optimizer's
    parameters swapped for placeholders that remember their `data_ptr`, `fsdp2_prepare_model` (fully_shard), then
    `fsdp2_switch_optimizer_parameters` from the old pointers to the sharded parameters."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model, fsdp2_switch_optimizer_parameters

    model = _model()
    optimizer = MuonAdamW(_groups(model), num_training_steps=STEPS)
    before = {name: param.data_ptr() for name, param in model.named_parameters()}
    for group in optimizer.param_groups:
        for index, param in enumerate(group["params"]):
            group["params"][index] = torch.empty(1)
            group["params"][index].data_ptr = param.data_ptr()
    model = fsdp2_prepare_model(accelerator, model)
    fsdp2_switch_optimizer_parameters(optimizer, {before[name]: param for name, param in model.named_parameters()})
    return model, optimizer


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _worker(rank: int, store: str, checkpoint_dir: str, result_path: str) -> None:
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
                       "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
                       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"})  # accelerate_configs/fsdp2.yaml
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    PartialState()  # accelerate's logging in save_fsdp_model needs it; it adopts the process group
    rows = slice(rank * GLOBAL_BATCH // WORLD_SIZE, (rank + 1) * GLOBAL_BATCH // WORLD_SIZE)
    result = {}
    try:
        model = _model()
        optimizer = MuonAdamW(_groups(model), num_training_steps=STEPS)
        _train(DistributedDataParallel(model), optimizer, rows)
        result["ddp"] = {name: param.detach().clone() for name, param in model.named_parameters()}
        result["ddp_state_bytes"] = optimizer.muon_state_bytes()

        plugin = FullyShardedDataParallelPlugin()
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                      is_main_process=rank == 0, device=torch.device("cpu"), process_index=rank,
                                      num_processes=WORLD_SIZE, is_fsdp2=True, wait_for_everyone=dist.barrier)
        model, optimizer = _fsdp2(accelerator)
        _train(model, optimizer, rows, steps=range(STEPS - 1))
        save_fsdp_model(plugin, accelerator, model, checkpoint_dir)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint_dir)
        _train(model, optimizer, rows, steps=[STEPS - 1])
        result["fsdp2"] = _full_state(model)
        result["fsdp2_state_bytes"] = optimizer.muon_state_bytes()
        model, optimizer = _fsdp2(accelerator)
        load_fsdp_model(plugin, accelerator, model, checkpoint_dir)
        load_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint_dir)
        _train(model, optimizer, rows, steps=[STEPS - 1])
        result["fsdp2_resumed"] = _full_state(model)

        result.update(_zero3_with_zero_init(rows))
        if rank == 0:
            torch.save(result, result_path)
    finally:
        dist.destroy_process_group()


def _zero3_with_zero_init(rows: slice) -> dict:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        model = L3GPTForCausalLM(_config())
    weights = _weights()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    groups = _groups(model)
    names = {id(param): name for name, param in model.named_parameters()}
    group_names = {group["name"]: sorted(names[id(p)] for p in group["params"]) for group in groups}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=MuonAdamW(groups, num_training_steps=STEPS),
                                                   config=ZERO3)
    _train(engine, None, rows, step=engine.step)
    state = engine._zero3_consolidated_16bit_state_dict()  # collective; None on the other ranks
    return {"zero3_groups": group_names, "zero3": state, "zero3_state_bytes": optimizer.optimizer.muon_state_bytes()}


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("muon_sharded")
    mp.spawn(_worker, args=(str(folder / "store"), str(folder / "checkpoint"), str(folder / "rank0.pt")),
             nprocs=WORLD_SIZE, join=True)
    return torch.load(folder / "rank0.pt", weights_only=False)


def _per_shard_muon(model) -> None:
    """The guard's wrong Muon: each matrix's two row blocks (what each FSDP2 rank holds) orthogonalised as if they
    were matrices, the rest as MuonAdamW does."""
    groups = _groups(model)
    matrices = next(group for group in groups if group["kind"] == "muon")
    optimizer = MuonAdamW([group for group in groups if group["kind"] == "adamw"], num_training_steps=STEPS)
    group = {**MUON_DEFAULTS, **MUON_SETTINGS}
    settings = MuonSettings.from_group(group)
    buffers = {id(p): (torch.zeros(WORLD_SIZE, p.shape[0] // WORLD_SIZE, p.shape[1]),
                       torch.zeros(WORLD_SIZE, *moment_shape(p.shape[0] // WORLD_SIZE, p.shape[1])))
               for p in matrices["params"]}
    for step, input_ids in enumerate(_batches()):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        with torch.no_grad():
            for param in matrices["params"]:
                blocks = param.view(WORLD_SIZE, -1, param.shape[1])
                muon_update(
                    blocks, param.grad.view_as(blocks), *buffers[id(param)],
                    momentum=muon_momentum(step, settings.momentum, settings.momentum_warmup_start,
                                           settings.momentum_warmup_steps),
                    lr=group["lr"], weight_decay=group["weight_decay"] * weight_decay_factor(step, STEPS),
                    settings=settings,
                )  # fmt: skip
        optimizer.step()
        model.zero_grad()


def _learning_rates(model) -> dict[str, tuple[float, str]]:
    names = {id(param): name for name, param in model.named_parameters()}
    return {names[id(p)]: (group["lr"], group["kind"]) for group in param_groups_by_kind(model)
            for p in group["params"]}


def test_fsdp2_and_zero3_equal_ddp_and_guards_tell(sharded_runs):
    reference = _model()
    learning_rates = _learning_rates(reference)
    wrong = {}
    for name, run in (("adamw_on_matrices", lambda m: _train(m, MuonAdamW(_groups(m, "adamw")), slice(None))),
                      ("per_shard_muon", _per_shard_muon)):
        model = _model()
        run(model)
        wrong[name] = dict(model.named_parameters())
    ddp = sharded_runs["ddp"]
    for scheme in ("fsdp2", "zero3"):
        for name, (lr, kind) in learning_rates.items():
            # Muon: 1e-5·lr held before MuonEq/Muon+ came on (issue 17); with them, 1.02e-5·lr measured (ZeRO-3).
            # AdamW: near-zero gradients divided by sqrt(v) magnify ZeRO-3's reduction-order round-off, up to 6.2e-3·lr
            # on the L3 key table since the issue-17 core (1.2e-3·lr before); it varies from run to run.
            tolerance = (5e-5 if kind == "muon" else 2e-2) * lr
            difference = (sharded_runs[scheme][name].float() - ddp[name]).abs().max().item()
            assert difference <= tolerance, f"{scheme} {name}: differs from DDP by {difference:.3g} > {tolerance:.3g}"
    for guard, weights in wrong.items():
        for name, (lr, kind) in learning_rates.items():
            if kind == "muon":  # the matrices: the wrong update moves them by about the LR itself
                assert (weights[name] - ddp[name]).abs().median() > 20 * 5e-5 * lr, f"{guard}: {name} cannot tell"


def test_fsdp2_resume_is_bit_identical(sharded_runs):
    uninterrupted, resumed = sharded_runs["fsdp2"], sharded_runs["fsdp2_resumed"]
    assert uninterrupted.keys() == resumed.keys()
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name


def test_zero_init_groups_like_a_plain_model_and_state_is_sharded(sharded_runs):
    """Under zero.Init each parameter is an empty partition with `ds_shape`: grouping by that shape keeps the matrices
    on Muon. Each rank holds about half of DDP's Muon state."""
    reference = _model()
    names = {id(param): name for name, param in reference.named_parameters()}
    expected = {group["name"]: sorted(names[id(p)] for p in group["params"])
                for group in param_groups_by_kind(reference)}
    assert sharded_runs["zero3_groups"] == expected
    for scheme in ("fsdp2", "zero3"):
        share = sharded_runs[f"{scheme}_state_bytes"] / sharded_runs["ddp_state_bytes"]
        assert 0.45 <= share <= 0.55, f"{scheme}: rank 0 holds {share:.3f} of DDP's Muon state"


# ---------------------------------------------------------------------------------------------------------------------
# Three ranks and uneven shards: the exchange plan itself, on layouts built by hand

UNEVEN_SHAPES = [(7, 5), (5, 9), (7, 5), (3, 4), (2, 6)]  # tall and wide, rows not divisible by 3, two of one shape
UNEVEN_STEPS = 3


def _uneven_gradients(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=generator) for shape in UNEVEN_SHAPES]


def _uneven_start() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return [torch.randn(shape, generator=generator) for shape in UNEVEN_SHAPES]


def _flat_layouts(world_size: int) -> dict[str, tuple[list, list, int]]:
    """(pieces, moment pieces, local length) of a ZeRO-1/2-style layout (the matrices end to end with 3 padding
    elements between them, cut into equal ranges) and a ZeRO-3-style one (each matrix cut into ceil(numel/W))."""
    from hfl3.optim.sharded import Piece, split_range

    numel = [rows * cols for rows, cols in UNEVEN_SHAPES]
    moments = [math.prod(moment_shape(*shape)) for shape in UNEVEN_SHAPES]
    moment_size = -(-sum(moments) // world_size)
    moment_pieces = [split_range(sum(moments[:i]), n, [r * moment_size for r in range(world_size + 1)])
                     for i, n in enumerate(moments)]
    starts = [sum(numel[:i]) + 3 * i for i in range(len(numel))]
    size = -(-(starts[-1] + numel[-1]) // world_size)
    zero12 = [split_range(start, n, [r * size for r in range(world_size + 1)]) for start, n in zip(starts, numel)]
    zero3, offset = [], 0
    for n in numel:
        part = -(-n // world_size)
        zero3.append([Piece(p.rank, offset + p.local_offset, p.offset, p.length)
                      for p in split_range(0, n, [r * part for r in range(world_size + 1)])])
        offset += part
    return {"zero12": (zero12, moment_pieces, size), "zero3": (zero3, moment_pieces, offset)}


def _scatter(local: torch.Tensor, pieces: list, tensors: list[torch.Tensor], rank: int) -> None:
    """Copy this rank's pieces of the whole `tensors` into its local flat buffer."""
    for found, tensor in zip(pieces, tensors):
        for piece in found:
            if piece.rank == rank:
                local.narrow(0, piece.local_offset, piece.length).copy_(tensor.flatten().narrow(0, piece.offset,
                                                                                                piece.length))


def _uneven_worker(rank: int, world_size: int, store: str, result_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hfl3.optim.sharded import ShardedMuon
    from hfl3.optim.update import muon_momentum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = {}
        mesh = init_device_mesh("cpu", (world_size,))
        shards = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in _uneven_start()]
        optimizer = MuonAdamW([{"params": shards, "kind": "muon", **MUON_SETTINGS}], num_training_steps=UNEVEN_STEPS)
        for step in range(UNEVEN_STEPS):
            for shard, grad in zip(shards, _uneven_gradients(step)):
                shard.grad = distribute_tensor(grad, mesh, [Shard(0)])
            optimizer.step()
        result["fsdp2"] = [shard.full_tensor() for shard in shards]
        group = {**MUON_DEFAULTS, **MUON_SETTINGS}
        settings = MuonSettings.from_group(group)
        for name, (pieces, moment_pieces, size) in _flat_layouts(world_size).items():
            plan = ShardedMuon(UNEVEN_SHAPES, pieces, moment_pieces, dist.group.WORLD, size)
            local = [torch.zeros(size) for _ in range(3)] + [torch.zeros(plan.local_moment_numel)]
            params, grads, momentum, moment = local
            _scatter(params, pieces, _uneven_start(), rank)
            for step in range(UNEVEN_STEPS):
                _scatter(grads, pieces, _uneven_gradients(step), rank)
                plan.step(params, grads, momentum, moment,
                          momentum=muon_momentum(step, settings.momentum, settings.momentum_warmup_start,
                                                 settings.momentum_warmup_steps),
                          lr=group["lr"], weight_decay=group["weight_decay"] * (1 - step / UNEVEN_STEPS),
                          settings=settings)
            gathered = [None] * world_size
            dist.all_gather_object(gathered, params)
            result[name] = [torch.cat([gathered[p.rank].narrow(0, p.local_offset, p.length) for p in found]).view(shape)
                            for found, shape in zip(pieces, UNEVEN_SHAPES)]
        if rank == 0:
            torch.save(result, result_path)
    finally:
        dist.destroy_process_group()


def test_three_ranks_with_uneven_shards_equal_whole_matrices(tmp_path):
    """FSDP2 DTensors with torch.chunk's uneven row blocks (a 3x4 matrix: one row each; 2x6: nothing on rank 2), and
    hand-built ZeRO-1/2 and ZeRO-3 layouts with padding and cuts inside matrices, over 3 ranks: the sharded step equals
    MuonAdamW on the whole matrices (the same stacks and kernels: bit for bit up to batched-matmul round-off)."""
    mp.spawn(_uneven_worker, args=(3, str(tmp_path / "store"), str(tmp_path / "rank0.pt")), nprocs=3, join=True)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    matrices = [torch.nn.Parameter(w) for w in _uneven_start()]
    optimizer = MuonAdamW([{"params": matrices, "kind": "muon", **MUON_SETTINGS}], num_training_steps=UNEVEN_STEPS)
    for step in range(UNEVEN_STEPS):
        for matrix, grad in zip(matrices, _uneven_gradients(step)):
            matrix.grad = grad
        optimizer.step()
    lr = MUON_DEFAULTS["lr"]
    for layout in ("fsdp2", "zero12", "zero3"):
        for shape, got, expected, start in zip(UNEVEN_SHAPES, result[layout], matrices, _uneven_start()):
            assert (expected - start).abs().max() > 0.1 * lr, f"{shape} did not move"
            difference = (got - expected).abs().max().item()
            assert difference <= 1e-6 * lr, f"{layout} {shape}: differs from whole matrices by {difference:.3g}"
