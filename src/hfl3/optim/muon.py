"""MuonAdamW: Muon for hidden matrices and AdamW for everything else, in one `torch.optim.Optimizer`.

One optimizer (docs/design.md, decision 7) so that the HF Trainer's LR scheduler, checkpointing and logging
see a single object. Each param group carries a `kind`: `"muon"` or `"adamw"`, and a `name` saying
which part of the model it holds (`matrix`, `embedding`, `l3_table`, `value_embedding`, `unembedding`,
`scalar`, `residual_scalar`, `smear`).

Muon (https://kellerjordan.github.io/posts/muon/) on a 2-D weight `W` of shape `(rows, cols)`:

    B   <- momentum·B + (1 - momentum)·G                      Nesterov: U = (1 - momentum)·G + momentum·B
    U   <- MuonEq(U)                                          optional, arXiv 2603.28254 (see `equilibrate`)
    O   <- PolarExpress(U)                                    ≈ polar factor of U, in bf16 (CPU: fp32)
    O   <- O · sqrt(min(rows, cols)) / ‖O‖_F                  Muon+, optional, arXiv 2602.21545
    O   <- NorMuon(O)                                         optional, arXiv 2510.05491
    W   <- W - lr·wd·W·[O ⊙ W >= 0]                           cautious weight decay, arXiv 2510.12402
    W   <- W - lr·sqrt(max(1, rows/cols))·O                   shape-aware LR (Keller Jordan's "original")

Everything else is AdamW through torch's own `torch.optim.adamw.adamw`: `fused=True` on accelerators,
`foreach=True` on the CPU (bit-identical to `torch.optim.AdamW` there).

Speed (a per-matrix step was launch-bound on a GPU: 38 ms at d12, dev/LOG.md 2026-11-23; nanochat/optim.py stacks the same way): the matrices of a Muon group are split into *stacks* of
same-shape (and dtype, device) matrices, and the whole update of a stack runs on `(k, rows, cols)` tensors with
batched matmuls (`muon_update`), so a step launches kernels per distinct shape, not per matrix: at d12 with an
L3 layer the 74 matrices are 4 stacks. With `compile_update` (default: on CUDA) the stack update is one
`torch.compile`d graph; the scheduled values (LR, momentum, weight decay) enter it as 0-D CPU tensors, so a new
value is not a recompile. A step does no per-parameter checks and no host-device synchronisation (its only work
per parameter is collecting the `.grad`s): the whole-matrix checks run when a group is added and when its
parameter list is replaced (as accelerate and DeepSpeed do after creation). The price is transient memory: the
weights and gradients of the stack being updated are copied into `(k, rows, cols)` tensors, as nanochat does.

State: `optimizer.state[p]` holds per-parameter tensors, as torch's optimizers do — Muon's `momentum_buffer`
`(rows, cols)` and `second_moment` `(rows, 1)` or `(1, cols)` (fp32), AdamW's `step`, `exp_avg`, `exp_avg_sq` —
so `state_dict()` has the format every `torch.optim` consumer expects and checkpoints of the per-parameter
implementation (before same-shape stacks, commit 0d37b51) load unchanged. The Muon tensors are views into one stacked buffer per stack,
allocated at the first step (on the parameters' device, after the Trainer moved the model). `torch.save`
writes each stacked buffer once; `load_state_dict` copies the loaded values into fresh stacks (keeping
`second_moment` in fp32, which torch's loader would cast to a bf16 parameter's dtype), so a resume continues
bit-identically. A parameter whose `.grad` is None at a step is skipped, as `torch.optim` does: its weight,
momentum and moments stay as they are (its stack runs on the matrices that have a gradient; AdamW's lists are
filtered). Its state exists from the first step on, as zeros, which is what a later first update starts from.

Schedules (as nanochat's base_train): the Muon momentum warms up linearly (`MuonSettings.momentum_warmup_start`
to `momentum` over `momentum_warmup_steps`), and every group's weight decay decays linearly to 0 over
`num_training_steps`. Both read the optimizer's own step count, kept in each param group (`step`),
so `state_dict()` carries it and a Trainer resume continues identically. The LR itself is left to
the Trainer's scheduler, which multiplies every group's `initial_lr`.

Distributed: under DDP the optimizer sees whole matrices with averaged gradients and needs nothing. Under DeepSpeed
ZeRO-1/2/3 it sees one flat fp32 partition per group and under FSDP2 DTensor shards, where orthogonalising a shard
is not orthogonalising the matrix: a Muon group in either form runs the sharded step of `hfl3.optim.sharded` (each
matrix gathered whole on an owner rank, round-robin over each same-shape stack, orthogonalised there with
`muon_direction`, and the result returned; state sharded like the parameters; equal to DDP up to round-off). The
setups it cannot run under are refused before training (`hfl3.optim.refuse_unsupported_sharding`) or when the
group is first laid out. The update itself (`muon_update` and its parts): `hfl3.optim.update`.

Grouping a model's parameters and building the optimizer from `TrainingArguments`: `hfl3.optim.groups`; every
setting's default and its source: `hfl3.optim.settings`.
"""

import logging
import weakref
from collections.abc import Iterable
from dataclasses import asdict

import torch
from torch.optim.adamw import adamw
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from .settings import ADAMW_DEFAULTS, MUON_DEFAULTS, MuonSettings
from .update import muon_momentum, muon_update, weight_decay_factor

logger = logging.getLogger(__name__)

_SCHEDULED = ("momentum", "lr", "weight_decay")  # the values that change between steps


class _MuonStack:
    """The same-shape matrices of one Muon group and their state as stacked buffers; `optimizer.state` holds views."""

    def __init__(self, params: list[torch.Tensor], state: dict, compiled: bool):
        first = params[0]
        rows, cols = first.shape
        self.params = params
        self.momentum_buffer = torch.zeros((len(params), rows, cols), dtype=first.dtype, device=first.device)
        moment_shape = (rows, 1) if rows >= cols else (1, cols)
        self.second_moment = torch.zeros((len(params), *moment_shape), dtype=torch.float32, device=first.device)
        for index, param in enumerate(params):
            for key, stacked in (("momentum_buffer", self.momentum_buffer), ("second_moment", self.second_moment)):
                if key in state[param]:  # restored by load_state_dict, or from an earlier layout
                    stacked[index].copy_(state[param][key])
                state[param][key] = stacked[index]
        self.key = (tuple(first.shape), first.dtype, first.device)
        self.compiled = compiled


class _AdamWLists:
    """An AdamW group's parameters and state tensors as the lists that torch's `adamw` takes."""

    def __init__(self, params: list[torch.Tensor], state: dict):
        self.params = params
        fused_devices = set(_get_fused_kernels_supported_devices()) - {"cpu"}
        self.fused = all(param.device.type in fused_devices and param.is_floating_point() for param in params)
        for param in params:
            # torch.optim.AdamW's placement: the step count on the parameter's device for the fused kernel
            step_device = param.device if self.fused else torch.device("cpu")
            if not state[param]:
                state[param]["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
                state[param]["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state[param]["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            else:
                state[param]["step"] = state[param]["step"].to(dtype=torch.float32, device=step_device)
        self.exp_avgs = [state[param]["exp_avg"] for param in params]
        self.exp_avg_sqs = [state[param]["exp_avg_sq"] for param in params]
        self.steps = [state[param]["step"] for param in params]


class _Layout:
    """The stacks (Muon), sharded group (Muon under ZeRO/FSDP2) or lists (AdamW) of one param group, valid while the
    group holds the same tensors."""

    def __init__(self, group: dict, parts: list):
        self.group, self.source, self.tensors, self.parts = group, group["params"], list(group["params"]), parts

    def is_current(self, group: dict) -> bool:
        params = group["params"]
        if self.group is not group:
            return False
        if self.source is params and len(self.tensors) == len(params):
            return True
        # DeepSpeed ZeRO-3 assigns a new one-element list before every step: compare the tensors (O(1) there)
        if len(params) == len(self.tensors) and all(a is b for a, b in zip(params, self.tensors)):
            self.source = params
            return True
        return False


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups with `kind="muon"`, AdamW (torch's implementation) for `kind="adamw"`.

    Args:
        param_groups: list of dicts with `params`, `kind` (`"muon"` | `"adamw"`), optionally `name` and
            any of the per-kind keys; missing keys take their defaults (`hfl3.optim.settings`). Muon keys
            (`MUON_DEFAULTS`): `lr` (default `GroupLearningRates.matrix_lr`), `weight_decay` (0) and the fields of
            `MuonSettings` (momentum and its warm-up, Nesterov, Polar Express, NorMuon, cautious weight decay,
            MuonEq, Muon+; each with its default and source there). AdamW keys (`ADAMW_DEFAULTS`): `lr`, `betas`,
            `eps`, `weight_decay`.
        num_training_steps: total optimizer steps; every group's weight decay decays linearly to 0 over
            them. None keeps the weight decay constant.
        compile_update: run each stack's Muon update as one `torch.compile`d graph (`muon_update`, compiled
            once per stack shape at the first step). None (default): on CUDA yes, elsewhere no (on the CPU
            compiling costs more than it saves at test sizes; its result equals eager within round-off).

    Every Muon parameter must be a 2-D matrix: a plain tensor (one process, DDP: stacked as above), an FSDP2
    DTensor placed `Shard(0)` on a 1-D mesh, or a parameter that DeepSpeed ZeRO-1/2/3 replaces by its flat
    partition; the last two run the sharded step of `hfl3.optim.sharded` (each matrix orthogonalised whole on an
    owner rank, state sharded, the DDP result up to round-off). Construction, and the first step after a group's
    `params` list was replaced (as accelerate and DeepSpeed do), raise `RuntimeError` for anything else (a 1-D
    tensor that no ZeRO optimizer mapped, tensor-parallel DTensors, ...) rather than orthogonalising a piece of a
    matrix. Change a group's parameters by assigning a new list to `group["params"]`, never by editing the list in
    place. Weight
    decay is scaled by the group `lr` (not the shape-adjusted one), as `torch.optim.Muon` does; nanochat
    scales it by the adjusted LR (a factor 2 on the 4x-wide MLP up-projection only).
    """

    def __init__(
        self,
        param_groups: Iterable[dict],
        num_training_steps: int | None = None,
        compile_update: bool | None = None,
    ):
        if num_training_steps is not None and num_training_steps <= 0:
            raise ValueError(f"MuonAdamW: num_training_steps must be positive or None, got {num_training_steps}")
        self.num_training_steps = num_training_steps
        self.compile_update = compile_update
        # The matrices each Muon group was built with, by id of the group dict (filled by add_param_group): under
        # DeepSpeed ZeRO the group then holds one flat partition instead, and the sharded step maps it back to these
        # (DeepSpeed keeps them alive as the model's parameters). Weak references: accelerate's FSDP2 preparation
        # drops the unsharded originals.
        self._group_matrices: dict[int, tuple[dict, list]] = {}
        self._init_runtime()
        super().__init__(list(param_groups), defaults={})

    def _init_runtime(self) -> None:
        self._layouts: dict[int, _Layout] = {}  # by id of the group dict (DeepSpeed steps one group at a time)
        self._compiled_update = None
        self._scheduled_tensors = {key: torch.zeros((), dtype=torch.float32) for key in _SCHEDULED}

    def __getstate__(self) -> dict:
        return {
            **super().__getstate__(),
            "num_training_steps": self.num_training_steps,
            "compile_update": self.compile_update,
        }

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # also called by load_state_dict, which keeps _group_matrices (and remaps it)
        self._init_runtime()
        if not hasattr(self, "_group_matrices"):  # unpickled
            self._group_matrices = {id(group): (group, [weakref.ref(param) for param in group["params"]])
                                    for group in self.param_groups if group["kind"] == "muon"}

    def add_param_group(self, param_group: dict) -> None:
        """Validate a tagged group, fill in its kind's defaults, the step count 0 and the decay horizon.

        Raises:
            ValueError: for a missing/unknown `kind`, a key that the kind does not have, or a bad `orthogonalize_dtype`
                or `muon_eq`.
            RuntimeError: for a Muon parameter that is not a whole 2-D matrix (see the class docstring).
        """
        index = len(self.param_groups)
        if not isinstance(param_group, dict) or param_group.get("kind") not in ("muon", "adamw"):
            raise ValueError(
                f"MuonAdamW: param group {index} needs kind='muon' or kind='adamw'; build the groups with "
                "hfl3.optim.param_groups_by_kind(model) or tag them yourself"
            )
        kind = param_group["kind"]
        defaults = MUON_DEFAULTS if kind == "muon" else ADAMW_DEFAULTS
        unknown = set(param_group) - set(defaults) - {"params", "kind", "name"}
        if unknown:
            raise ValueError(f"MuonAdamW: param group {index} ({kind}) has unknown keys {sorted(unknown)}")
        group = {**defaults, "name": kind, **param_group, "step": 0, "num_training_steps": self.num_training_steps}
        if kind == "muon":  # validated, and ns_coefficients made tuples (constants of the compiled graph)
            group.update(asdict(MuonSettings.from_group(group)))
        super().add_param_group(group)
        if kind == "muon":
            from .sharded import check_muon_parameter

            added = self.param_groups[-1]
            for param in added["params"]:
                check_muon_parameter(param, group["name"])
            self._group_matrices[id(added)] = (added, [weakref.ref(param) for param in added["params"]])

    def load_state_dict(self, state_dict: dict) -> None:
        """`torch.optim.Optimizer.load_state_dict`, then Muon's state copied back into stacked buffers.

        NorMuon's `second_moment` stays fp32 (torch's loader casts every state tensor to its parameter's dtype).
        """
        saved_ids = [param_id for group in state_dict["param_groups"] for param_id in group["params"]]
        second_moments = {
            position: state_dict["state"][param_id]["second_moment"]
            for position, param_id in enumerate(saved_ids)
            if "second_moment" in state_dict["state"].get(param_id, {})
        }
        groups_before = list(self.param_groups)
        super().load_state_dict(state_dict)  # replaces the group dicts
        params = [param for group in self.param_groups for param in group["params"]]
        for position, moment in second_moments.items():
            self.state[params[position]]["second_moment"] = moment.to(torch.float32)
        for before, after in zip(groups_before, self.param_groups):
            if id(before) in self._group_matrices:
                self._group_matrices[id(after)] = (after, self._group_matrices.pop(id(before))[1])
        self._layouts = {}

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every group; returns the closure's loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["params"]:  # DeepSpeed ZeRO-3 empties the groups whose sub-group it is not stepping
                continue
            layout = self._layouts.get(id(group))
            if layout is None or not layout.is_current(group):
                layout = self._layouts[id(group)] = self._build_layout(group)
            decay = group["weight_decay"] * weight_decay_factor(group["step"], group["num_training_steps"])
            if group["kind"] == "muon":
                self._muon_step(group, layout.parts, decay)
            else:
                self._adamw_step(group, layout.parts[0], decay)
            group["step"] += 1
        return loss

    def _build_layout(self, group: dict) -> _Layout:
        from torch.distributed.tensor import DTensor

        from . import sharded

        params = list(group["params"])
        if group["kind"] == "adamw":
            return _Layout(group, [_AdamWLists(params, self.state)])
        recorded = [ref() for ref in self._group_matrices.get(id(group), (None, []))[1]]
        if None in recorded:  # the originals are gone (FSDP2 sharded them): nothing to map back to
            recorded = []
        if len(params) == 1 and params[0].ndim == 1 and recorded and all(params[0] is not m for m in recorded):
            return _Layout(group, [sharded.ZeroShardedGroup(params[0], recorded, self.state, group["name"])])
        for param in params:
            sharded.check_muon_parameter(param, group["name"])
        if any(isinstance(param, DTensor) for param in params):
            return _Layout(group, [sharded.FSDP2ShardedGroup(params, self.state, group["name"])])
        if any(hasattr(param, "ds_id") for param in params):
            raise RuntimeError(
                f"MuonAdamW: the {group['name']!r} group holds DeepSpeed ZeRO-3 parameters themselves (empty "
                "partitioned tensors), not the flat partitions DeepSpeed's ZeRO optimizer steps: Muon cannot update "
                "them. Let DeepSpeed wrap MuonAdamW (deepspeed.initialize(optimizer=...), or the Trainer)."
            )
        by_shape: dict[tuple, list[torch.Tensor]] = {}
        for param in params:
            by_shape.setdefault((tuple(param.shape), param.dtype, param.device), []).append(param)
        stacks = []
        for (_, _, device), members in by_shape.items():
            compiled = self.compile_update if self.compile_update is not None else device.type == "cuda"
            stacks.append(_MuonStack(members, self.state, compiled))
        return _Layout(group, stacks)

    def muon_state_bytes(self) -> int:
        """Bytes of Muon state (momentum, NorMuon second moments) that this process holds: its shards under ZeRO and
        FSDP2, all of it under DDP. Counts what exists (the state is laid out at the first step)."""
        from torch.distributed.tensor import DTensor

        storages = {}
        for param_state in self.state.values():
            for key in ("momentum_buffer", "second_moment"):
                if key in param_state:
                    value = param_state[key]
                    storage = (value.to_local() if isinstance(value, DTensor) else value).untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def _muon_step(self, group: dict, stacks: list[_MuonStack], weight_decay: float) -> None:
        scheduled = {
            "momentum": muon_momentum(
                group["step"], group["momentum"], group["momentum_warmup_start"], group["momentum_warmup_steps"]
            ),
            "lr": group["lr"],
            "weight_decay": weight_decay,
        }
        settings = MuonSettings.from_group(group)
        for stack in stacks:
            if not isinstance(stack, _MuonStack):  # a sharded group (ZeRO partition or FSDP2 shards), always eager
                stack.step(**scheduled, settings=settings)
                continue
            grads = [param.grad for param in stack.params]
            if all(grad is not None for grad in grads):
                params = torch.stack(stack.params)
                update, values = self._update_function(stack, scheduled, settings)
                update(params, torch.stack(grads), stack.momentum_buffer, stack.second_moment, **values,
                       settings=settings)
                torch._foreach_copy_(stack.params, list(params.unbind(0)))
            else:
                _muon_step_with_gradients_only(stack, grads, scheduled, settings)

    def _update_function(self, stack: _MuonStack, scheduled: dict, settings: MuonSettings):
        """`muon_update` with the scheduled values as floats, or its compiled graph with them as 0-D tensors.

        Dynamo keeps at most `torch._dynamo.config.recompile_limit` graphs of one function (one per stack shape
        and settings here) and, with `fullgraph=True`, fails beyond that; a stack past the limit runs eagerly.
        """
        if not stack.compiled or not _reserve_graph((*stack.key, settings)):
            return muon_update, scheduled
        if self._compiled_update is None:
            self._compiled_update = torch.compile(muon_update, dynamic=False, fullgraph=True)
        for key, value in scheduled.items():
            self._scheduled_tensors[key].fill_(value)
        return self._compiled_update, self._scheduled_tensors

    def _adamw_step(self, group: dict, lists: _AdamWLists, weight_decay: float) -> None:
        grads = [param.grad for param in lists.params]
        params, exp_avgs, exp_avg_sqs, steps = lists.params, lists.exp_avgs, lists.exp_avg_sqs, lists.steps
        if not all(grad is not None for grad in grads):
            present = [index for index, grad in enumerate(grads) if grad is not None]
            params, grads, exp_avgs, exp_avg_sqs, steps = (
                [values[index] for index in present] for values in (params, grads, exp_avgs, exp_avg_sqs, steps)
            )
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=not lists.fused,
            fused=lists.fused,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=weight_decay,
            eps=group["eps"],
            maximize=False,
        )


def _muon_step_with_gradients_only(stack: _MuonStack, grads: list, scheduled: dict, settings: MuonSettings) -> None:
    """The rare step where some matrices of a stack have no gradient: update the others (eagerly), skip these."""
    present = [index for index, grad in enumerate(grads) if grad is not None]
    if not present:
        return
    params = [stack.params[index] for index in present]
    momentum_views = [stack.momentum_buffer[index] for index in present]
    moment_views = [stack.second_moment[index] for index in present]
    stacked = [torch.stack(tensors) for tensors in (params, momentum_views, moment_views)]
    muon_update(stacked[0], torch.stack([grads[index] for index in present]), stacked[1], stacked[2], **scheduled,
                settings=settings)
    torch._foreach_copy_(
        params + momentum_views + moment_views, [row for tensor in stacked for row in tensor.unbind(0)]
    )


_COMPILED_SIGNATURES: set[tuple] = set()  # the graphs of `muon_update` compiled in this process
_EAGER_SIGNATURES: set[tuple] = set()  # the stacks left eager because the limit was reached


def _reserve_graph(signature: tuple) -> bool:
    """True if `muon_update` has, or may add, a compiled graph for `signature` within dynamo's recompile limit."""
    import torch._dynamo

    if signature in _COMPILED_SIGNATURES:
        return True
    if len(_COMPILED_SIGNATURES) < torch._dynamo.config.recompile_limit:
        _COMPILED_SIGNATURES.add(signature)
        return True
    if signature not in _EAGER_SIGNATURES:
        _EAGER_SIGNATURES.add(signature)
        logger.warning(
            "MuonAdamW: muon_update has %d compiled graphs, torch._dynamo.config.recompile_limit; the %s stack runs "
            "eagerly (raise the limit to compile it)", len(_COMPILED_SIGNATURES), "×".join(map(str, signature[0])),
        )  # fmt: skip
    return False
