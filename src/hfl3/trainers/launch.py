"""Checks on how a recipe was launched, shared by `recipes/pretrain.py` and `recipes/sft_lora.py`."""

import logging
import os

logger = logging.getLogger(__name__)


def check_world_size(training_args) -> int:
    """Log the world size and fail when it differs from the number of processes `accelerate launch` started.

    Without CUDA, accelerate 1.15 sets up a multi-GPU config as one process group per process (world size 1 each),
    so every process would train alone on the full data and write the same output folder; DESIGN.md "Known traps".

    Args:
        training_args: the recipe's `TrainingArguments` (`world_size`, `parallel_mode`).

    Returns:
        The world size.

    Raises:
        RuntimeError: `WORLD_SIZE` (set by the launcher) differs from `training_args.world_size`.
    """
    logger.info("world size %d (%s)", training_args.world_size, training_args.parallel_mode)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != training_args.world_size:
        raise RuntimeError(
            f"{launched} processes were launched but accelerate set up world size {training_args.world_size}: on a "
            "CPU machine add --use_cpu (DDP, accelerate_configs/multi_cpu_ddp.yaml) or --ddp_backend gloo "
            "(DeepSpeed zero2/zero3.yaml)"
        )
    return training_args.world_size
