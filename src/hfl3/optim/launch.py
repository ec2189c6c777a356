"""What `accelerate launch` (or the `TrainingArguments`) set up for this process, read in one place (`Launch`), and
the distributed setups `MuonAdamW` cannot run under, refused before training (`refuse_unsupported_sharding`).
ZeRO-1/2/3 and FSDP2 themselves run (`hfl3.optim.sharded`).

`Launch` lives in `optim/` because the optimizer imports nothing else of hfl3 (docs/design.md, Layers) and needs the
DeepSpeed config and the FSDP version for its refusal; the trainer layer, which may import the optimizer, reads the
launch through it too (`hfl3.trainers.cli.launch.check_launch`), so every fact of the launch is read by one piece of code.
"""

import json
import os
from functools import cached_property
from pathlib import Path


class Launch:
    """The launch of this process, each fact read on first use from accelerate's state (once an `Accelerator`
    exists, e.g. after `Trainer.__init__`), else from the variables that `accelerate launch` sets
    (`ACCELERATE_USE_DEEPSPEED` and `ACCELERATE_DEEPSPEED_*`, `ACCELERATE_USE_FSDP` and `FSDP_*`, `WORLD_SIZE`) and
    from `args` (`deepspeed` / `hf_deepspeed_config`, `fsdp` / `fsdp_config`, `distributed_state`, `world_size`).

    Args:
        args: a `TrainingArguments` (or any object with the attributes above that a reader uses).
    """

    def __init__(self, args):
        self.args = args

    @cached_property
    def distributed_type(self) -> str:
        """The `accelerate.DistributedType` value the arguments' process state set up (`"NO"`, `"MULTI_CPU"`,
        `"DEEPSPEED"`, ...)."""
        return self.args.distributed_state.distributed_type.value

    @cached_property
    def world_size(self) -> int:
        """The number of processes in the process group that was set up (`args.world_size`)."""
        return self.args.world_size

    @cached_property
    def launched(self) -> int:
        """The number of processes the launcher started (`WORLD_SIZE`, 1 without a launcher)."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @cached_property
    def deepspeed_config(self) -> dict | None:
        """The DeepSpeed config in use (values may still be "auto"), {} when DeepSpeed runs with an unknown config,
        None without DeepSpeed."""
        from accelerate.state import AcceleratorState, DistributedType

        args = self.args
        plugins = AcceleratorState._shared_state.get("deepspeed_plugins")  # one plugin, or a dict of named ones
        if isinstance(plugins, dict) and plugins:
            plugins = next((p for p in plugins.values() if getattr(p, "selected", False)), next(iter(plugins.values())))
        if plugins is not None:
            return plugins.deepspeed_config
        if getattr(args, "hf_deepspeed_config", None) is not None:
            return args.hf_deepspeed_config.config
        source = getattr(args, "deepspeed", None)
        if not source and _flag("ACCELERATE_USE_DEEPSPEED"):
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

    @cached_property
    def fsdp(self) -> tuple[int | None, bool]:
        """(the FSDP version, None without FSDP; whether FSDP offloads the parameters to CPU)."""
        from accelerate.state import AcceleratorState, DistributedType

        plugin = AcceleratorState._shared_state.get("fsdp_plugin")
        if plugin is not None:
            offload = plugin.cpu_offload
            return plugin.fsdp_version, type(offload).__name__ == "CPUOffloadPolicy" or bool(
                getattr(offload, "offload_params", False))
        if _flag("ACCELERATE_USE_FSDP"):
            return int(os.environ.get("FSDP_VERSION", "1")), _flag("FSDP_OFFLOAD_PARAMS")
        fsdp = getattr(self.args, "fsdp", None)
        if fsdp:
            config = getattr(self.args, "fsdp_config", None) or {}
            options = fsdp if isinstance(fsdp, list | tuple) else str(fsdp).split()
            return int(config.get("version", config.get("fsdp_version", 1))), "offload" in [str(o) for o in options]
        if AcceleratorState._shared_state.get("distributed_type") == DistributedType.FSDP:
            return int(os.environ.get("FSDP_VERSION", "1")), False
        return None, False

    @property
    def requested(self) -> str:
        """What the launch asked for: `"fsdp"` (an FSDP config, `ACCELERATE_USE_FSDP`, or `--fsdp`), `"deepspeed"` (a
        DeepSpeed config or `--deepspeed`), or `"ddp"` (anything else; DDP when several processes were launched)."""
        if self.fsdp[0] is not None:
            return "fsdp"
        return "deepspeed" if self.deepspeed_config is not None else "ddp"


def refuse_unsupported_sharding(args) -> None:
    """Raise `RuntimeError`, naming the reason and the alternative, for a distributed setup in which `MuonAdamW`
    would not run as Muon: DeepSpeed with an `optimizer` block in its config (DeepSpeed then builds that optimizer
    and never calls the Trainer's), ZeRO offload of the optimizer or the parameters, ZeRO stage 0 with bf16/fp16
    (DeepSpeed's own flattening optimizer), ZeRO++ hpZ / MiCS partitions, elastic ZeRO checkpoints, FSDP1, FSDP2 with
    CPU offload. One process, DDP, DeepSpeed ZeRO-1/2/3 and FSDP2 pass (`hfl3.optim.sharded` runs the last two).

    The setup is `Launch(args)`'s. `create_muon_optimizer` calls it; a Trainer that picks Muon from a config must call
    it in `__init__` too (hfl3's trainers: `hfl3.trainers.optimizers.OptimizerSetup`), because with an `optimizer`
    block the Trainer never calls `create_optimizer`.
    """
    problems = []
    launch = Launch(args)
    deepspeed = launch.deepspeed_config
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
    fsdp_version, fsdp_offload = launch.fsdp
    if fsdp_version == 1:
        problems.append("FSDP1: its FlatParameters hand the optimizer flattened pieces of several matrices. Use FSDP2 "
                        "(accelerate_configs/fsdp2.yaml, fsdp_version: 2)")
    if fsdp_version == 2 and fsdp_offload:
        problems.append("FSDP2 with CPU offload: the optimizer step then runs on CPU shards, which Muon's sharded "
                        "step does not support. Drop fsdp_offload_params, or use AdamW with offload")
    if problems:
        raise RuntimeError("MuonAdamW cannot run under this setup: " + "; ".join(problems) + ".")


def _enabled(deepspeed: dict, precision: str, args) -> bool:
    value = (deepspeed.get(precision) or {}).get("enabled", False)
    return bool(getattr(args, precision, False)) if value == "auto" else bool(value)


def _flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")
