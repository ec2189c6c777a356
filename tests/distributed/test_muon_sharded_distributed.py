"""MuonAdamW under FSDP2 and DeepSpeed ZeRO-3 with `zero.Init` equals DDP (2 gloo CPU processes, one spawn).

FSDP2 runs at the level of accelerate's own preparation (`fsdp2_prepare_model`, then
`fsdp2_switch_optimizer_parameters`, as `Accelerator.prepare` does): accelerate 1.15 turns FSDP on only for GPU-type
setups, so the recipe cannot launch it on a CPU machine. Its resumption goes through accelerate's FULL_STATE_DICT
`save_fsdp_model`/`save_fsdp_optimizer` and `load_fsdp_*` (what the Trainer calls for fsdp2.yaml). ZeRO-3 runs with
the model built under `deepspeed.zero.Init` (parameters partitioned before the optimizer sees them: DeepSpeed's own
Muon turned itself off there). ZeRO-2 and ZeRO-3 through the recipe and the Trainer: test_recipes_distributed.

What is compared is what is deterministic up to float round-off (see tests/test_muon_ddp.py): at every step, the
gradients each scheme averaged over the ranks against DDP's, within `gradient_tolerance` (float32, reduction length,
magnitude); and the optimizer steps fed DDP's gradients in every scheme (set into the FSDP2 shards and, through
DeepSpeed's `safe_set_full_grad`, into the ZeRO-3 partitions), so that the weights after three steps (the Muon
momentum warm-up and the weight-decay decay run) must equal DDP's: bit for bit for the AdamW parameters (the same
element-wise kernels on the shards) and within `MUON_STEP_TOLERANCE` for the Muon matrices. Guards: AdamW on the
matrices (a silent fallback) and Muon orthogonalising each rank's row block on its own (a per-shard Muon), fed the
same gradients, land far outside.
"""

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.optim import MuonAdamW, MuonSettings, param_groups_by_kind
from hfl3.optim.settings import MUON_DEFAULTS
from hfl3.optim.sharded import moment_shape
from hfl3.optim.update import muon_momentum, muon_update, weight_decay_factor

from equivalence import FLOAT32_EPS, gradient_tolerance, spawn_gloo_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLD_SIZE = 2
STEPS = 3
GLOBAL_BATCH, SEQ_LEN = 8, 24
# The schedules on, so the step count matters (cautious weight decay is on by default: fed identical gradients, its
# mask sees the same numbers in every scheme).
MUON_SETTINGS = dict(weight_decay=0.2, momentum_warmup_steps=2)
ZERO3 = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // WORLD_SIZE, "gradient_accumulation_steps": 1,
         "train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
# The Muon matrices after 3 steps fed identical gradients, in units of the LR. The sharded step runs the same
# element-wise kernels on each shard and `muon_direction` on each whole matrix stacked with other matrices of its
# shape on its owner rank, as DDP's step does; only the stacks' composition differs (`baddbmm` over k matrices), and a
# batched matmul computes each matrix of the batch on its own. Measured: bit for bit. Allowed: one float32 rounding
# of the update (eps·lr, eps = 2**-23) per step.
MUON_STEP_TOLERANCE = STEPS * FLOAT32_EPS


def _config() -> L3GPTConfig:
    """Depth 3, as in tests/test_muon_ddp.py: at depth 2 the backout scalar's gradient is pure round-off."""
    return L3GPTConfig.from_depth(
        3, vocab_size=256, aspect_ratio=32, head_dim=64, max_position_embeddings=32, window_pattern="L",
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
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS)]


def _train(forward, named_parameters, rows: slice, step, steps, full_gradient, set_gradient, reference=None) -> list:
    """For each step in `steps`: forward and backward on this rank's `rows`, record the scheme's averaged gradients
    (`full_gradient(param)`, collective), replace them by `reference[step]` (DDP's) when given, and `step()`.
    Returns the recorded gradients per step."""
    recorded = []
    for index in steps:
        input_ids = _batches()[index][rows]
        forward(input_ids=input_ids, labels=input_ids).loss.backward()  # equal-length rows: the mean of the means
        recorded.append({name: full_gradient(param).clone() for name, param in named_parameters()})
        if reference is not None:
            for name, param in named_parameters():
                set_gradient(param, reference[index][name])
        step()
    return recorded


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


def _set_shard(param, full: torch.Tensor) -> None:
    """Set an FSDP2 parameter's gradient to this rank's `Shard(0)` block of `full` (the same layout as its grad)."""
    from torch.distributed.tensor import distribute_tensor

    param.grad = distribute_tensor(full, param.device_mesh, param.placements)


def _fsdp2_steps(model, optimizer, rows, steps, reference) -> list:
    def step():
        optimizer.step()
        optimizer.zero_grad()

    return _train(model, model.named_parameters, rows, step, steps, lambda param: param.grad.full_tensor(),
                  _set_shard, reference)


def _worker(rank: int, checkpoint_dir: str, result_path: str) -> None:
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
                       "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT",
                       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"})  # accelerate_configs/fsdp2.yaml
    PartialState()  # accelerate's logging in save_fsdp_model needs it; it adopts the process group
    rows = slice(rank * GLOBAL_BATCH // WORLD_SIZE, (rank + 1) * GLOBAL_BATCH // WORLD_SIZE)
    result = {}
    model = _model()
    optimizer = MuonAdamW(_groups(model), num_training_steps=STEPS)

    def ddp_step():
        optimizer.step()
        optimizer.zero_grad()

    ddp_gradients = _train(DistributedDataParallel(model), model.named_parameters, rows, ddp_step, range(STEPS),
                           lambda param: param.grad, None)
    result.update(ddp={name: param.detach().clone() for name, param in model.named_parameters()},
                  ddp_gradients=ddp_gradients,
                  ddp_state_bytes=optimizer.muon_state_bytes())

    plugin = FullyShardedDataParallelPlugin()
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="no",
                                  is_main_process=rank == 0, device=torch.device("cpu"), process_index=rank,
                                  num_processes=WORLD_SIZE, is_fsdp2=True, wait_for_everyone=dist.barrier)
    model, optimizer = _fsdp2(accelerator)
    gradients = _fsdp2_steps(model, optimizer, rows, range(STEPS - 1), ddp_gradients)
    save_fsdp_model(plugin, accelerator, model, checkpoint_dir)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint_dir)
    gradients += _fsdp2_steps(model, optimizer, rows, [STEPS - 1], ddp_gradients)
    result.update(fsdp2=_full_state(model), fsdp2_gradients=gradients,
                  fsdp2_state_bytes=optimizer.muon_state_bytes())
    model, optimizer = _fsdp2(accelerator)
    load_fsdp_model(plugin, accelerator, model, checkpoint_dir)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, checkpoint_dir)
    _fsdp2_steps(model, optimizer, rows, [STEPS - 1], ddp_gradients)
    result["fsdp2_resumed"] = _full_state(model)

    result.update(_zero3_with_zero_init(rows, ddp_gradients))
    if rank == 0:
        torch.save(result, result_path)


def _zero3_with_zero_init(rows: slice, ddp_gradients: list) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

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
    gradients = _train(engine, model.named_parameters, rows, engine.step, range(STEPS), safe_get_full_grad,
                       _set_zero3_gradient, ddp_gradients)
    state = engine._zero3_consolidated_16bit_state_dict()  # collective; None on the other ranks
    return {"zero3_groups": group_names, "zero3": state, "zero3_gradients": gradients,
            "zero3_state_bytes": optimizer.optimizer.muon_state_bytes()}


def _set_zero3_gradient(param, full: torch.Tensor) -> None:
    """`deepspeed.utils.safe_set_full_grad` for a ZeRO-3 parameter. DeepSpeed 0.19 cuts rank r's piece out of the
    flattened value at r·partition without the padding its partitions carry, so a tensor whose size the world size
    does not divide (the 1-element backout scalar) is padded here first."""
    from deepspeed.utils import safe_set_full_grad

    padded = torch.zeros(param.ds_tensor.numel() * WORLD_SIZE, dtype=full.dtype)
    padded[: full.numel()] = full.flatten()
    safe_set_full_grad(param, padded)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("muon_sharded")
    spawn_gloo_ranks(_worker, WORLD_SIZE, folder / "store", str(folder / "checkpoint"), str(folder / "rank0.pt"))
    return torch.load(folder / "rank0.pt", weights_only=False)


def _replay(model, optimizer_step, gradients: list) -> None:
    """Feed the recorded gradients, step by step, to `optimizer_step` on `model`'s parameters."""
    for step_gradients in gradients:
        for name, param in model.named_parameters():
            param.grad = step_gradients[name].clone()
        optimizer_step()
        model.zero_grad()


def _adamw_on_matrices(model, gradients: list) -> None:
    optimizer = MuonAdamW(_groups(model, "adamw"), num_training_steps=STEPS)
    _replay(model, optimizer.step, gradients)


def _per_shard_muon(model, gradients: list) -> None:
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
    steps = iter(range(STEPS))

    def step():
        index = next(steps)
        with torch.no_grad():
            for param in matrices["params"]:
                blocks = param.view(WORLD_SIZE, -1, param.shape[1])
                muon_update(
                    blocks, param.grad.view_as(blocks), *buffers[id(param)],
                    momentum=muon_momentum(index, settings.momentum, settings.momentum_warmup_start,
                                           settings.momentum_warmup_steps),
                    lr=group["lr"], weight_decay=group["weight_decay"] * weight_decay_factor(index, STEPS),
                    settings=settings,
                )  # fmt: skip
        optimizer.step()

    _replay(model, step, gradients)


def _learning_rates(model) -> dict[str, tuple[float, str]]:
    names = {id(param): name for name, param in model.named_parameters()}
    return {names[id(p)]: (group["lr"], group["kind"]) for group in param_groups_by_kind(model)
            for p in group["params"]}


def test_fsdp2_and_zero3_gradients_equal_ddp(sharded_runs):
    hidden_size = _config().hidden_size
    for scheme in ("fsdp2", "zero3"):
        for step, (gradients, reference) in enumerate(zip(sharded_runs[f"{scheme}_gradients"],
                                                          sharded_runs["ddp_gradients"], strict=True)):
            assert gradients.keys() == reference.keys()
            for name, expected in reference.items():
                tolerance = gradient_tolerance(expected, GLOBAL_BATCH * SEQ_LEN, hidden_size)
                difference = (gradients[name].float() - expected).abs().max().item()
                where = f"{scheme} step {step + 1} {name}"
                assert difference <= tolerance, f"{where}: differs from DDP's by {difference:.3g} > {tolerance:.3g}"


def test_fsdp2_and_zero3_steps_equal_ddp_and_guards_tell(sharded_runs):
    learning_rates = _learning_rates(_model())
    ddp = sharded_runs["ddp"]
    for scheme in ("fsdp2", "zero3"):
        for name, (lr, kind) in learning_rates.items():
            got = sharded_runs[scheme][name].float()
            if kind == "adamw":
                assert torch.equal(got, ddp[name]), f"{scheme} {name}: AdamW step differs from DDP's"
            else:
                difference = (got - ddp[name]).abs().max().item()
                assert difference <= MUON_STEP_TOLERANCE * lr, \
                    f"{scheme} {name}: Muon step differs from DDP's by {difference / lr:.3g}·lr"
    for guard in (_adamw_on_matrices, _per_shard_muon):
        model = _model()
        guard(model, sharded_runs["ddp_gradients"])
        for name, param in model.named_parameters():
            lr, kind = learning_rates[name]
            if kind == "muon":  # the matrices: the wrong update moves them by about the LR itself
                assert (param - ddp[name]).abs().median() > 1e3 * MUON_STEP_TOLERANCE * lr, \
                    f"{guard.__name__}: {name} cannot tell"


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


def _uneven_worker(rank: int, world_size: int, result_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hfl3.optim.sharded import ShardedMuon
    from hfl3.optim.update import muon_momentum

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


def test_three_ranks_with_uneven_shards_equal_whole_matrices(tmp_path):
    """FSDP2 DTensors with torch.chunk's uneven row blocks (a 3x4 matrix: one row each; 2x6: nothing on rank 2), and
    hand-built ZeRO-1/2 and ZeRO-3 layouts with padding and cuts inside matrices, over 3 ranks: the sharded step equals
    MuonAdamW on the whole matrices fed the same gradients, within `MUON_STEP_TOLERANCE` (measured: bit for bit)."""
    spawn_gloo_ranks(_uneven_worker, 3, tmp_path / "store", 3, str(tmp_path / "rank0.pt"))
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
            assert difference <= MUON_STEP_TOLERANCE * lr, \
                f"{layout} {shape}: differs from whole matrices by {difference / lr:.3g}·lr"
