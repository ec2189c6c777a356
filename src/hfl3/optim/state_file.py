"""An optimizer's state beside the weights it trained, keyed by parameter name: `optimizer/optimizer.safetensors`.

nanochat saves its optimizer with the final base checkpoint and its chat SFT warm-starts from it (`chat_sft.py
--load-optimizer 1`: the momentum buffers and moments, with the SFT run's own learning rates; karpathy/nanochat 92d63d4).
hfl3's pretraining writes the state with its final model (`save_optimizer_state`) and the SFT recipe loads it into a
fresh optimizer of the same kind (`load_optimizer_state`): by parameter name, not by position, so the two runs may
build their groups in any order; each group's own settings (learning rate, step count for the schedules) stay those
of the new run. safetensors, not a pickle: the file holds tensors only, and its header says which optimizer wrote it.

Keys: `{parameter name}/{state key}` (MuonAdamW: `momentum_buffer`, `second_moment` for Muon matrices, `step`,
`exp_avg`, `exp_avg_sq` for AdamW's; torch's AdamW: the latter three). Header metadata: `format`
(`hfl3-optimizer-state`), `optimizer` (the class name), `groups` (JSON: each group's `kind`, `name` and parameter names).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "hfl3-optimizer-state"
# In a folder of its own: vLLM (and other loaders) read every `*.safetensors` at a model folder's top level as weights
FILE = "optimizer/optimizer.safetensors"
_PER_PARAMETER = ("momentum_buffer", "exp_avg", "exp_avg_sq")  # state entries of the parameter's own shape


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(parameter): name for name, parameter in model.named_parameters()}


def save_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: str | os.PathLike) -> Path:
    """Write `optimizer`'s per-parameter state for `model`'s parameters to `path` (safetensors; module docstring).
    The optimizer must see whole parameters (one process, or DDP), not shards.

    Raises:
        ValueError: a parameter of the optimizer is not one of `model`'s (a sharded or wrapped optimizer).
    """
    names, tensors, groups = _names(model), {}, []
    for group in optimizer.param_groups:
        group_names = []
        for parameter in group["params"]:
            if id(parameter) not in names:
                raise ValueError("save_optimizer_state: the optimizer holds a parameter the model does not name (a "
                                 "DeepSpeed or FSDP shard?); save the state of an optimizer over whole parameters")
            group_names.append(names[id(parameter)])
            for key, value in optimizer.state.get(parameter, {}).items():
                if torch.is_tensor(value):  # views into MuonAdamW's stacked buffers: a copy of its own
                    tensors[f"{names[id(parameter)]}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
        groups.append({"kind": group.get("kind"), "name": group.get("name"), "params": group_names})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata={"format": FORMAT, "optimizer": type(optimizer).__name__,
                                       "groups": json.dumps(groups)})
    return path


def read_header(path: str | os.PathLike) -> dict:
    """`{"optimizer": class name, "groups": [...], "shapes": {key: shape}}` of an optimizer state file, from its
    header alone.

    Raises:
        ValueError: not an hfl3 optimizer state file.
    """
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not an hfl3 optimizer state file (its header has no format {FORMAT!r})")
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    return {"optimizer": metadata.get("optimizer"), "groups": json.loads(metadata.get("groups", "[]")),
            "shapes": shapes}


def state_problem(header: dict, parameter_shapes: dict[str, tuple], optimizer: str) -> str | None:
    """Why a state file (its `read_header`) cannot warm-start `optimizer` (a class name) over parameters of
    `parameter_shapes` (`{name: shape}`, e.g. from the base model's safetensors header), or None: another optimizer
    wrote it, or a parameter it holds is not the model's or has another shape."""
    if header["optimizer"] != optimizer:
        return f"it holds {header['optimizer']}'s state, and this run's optimizer is {optimizer}"
    for key, shape in header["shapes"].items():
        name, entry = key.rsplit("/", 1)
        if name not in parameter_shapes:
            return f"it holds state for {name}, which the model does not have"
        if entry in _PER_PARAMETER and shape != tuple(parameter_shapes[name]):
            return f"its {key} has shape {list(shape)} and the model's {name} {list(parameter_shapes[name])}"
    return None


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, path: str | os.PathLike) -> int:
    """Load the state `save_optimizer_state` wrote into `optimizer` (over `model`'s parameters), by parameter name,
    keeping each group's own settings (its learning rate, weight decay and step count: the new run's schedules start
    over, as nanochat's chat SFT does). Parameters the file does not hold keep a fresh state. Returns how many
    parameters were given a state.

    Raises:
        ValueError: the file is not an optimizer state file, was written by another optimizer class, or a shape
            differs (`state_problem`).
    """
    header = read_header(path)
    problem = state_problem(header, {name: tuple(p.shape) for name, p in model.named_parameters()},
                            type(optimizer).__name__)
    if problem:
        raise ValueError(f"{path}: cannot warm-start the optimizer: {problem}")
    names = _names(model)
    by_parameter: dict[str, dict[str, str]] = {}
    for key in header["shapes"]:
        name, entry = key.rsplit("/", 1)
        by_parameter.setdefault(name, {})[entry] = key
    current = optimizer.state_dict()
    state, position = {}, 0
    with safe_open(str(path), "pt") as handle:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                keys = by_parameter.get(names.get(id(parameter)), {})
                if keys:
                    state[position] = {entry: handle.get_tensor(key).to(parameter.device)
                                       for entry, key in keys.items()}
                position += 1
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    return len(state)
