"""Muon on sharded parameters: DeepSpeed ZeRO-1/2/3 flat partitions and FSDP2 DTensor shards, with each
matrix still orthogonalised whole and the optimizer state still sharded.

Under DeepSpeed ZeRO the client optimizer steps one flat fp32 master partition per param group (ZeRO-1/2: a
contiguous range of the group's flattened, padded parameters; ZeRO-3: each parameter's own `ds_tensor` range, side
by side); under FSDP2 each parameter is a DTensor whose rank holds a `Shard(0)` block of rows. Orthogonalising such a
piece is not orthogonalising the matrix, so `MuonAdamW` hands a Muon group in that form to `ShardedMuon`, which per
step and per group, over the process group that shards the parameters (W ranks):

1. on each rank's own shard, element-wise: momentum and the Nesterov blend (`momentum_update_`, the same bits as on
   the whole matrix);
2. one `all_to_all_single` sends each matrix's pieces (and the pieces of its NorMuon second moment) to the matrix's
   owner rank: owners go round-robin over the matrices of each same-shape stack, continuing across stacks, so each
   rank orthogonalises about 1/W of every stack;
3. each owner runs `muon_direction` (Polar Express on the whole matrix, then NorMuon) on its matrices, stacked by shape;
4. a second `all_to_all_single` returns every rank its pieces of the directions and of the updated second moments;
5. on each shard again, element-wise: cautious weight decay and the shape-scaled step (on the fp32 master partition
   under ZeRO, then DeepSpeed copies it to the bf16/fp32 model weights and all-gathers them as usual; on the local
   shard under FSDP2).

The result is the DDP step's up to floating-point round-off (the gradients are averaged in another order).

State stays sharded like the parameters: the momentum is element-wise, laid out exactly like the shard (ZeRO:
`state[flat]["momentum_buffer"]`, the partition's shape; FSDP2: a DTensor per parameter); the second moments
(`rows` or `cols` values per matrix) are spread evenly over the ranks (ZeRO: `state[flat]["second_moment"]`, this
rank's slice of all the group's moments laid end to end; FSDP2: a `Shard(0)` DTensor per parameter). Per rank that is
the group's Muon state / W. DeepSpeed's checkpoints save each rank's optimizer `state_dict()` as is and load it back on
the same rank (its "rigid" format); FSDP2's go through `torch.distributed.checkpoint`, which sees ordinary DTensor
state. Communication per step and rank: about 2·(W-1)/W² of the group's elements in fp32, a factor W below DDP's
all-reduce of the same gradients; transient memory: the owner's whole matrices, about 1/W of the group, twice.

What is refused, with the reason (here, at the first step, or before training by `refuse_unsupported_sharding`):
FSDP1, tensor parallelism / HSDP (placements other than one `Shard(0)`), a Muon group that DeepSpeed ZeRO-3 splits into
several sub-groups (raise `sub_group_size`), and flat tensors that no DeepSpeed ZeRO optimizer mapped.
"""

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .settings import MuonSettings
from .update import decay_weights_, momentum_update_, muon_direction, shape_lr_scale

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Piece:
    """A contiguous run of a tensor's row-major flattening that one rank holds in its local flat buffer."""

    rank: int
    local_offset: int  # where it starts in that rank's local buffer
    offset: int  # where it starts in the whole tensor's flattening
    length: int


def split_range(start: int, length: int, bounds: Sequence[int]) -> list[Piece]:
    """The pieces of the global range `[start, start + length)` when rank `r` holds `[bounds[r], bounds[r + 1])`."""
    pieces = []
    for rank in range(len(bounds) - 1):
        low, high = max(start, bounds[rank]), min(start + length, bounds[rank + 1])
        if low < high:
            pieces.append(Piece(rank, low - bounds[rank], low - start, high - low))
    return pieces


def moment_shape(rows: int, cols: int) -> tuple[int, int]:
    """NorMuon's second moment: one value per row when `rows >= cols`, else per column (see `normuon_rescale`)."""
    return (rows, 1) if rows >= cols else (1, cols)


class ShardedMuon:
    """The two exchanges of one sharded Muon group and its step (module docstring, steps 1-5).

    Args:
        shapes: `(rows, cols)` of each matrix, in group order.
        pieces: per matrix, where its elements live (`Piece`s over all ranks, covering the matrix once).
        moment_pieces: per matrix, where its second moment's `rows` or `cols` values live.
        process_group: the ranks that shard the parameters; `rank`/`world_size` are taken from it.
        local_numel: length of this rank's flat parameter buffer (padding included).
    """

    def __init__(self, shapes: list[tuple[int, int]], pieces: list[list[Piece]], moment_pieces: list[list[Piece]],
                 process_group, local_numel: int):
        self.process_group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.local_numel = local_numel
        stacks: dict[tuple[int, int], list[int]] = {}
        for index, shape in enumerate(shapes):
            stacks.setdefault(tuple(shape), []).append(index)
        owned_by: list[list[int]] = [[] for _ in range(self.world_size)]
        for position, index in enumerate(index for members in stacks.values() for index in members):
            owned_by[position % self.world_size].append(index)
        self.matrix_count = len(shapes)
        mine = owned_by[self.rank]
        numel = [rows * cols for rows, cols in shapes]
        moment_numel = [math.prod(moment_shape(*shape)) for shape in shapes]
        starts, moment_starts, position, moment_position = {}, {}, 0, 0
        self.owned_stacks = []  # (shape, count, start, moment start) in this rank's owned buffers
        for index in mine:
            starts[index], moment_starts[index] = position, moment_position
            position, moment_position = position + numel[index], moment_position + moment_numel[index]
            last = self.owned_stacks[-1] if self.owned_stacks else None
            if last is not None and last[0] == tuple(shapes[index]):
                self.owned_stacks[-1] = (last[0], last[1] + 1, last[2], last[3])
            else:
                self.owned_stacks.append((tuple(shapes[index]), 1, starts[index], moment_starts[index]))
        self.owned_numel, self.owned_moment_numel = position, moment_position
        # (buffer 0 = matrix elements / 1 = second moments, offset, length) in the order the data travels
        self.send_plan, self.send_sizes = [], []
        for owner in range(self.world_size):
            before = len(self.send_plan)
            for index in owned_by[owner]:
                for buffer, found in ((0, pieces[index]), (1, moment_pieces[index])):
                    self.send_plan += [(buffer, p.local_offset, p.length) for p in found if p.rank == self.rank]
            self.send_sizes.append(sum(length for _, _, length in self.send_plan[before:]))
        self.receive_plan, self.receive_sizes = [], []
        for source in range(self.world_size):
            before = len(self.receive_plan)
            for index in mine:
                for buffer, found, start in ((0, pieces[index], starts), (1, moment_pieces[index], moment_starts)):
                    self.receive_plan += [(buffer, start[index] + p.offset, p.length) for p in found
                                          if p.rank == source]
            self.receive_sizes.append(sum(length for _, _, length in self.receive_plan[before:]))
        scaled: dict[float, list[tuple[int, int]]] = {}
        for shape, found in zip(shapes, pieces):
            scaled.setdefault(shape_lr_scale(*shape), []).extend(
                (p.local_offset, p.length) for p in found if p.rank == self.rank)
        self.scaled_spans = sorted(scaled.items())
        self.local_moment_numel = sum(p.length for found in moment_pieces for p in found if p.rank == self.rank)
        self.total_numel, self.total_moment_numel = sum(numel), sum(moment_numel)

    def describe(self, state_bytes: int, element_size: int) -> str:
        """One line for the log: what this rank orthogonalises, and its Muon state against the whole group's."""
        owned = sum(count * rows * cols for (rows, cols), count, _, _ in self.owned_stacks)
        total_bytes = self.total_numel * element_size + self.total_moment_numel * 4
        return (f"{self.matrix_count} matrices sharded over {self.world_size} ranks; rank {self.rank} orthogonalises "
                f"{sum(count for _, count, _, _ in self.owned_stacks)} of them "
                f"({100 * owned / max(self.total_numel, 1):.1f}% of the elements) and holds "
                f"{state_bytes / 2**20:.2f} MB of Muon state ({100 * state_bytes / max(total_bytes, 1):.1f}% of "
                f"{total_bytes / 2**20:.2f} MB)")

    def step(self, params: torch.Tensor, grads: torch.Tensor, momentum_buffer: torch.Tensor,
             second_moment: torch.Tensor, *, momentum: float, lr: float, weight_decay: float,
             settings: MuonSettings) -> None:
        """One Muon step of this rank's shards, in place: `params`, `momentum_buffer` (both `(local_numel,)`) and
        `second_moment` (`(local_moment_numel,)`, fp32), with this step's `momentum`, `lr` and (scheduled)
        `weight_decay` and the group's `settings`, as `hfl3.optim.update.muon_update` takes them. Every rank of the
        process group must call it."""
        update = momentum_update_(grads, momentum_buffer, momentum, settings.nesterov)
        received = self._exchange(_pack([update, second_moment], self.send_plan), self.receive_sizes, self.send_sizes)
        owned = [torch.empty(n, dtype=torch.float32, device=params.device)
                 for n in (self.owned_numel, self.owned_moment_numel)]
        _unpack(received, owned, self.receive_plan)
        for (rows, cols), count, start, moment_start in self.owned_stacks:
            stack = owned[0].narrow(0, start, count * rows * cols).view(count, rows, cols)
            shape = moment_shape(rows, cols)
            moment = owned[1].narrow(0, moment_start, count * math.prod(shape)).view(count, *shape)
            stack.copy_(muon_direction(stack, moment, settings))
        returned = self._exchange(_pack(owned, self.receive_plan), self.send_sizes, self.receive_sizes)
        directions = torch.zeros(self.local_numel, dtype=torch.float32, device=params.device)  # padding stays 0
        _unpack(returned, [directions, second_moment], self.send_plan)
        decay_weights_(params, directions, lr, weight_decay, settings.cautious_weight_decay)
        for scale, spans in self.scaled_spans:
            torch._foreach_add_([params.narrow(0, start, length) for start, length in spans],
                                [directions.narrow(0, start, length) for start, length in spans], alpha=-lr * scale)

    def _exchange(self, send: torch.Tensor, receive_sizes: list[int], send_sizes: list[int]) -> torch.Tensor:
        received = torch.empty(sum(receive_sizes), dtype=torch.float32, device=send.device)
        dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=self.process_group)
        return received


def _pack(buffers: list[torch.Tensor], plan: list[tuple[int, int, int]]) -> torch.Tensor:
    views = [buffers[buffer].narrow(0, offset, length) for buffer, offset, length in plan]
    if not views:
        return torch.empty(0, dtype=torch.float32, device=buffers[0].device)
    return torch.cat(views).to(torch.float32)


def _unpack(received: torch.Tensor, buffers: list[torch.Tensor], plan: list[tuple[int, int, int]]) -> None:
    if plan:
        torch._foreach_copy_([buffers[buffer].narrow(0, offset, length) for buffer, offset, length in plan],
                             list(received.split([length for _, _, length in plan])))


class ZeroShardedGroup:
    """A Muon group as DeepSpeed's ZeRO-1/2/3 optimizer hands it over: `params == [flat fp32 partition]`.

    The matrices behind the partition are the group's original parameters (recorded by `MuonAdamW` when the group
    was added); where each lives is read from DeepSpeed's own linkage: ZeRO-1/2 `param._hp_mapping` (this rank's
    fragment of the parameter, as `deepspeed.utils.safe_get_full_grad` uses it; the other ranks' fragments by one
    all-reduce), ZeRO-3 `param._z3_optimizer` (the sub-group whose flat partition this is, `partition_numel()`).

    Raises:
        RuntimeError: when the flat tensor is no ZeRO partition of exactly these matrices.
    """

    def __init__(self, flat: torch.Tensor, matrices: list[torch.Tensor], state: dict, group_name: str):
        if hasattr(matrices[0], "ds_id"):
            shapes, pieces, process_group = _zero3_layout(flat, matrices, group_name)
        else:
            shapes, pieces, process_group = _zero12_layout(flat, matrices, group_name)
        world_size = dist.get_world_size(process_group)
        moment_numel = [math.prod(moment_shape(*shape)) for shape in shapes]
        per_rank = -(-sum(moment_numel) // world_size)
        bounds = [rank * per_rank for rank in range(world_size + 1)]
        starts = [sum(moment_numel[:index]) for index in range(len(shapes))]
        moment_pieces = [split_range(start, n, bounds) for start, n in zip(starts, moment_numel)]
        self.plan = ShardedMuon(shapes, pieces, moment_pieces, process_group, flat.numel())
        self.flat, self.device = flat, flat.device
        own = state[flat]
        if "momentum_buffer" not in own:  # else restored from a checkpoint by load_state_dict
            own["momentum_buffer"] = torch.zeros_like(flat)
            own["second_moment"] = torch.zeros(per_rank, dtype=torch.float32, device=flat.device)
        if own["momentum_buffer"].shape != flat.shape or own["second_moment"].shape != (per_rank,):
            raise RuntimeError(f"MuonAdamW: the {group_name!r} group's sharded state does not fit its ZeRO partition "
                               f"({tuple(own['momentum_buffer'].shape)}, {tuple(own['second_moment'].shape)} vs "
                               f"{tuple(flat.shape)}, ({per_rank},)): a checkpoint from another world size or layout")
        self.state = own
        state_bytes = sum(own[key].numel() * own[key].element_size() for key in ("momentum_buffer", "second_moment"))
        logger.info("MuonAdamW %r under DeepSpeed ZeRO: %s", group_name,
                    self.plan.describe(state_bytes, flat.element_size()))

    def step(self, **values) -> None:
        """`ShardedMuon.step` on this rank's partition (`values`: its keywords)."""
        if self.flat.grad is not None:
            self.plan.step(self.flat, self.flat.grad, self.state["momentum_buffer"], self.state["second_moment"],
                           **values)


def _zero12_layout(flat, matrices, group_name):
    """ZeRO-1/2: rank r's partition is `[r·P, (r+1)·P)` of the group's flat (padded) parameters."""
    if not all(hasattr(matrix, "_hp_mapping") and hasattr(matrix, "_dp_group") for matrix in matrices):
        raise RuntimeError(
            f"MuonAdamW: the {group_name!r} group holds one flat tensor of shape {tuple(flat.shape)} in place of its "
            f"{len(matrices)} matrices, and they carry no DeepSpeed ZeRO mapping (_hp_mapping): Muon cannot rebuild "
            "whole matrices from it. Hand MuonAdamW whole 2-D matrices (DDP), DeepSpeed ZeRO-1/2/3 partitions or "
            "FSDP2 DTensors."
        )
    process_group = matrices[0]._dp_group
    rank, world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
    size = flat.numel()
    starts = torch.full((len(matrices),), -1, dtype=torch.int64)
    storage = flat.untyped_storage().data_ptr()
    for index, matrix in enumerate(matrices):
        mapping = matrix._hp_mapping
        if mapping is not None and mapping.hp_fragment.untyped_storage().data_ptr() == storage:
            starts[index] = rank * size + mapping.hp_fragment_address.start - mapping.lp_fragment_address.start
    starts = starts.to(flat.device)
    dist.all_reduce(starts, op=dist.ReduceOp.MAX, group=process_group)
    starts = starts.tolist()
    shapes = [tuple(matrix.shape) for matrix in matrices]
    ends = [start + math.prod(shape) for start, shape in zip(starts, shapes)]
    spans = sorted(zip(starts, ends))
    if min(starts) < 0 or spans[-1][1] > world_size * size or any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        raise RuntimeError(f"MuonAdamW: DeepSpeed's partition of the {group_name!r} group does not hold each of its "
                           f"{len(matrices)} matrices exactly once (flat offsets {starts}, {world_size} x {size})")
    bounds = [rank_ * size for rank_ in range(world_size + 1)]
    return shapes, [split_range(start, end - start, bounds) for start, end in zip(starts, ends)], process_group


def _zero3_layout(flat, matrices, group_name):
    """ZeRO-3: each parameter is cut into W ranges of `partition_numel()` (the last one padded); a sub-group's flat
    partition is this rank's range of each of its parameters, side by side."""
    optimizer = getattr(matrices[0], "_z3_optimizer", None)
    found = [index for index, candidate in enumerate(getattr(optimizer, "fp32_partitioned_groups_flat", []))
             if candidate is flat]
    if not found:
        raise RuntimeError(f"MuonAdamW: the {group_name!r} group's flat tensor is not a partition of DeepSpeed's "
                           "ZeRO-3 optimizer linked to its parameters (param._z3_optimizer)")
    sub_group = found[0]
    members = optimizer.fp16_groups[sub_group]
    if [id(member) for member in members] != [id(matrix) for matrix in matrices]:
        raise RuntimeError(
            f"MuonAdamW: DeepSpeed ZeRO-3 split the {group_name!r} group ({len(matrices)} matrices) into sub-groups "
            f"(this one holds {len(members)}), stepped one at a time; Muon's sharded step needs the whole group at "
            "once. Raise zero_optimization.sub_group_size above the group's size "
            f"({sum(m.ds_numel for m in matrices)} elements)."
        )
    process_group = optimizer.sub_group_process_groups[sub_group]
    world_size = dist.get_world_size(process_group)
    shapes, pieces, offset = [], [], 0
    for matrix in matrices:
        rows, cols = matrix.ds_shape
        size = matrix.partition_numel()
        if size != -(-rows * cols // world_size):
            raise RuntimeError(f"MuonAdamW: a ZeRO-3 partition of {size} elements for a {rows}x{cols} matrix over "
                               f"{world_size} ranks; expected {-(-rows * cols // world_size)} (ZeRO++/MiCS layouts "
                               "are not supported)")
        shapes.append((rows, cols))
        found = split_range(0, rows * cols, [rank * size for rank in range(world_size + 1)])
        pieces.append([Piece(p.rank, offset + p.local_offset, p.offset, p.length) for p in found])
        offset += size
    if offset != flat.numel():
        raise RuntimeError(f"MuonAdamW: the ZeRO-3 partition has {flat.numel()} elements, its matrices' ranges "
                           f"{offset}")
    return shapes, pieces, process_group


class FSDP2ShardedGroup:
    """A Muon group of FSDP2 parameters: 2-D DTensors on a 1-D device mesh, each rank holding a `Shard(0)` block of
    rows (`torch.chunk` sizes: `ceil(rows / W)`, the last ranks fewer or none).

    The momentum and second moments live in two flat buffers of this rank's elements; `state[param]` holds them as
    DTensors (views, placed like the parameter), which is what `torch.distributed.checkpoint` saves and restores.
    """

    def __init__(self, params: list[torch.Tensor], state: dict, group_name: str):
        from torch.distributed.tensor import DTensor, Shard

        mesh = params[0].device_mesh
        for param in params:
            if param.device_mesh != mesh:
                raise RuntimeError(f"MuonAdamW: the {group_name!r} group mixes device meshes")
        world_size = mesh.size()
        self.params, self.mesh = params, mesh
        local_offsets, moment_offsets = [0] * world_size, [0] * world_size
        shapes, pieces, moment_pieces, self.local_shapes, self.moment_local_shapes = [], [], [], [], []
        for param in params:
            rows, cols = param.shape
            shapes.append((rows, cols))
            found, moment_found = [], []
            for shape, offsets, into in ((param.shape, local_offsets, found),
                                         (moment_shape(rows, cols), moment_offsets, moment_found)):
                chunk = -(-shape[0] // world_size)
                for rank in range(world_size):
                    local_rows = max(0, min(chunk, shape[0] - rank * chunk))
                    if local_rows:
                        into.append(Piece(rank, offsets[rank], rank * chunk * shape[1], local_rows * shape[1]))
                        offsets[rank] += local_rows * shape[1]
            pieces.append(found)
            moment_pieces.append(moment_found)
        self.plan = ShardedMuon(shapes, pieces, moment_pieces, mesh.get_group(), local_offsets[mesh.get_local_rank()])
        rank = self.plan.rank
        device = self.device = params[0].to_local().device
        self.sizes = [param.to_local().numel() for param in params]
        expected = [sum(p.length for p in found if p.rank == rank) for found in pieces]
        if self.sizes != expected:
            raise RuntimeError(f"MuonAdamW: the {group_name!r} group's local shards hold {self.sizes} elements; "
                               f"Shard(0) with torch.chunk sizes gives {expected}")
        self.momentum = torch.zeros(sum(self.sizes), dtype=params[0].dtype, device=device)
        self.second_moment = torch.zeros(self.plan.local_moment_numel, dtype=torch.float32, device=device)
        moment_sizes = [sum(p.length for p in found if p.rank == rank) for found in moment_pieces]
        for key, flat, sizes, shape_of in (("momentum_buffer", self.momentum, self.sizes, lambda p: tuple(p.shape)),
                                           ("second_moment", self.second_moment, moment_sizes,
                                            lambda p: moment_shape(*p.shape))):
            for param, view in zip(params, flat.split(sizes)):
                shape = shape_of(param)
                local = view.view(-1, shape[1])
                if key in state[param]:  # restored from a checkpoint: copy into the flat buffer
                    saved = state[param][key]
                    local.copy_(saved.to_local() if isinstance(saved, DTensor) else saved)
                state[param][key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                                       stride=(shape[1], 1))
        state_bytes = sum(flat.numel() * flat.element_size() for flat in (self.momentum, self.second_moment))
        logger.info("MuonAdamW %r under FSDP2: %s", group_name,
                    self.plan.describe(state_bytes, self.momentum.element_size()))

    def step(self, **values) -> None:
        """`ShardedMuon.step` on this rank's shards (`values`: its keywords)."""
        grads = [param.grad for param in self.params]
        if all(grad is None for grad in grads):
            return
        if any(grad is None for grad in grads):
            missing = sum(grad is None for grad in grads)
            raise RuntimeError(f"MuonAdamW: {missing} of {len(grads)} sharded Muon matrices have no gradient this "
                               "step; the sharded step updates a group's matrices together")
        local_params = [param.to_local() for param in self.params]
        params = torch.cat([local.reshape(-1) for local in local_params])
        grads = torch.cat([grad.to_local().reshape(-1) for grad in grads])
        self.plan.step(params, grads, self.momentum, self.second_moment, **values)
        torch._foreach_copy_(local_params, [view.view_as(local) for view, local in
                                            zip(params.split(self.sizes), local_params)])


def check_muon_parameter(param: torch.Tensor, group_name: str) -> None:
    """Raise `RuntimeError` unless `param` is a matrix that Muon can update whole: a plain 2-D tensor, a DeepSpeed
    ZeRO-3 parameter of 2-D `ds_shape`, or an FSDP2 DTensor of 2-D shape placed `Shard(0)` on a 1-D mesh."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(param, DTensor):
        if param.ndim == 2 and param.device_mesh.ndim == 1 and tuple(param.placements) == (Shard(0),):
            return
        raise RuntimeError(
            f"MuonAdamW: a parameter of group {group_name!r} is a DTensor of shape {tuple(param.shape)} placed "
            f"{param.placements} on a {param.device_mesh.ndim}-D mesh; sharded Muon supports FSDP2's Shard(0) on one "
            "mesh dimension only (no tensor parallelism or HSDP). Use FSDP2 alone (accelerate_configs/fsdp2.yaml) "
            "or DDP (multi_gpu.yaml)."
        )
    shape = tuple(getattr(param, "ds_shape", param.shape))
    if len(shape) != 2:
        raise RuntimeError(
            f"MuonAdamW: a parameter of group {group_name!r} has shape {shape}; Muon updates 2-D matrices (put "
            "other parameters in a kind='adamw' group: hfl3.optim.param_groups_by_kind does)."
        )
