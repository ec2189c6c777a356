"""The distributed setups `MuonAdamW` cannot run under, refused before training: what `accelerate launch` (or the
`TrainingArguments`) set up for this process, read from accelerate's state or the launcher's variables. ZeRO-1/2/3
and FSDP2 themselves run (`hfl3.optim.sharded`).
"""

import json
import os
from pathlib import Path


def refuse_unsupported_sharding(args) -> None:
    """Raise `RuntimeError`, naming the reason and the alternative, for a distributed setup in which `MuonAdamW`
    would not run as Muon: DeepSpeed with an `optimizer` block in its config (DeepSpeed then builds that optimizer
    and never calls the Trainer's), ZeRO offload of the optimizer or the parameters, ZeRO stage 0 with bf16/fp16
    (DeepSpeed's own flattening optimizer), ZeRO++ hpZ / MiCS partitions, elastic ZeRO checkpoints, FSDP1, FSDP2 with
    CPU offload. One process, DDP, DeepSpeed ZeRO-1/2/3 and FSDP2 pass (`hfl3.optim.sharded` runs the last two).

    Reads accelerate's state (once an `Accelerator` exists, e.g. after `Trainer.__init__`), else the variables that
    `accelerate launch` sets (`ACCELERATE_USE_DEEPSPEED` and `ACCELERATE_DEEPSPEED_*`, `ACCELERATE_USE_FSDP` and
    `FSDP_*`) and `args.deepspeed` / `args.fsdp`. `create_muon_optimizer` calls it; a Trainer that picks Muon from a
    config must call it in `__init__` too, because with an `optimizer` block the Trainer never calls
    `create_optimizer`.
    """
    problems = []
    deepspeed = _deepspeed_config(args)
    if deepspeed is not None:
        zero = deepspeed.get("zero_optimization") or {}
        if deepspeed.get("optimizer"):
            problems.append(
                f"the DeepSpeed config has an 'optimizer' block ({deepspeed['optimizer'].get('type')}): DeepSpeed "
                "would build that optimizer and never use MuonAdamW. Remove the block; the Trainer then hands "
                "DeepSpeed MuonAdamW"
            )
        for key in ("offload_optimizer", "offload_param"):
            device = str((zero.get(key) or {}).get("device", "none")).lower()
            if device != "none":
                problems.append(
                    f"ZeRO {key} to {device}: the partitions then live off the accelerator and the optimizer step "
                    "runs there, which Muon's sharded step does not support. Drop the offload (ZeRO-3 also shards "
                    "the parameters), or use AdamW with offload"
                )
        if int(zero.get("stage", 0)) == 0 and (_enabled(deepspeed, "bf16", args) or _enabled(deepspeed, "fp16", args)):
            problems.append(
                "ZeRO stage 0 with bf16/fp16: DeepSpeed's mixed-precision optimizer flattens the groups in a layout "
                "MuonAdamW does not map. Use ZeRO-1/2 (accelerate_configs/zero2.yaml) or DDP (multi_gpu.yaml)"
            )
        if int(zero.get("zero_hpz_partition_size", 1)) > 1 or int(zero.get("mics_shard_size", -1)) > 0:
            problems.append("ZeRO++ hpZ / MiCS partitions: not supported by Muon's sharded step. Use plain ZeRO-3")
        if zero.get("elastic_checkpoint"):
            problems.append("elastic ZeRO checkpoints: Muon's sharded second moments are saved per rank (rigid). "
                            "Set zero_optimization.elastic_checkpoint to false")
    fsdp_version, fsdp_offload = _fsdp_setup(args)
    if fsdp_version == 1:
        problems.append("FSDP1: its FlatParameters hand the optimizer flattened pieces of several matrices. Use FSDP2 "
                        "(accelerate_configs/fsdp2.yaml, fsdp_version: 2)")
    if fsdp_version == 2 and fsdp_offload:
        problems.append("FSDP2 with CPU offload: the optimizer step then runs on CPU shards, which Muon's sharded "
                        "step does not support. Drop fsdp_offload_params, or use AdamW with offload")
    if problems:
        raise RuntimeError("MuonAdamW cannot run under this setup: " + "; ".join(problems) + ".")


def _deepspeed_config(args) -> dict | None:
    """The DeepSpeed config in use (values may still be "auto"), {} when DeepSpeed runs with an unknown config, None
    without DeepSpeed."""
    from accelerate.state import AcceleratorState, DistributedType

    plugins = AcceleratorState._shared_state.get("deepspeed_plugins")  # one plugin, or a dict of named ones
    if isinstance(plugins, dict) and plugins:
        plugins = next((p for p in plugins.values() if getattr(p, "selected", False)), next(iter(plugins.values())))
    if plugins is not None:
        return plugins.deepspeed_config
    if getattr(args, "hf_deepspeed_config", None) is not None:
        return args.hf_deepspeed_config.config
    source = getattr(args, "deepspeed", None)
    from_env = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if not source and from_env:
        source = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if source == "none":
            prefix = "ACCELERATE_DEEPSPEED_"
            return {"zero_optimization": {
                "stage": int(os.environ.get(prefix + "ZERO_STAGE", 2)),
                "offload_optimizer": {"device": os.environ.get(prefix + "OFFLOAD_OPTIMIZER_DEVICE", "none")},
                "offload_param": {"device": os.environ.get(prefix + "OFFLOAD_PARAM_DEVICE", "none")},
            }}
    if isinstance(source, dict):
        return source
    if source:
        return json.loads(Path(source).read_text()) if Path(source).is_file() else {}
    return {} if AcceleratorState._shared_state.get("distributed_type") == DistributedType.DEEPSPEED else None


def _enabled(deepspeed: dict, precision: str, args) -> bool:
    value = (deepspeed.get(precision) or {}).get("enabled", False)
    return bool(getattr(args, precision, False)) if value == "auto" else bool(value)


def _fsdp_setup(args) -> tuple[int | None, bool]:
    """(FSDP version or None without FSDP, CPU offload)."""
    from accelerate.state import AcceleratorState, DistributedType

    plugin = AcceleratorState._shared_state.get("fsdp_plugin")
    if plugin is not None:
        offload = plugin.cpu_offload
        return plugin.fsdp_version, type(offload).__name__ == "CPUOffloadPolicy" or bool(
            getattr(offload, "offload_params", False))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return (int(os.environ.get("FSDP_VERSION", "1")),
                os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in ("true", "1", "yes"))
    fsdp = getattr(args, "fsdp", None)
    if fsdp:
        config = getattr(args, "fsdp_config", None) or {}
        options = fsdp if isinstance(fsdp, list | tuple) else str(fsdp).split()
        return int(config.get("version", config.get("fsdp_version", 1))), "offload" in [str(o) for o in options]
    if AcceleratorState._shared_state.get("distributed_type") == DistributedType.FSDP:
        return int(os.environ.get("FSDP_VERSION", "1")), False
    return None, False
