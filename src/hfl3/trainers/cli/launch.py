"""How a recipe was launched: accelerate's setup checked against the launch (`check_launch`; the launch itself is read
by `hfl3.optim.launch.Launch`, as for Muon's refusal), the gloo process group of a `--use_cpu` launch set up with
`--ddp_timeout` (`ProcessGroupTimeout`), and the recipes' log format. Their arguments are parsed by
`hfl3.trainers.cli.arguments` and checked by `hfl3.trainers.cli.setup`; how every multi-process entry point ends is
`hfl3.distributed.end_distributed_run`."""

import logging
from functools import cached_property

from hfl3.optim.launch import Launch

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The recipes' log lines (`logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)` in their `__main__`)."""


# The distributed types of a process that FSDP runs in: accelerate 1.15 turns FSDP on (`AcceleratorState.__init__`,
# accelerate/state.py) only for the multi-device accelerator types, and then records "FSDP" as the type (which a
# second run in the same process reads). For CPU processes (MULTI_CPU, NO) it silently leaves FSDP off.
FSDP_DISTRIBUTED_TYPES = frozenset({"FSDP", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                                    "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"})
CPU_DDP = "on a CPU machine use accelerate_configs/multi_cpu_ddp.yaml with --use_cpu (DDP over gloo)"


class LaunchError(RuntimeError):
    """The processes that `accelerate launch` started are not set up as its config file asks; the message names
    the config and the fix. A launched recipe ends with it as one line and exit status 2
    (`hfl3.trainers.cli.exits.recipe_exits`)."""


def launch_problem(requested: str, distributed_type: str, world_size: int, launched: int) -> str | None:
    """What is wrong with a launch, or None when accelerate set up what was asked for.

    Args:
        requested: what the launch asked for: `"fsdp"` (an FSDP config, `ACCELERATE_USE_FSDP`, or `--fsdp`),
            `"deepspeed"` (a DeepSpeed config or `--deepspeed`), or `"ddp"` (anything else; DDP when several
            processes were launched).
        distributed_type: the `accelerate.DistributedType` value that accelerate set up in this process
            (`"NO"`, `"MULTI_CPU"`, `"MULTI_GPU"`, `"DEEPSPEED"`, ...).
        world_size: the number of processes in the process group that was set up.
        launched: the number of processes the launcher started (`WORLD_SIZE`, 1 without a launcher).

    Returns:
        A one-line message naming what was set up instead and the fix, or None.
    """
    if requested == "fsdp" and distributed_type not in FSDP_DISTRIBUTED_TYPES:
        instead = {"MULTI_CPU": "plain DDP", "NO": "separate processes without FSDP"}.get(distributed_type,
                                                                                       distributed_type)
        return (f"FSDP (accelerate_configs/fsdp2.yaml) was launched but accelerate set up {instead} "
                f"(distributed type {distributed_type}): accelerate 1.15 shards with FSDP only on GPUs; {CPU_DDP}, "
                "or run fsdp2.yaml on a CUDA machine")
    if launched != world_size:
        fix = ("add --ddp_backend gloo" if requested == "deepspeed" else
               "add --use_cpu (DDP over gloo, accelerate_configs/multi_cpu_ddp.yaml)")
        return (f"{launched} processes were launched but accelerate set up world size {world_size}: each would train "
                f"alone on all the data and write the same output folder; on a CPU machine {fix}")
    if world_size > 1 and distributed_type == "NO":
        return (f"{launched} processes were launched but accelerate set them up without DDP (distributed type NO): "
                f"no gradient all-reduce, each process would train its own copy; {CPU_DDP} (--ddp_backend gloo "
                "alone does not set up DDP without CUDA)")
    return None


def check_launch(training_args) -> int:
    """Log the distributed setup and refuse one that is not what was launched, before any data or model work.

    On a machine without CUDA, accelerate 1.15 silently sets up something else than some launches ask for (each file
    of accelerate_configs/ launched on a CPU machine, with and without --use_cpu / --ddp_backend gloo; dev/LOG.md,
    2026-11-24): fsdp2.yaml trains as plain DDP with --use_cpu, as unsynchronised copies with --ddp_backend gloo, and
    as separate single processes without either; a multi-process config without a CPU flag gives each process world
    size 1 (each would train alone on all the data and write the same output folder); multi_gpu.yaml /
    multi_cpu_ddp.yaml with --ddp_backend gloo instead of --use_cpu form a world of 2 without DDP (no gradient
    all-reduce). zero2/zero3.yaml run DeepSpeed with --ddp_backend gloo and with --use_cpu alike.

    Args:
        training_args: the recipe's `TrainingArguments`, parsed; what was launched and set up is
            `hfl3.optim.launch.Launch`'s reading of it (`distributed_state`, `world_size`, `fsdp`, `deepspeed`, the
            launcher's variables).

    Returns:
        The world size.

    Raises:
        LaunchError: the setup differs from the launch (`launch_problem`'s message).
    """
    launch = Launch(training_args)
    logger.info("world size %d (%s, accelerate distributed type %s)", launch.world_size, training_args.parallel_mode,
                launch.distributed_type)
    problem = launch_problem(launch.requested, launch.distributed_type, launch.world_size, launch.launched)
    if problem:
        raise LaunchError(problem)
    return launch.world_size


def set_up_process_group(training_args) -> None:
    """Set up the process group of a `--use_cpu` launch (DDP over gloo) with `--ddp_timeout`, before transformers
    sets it up without: transformers 5.23 passes the timeout to accelerate's `PartialState` on every path but
    `use_cpu`, so torch's 30 minutes applied and a rank whose peer is lost or frozen waited that long. accelerate's
    `PartialState` is the one that sets it up (its `timeout` reaches `torch.distributed.init_process_group`);
    transformers then finds the group initialized and keeps it. `ProcessGroupTimeout` calls it where transformers
    sets up the devices; without a launch of several processes it does nothing."""
    import datetime

    import torch.distributed
    from accelerate import PartialState

    if training_args.use_cpu and Launch(training_args).launched > 1 and not torch.distributed.is_initialized():
        PartialState(cpu=True, backend=training_args.ddp_backend,
                     timeout=datetime.timedelta(seconds=training_args.ddp_timeout))


class ProcessGroupTimeout:
    """A base of the recipes' `TrainingArguments` (before the transformers class): `--ddp_timeout` acts with
    `--use_cpu` too. It overrides `TrainingArguments._setup_devices` (transformers 5.23's private `cached_property`
    that sets up the devices and, in a launch, the process group; `tests/test_trainer_hooks.py` pins it), so that the
    group is set up there with the timeout (`set_up_process_group`) and not by the arguments' `__post_init__`:
    constructing the arguments sets up the devices, as in every TRL script, and hfl3 adds no other work to it."""

    @cached_property
    def _setup_devices(self):
        from transformers import TrainingArguments

        set_up_process_group(self)
        return TrainingArguments._setup_devices.func(self)

