"""How a recipe is started, shared by `recipes/pretrain.py` and `recipes/sft_lora.py`: its arguments parsed with one
clear message on a bad one, and checks on how it was launched."""

import argparse
import logging
import os
from collections.abc import Sequence

import yaml

logger = logging.getLogger(__name__)


def add_config_argument(parser):
    """Document `--config FILE` in the recipe's `--help`, first among the options, and shorten the usage line to
    `usage: PROG [--config FILE] [options] (--help lists them)` (argparse's would list every option, hundreds of lines,
    also above each error message). `TrlParser.parse_args_and_config` takes `--config` out of the arguments itself
    before argparse sees them, so the argument only shows in the help (`default=SUPPRESS`: it never reaches the
    parsed dataclasses). The recipe's dataclasses carry `_argument_group_name`, so each is its own group of options
    listed after this one, in the parser's order.

    Returns:
        `parser`.
    """
    parser.usage = "%(prog)s [--config FILE] [options] (--help lists them)"
    parser.add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS,
        help="YAML file of option values (recipes/configs/*.yaml); options given on the command line override it",
    )
    return parser


def parse_recipe_args(parser, args: Sequence[str] | None = None) -> tuple:
    """`parser.parse_args_and_config(args)` (a TRL `TrlParser`: `--config FILE`, then command-line overrides), where
    a bad argument stops the program with one message instead of a traceback: the usage line (short, from
    `add_config_argument`), then `PROG: error: <what is wrong>`, exit status 2 (argparse's convention).

    Bad arguments: those argparse rejects (an invalid value, a missing one), flags no argument class declares, a
    `--config` file that cannot be read or is not a YAML mapping, and values an argument class rejects in its
    `__post_init__` (`ValueError`/`TypeError`, e.g. `--eval_strategy bogus`).

    Args:
        parser: the recipe's `TrlParser`, through `add_config_argument`.
        args: the arguments (default: `sys.argv[1:]`).

    Returns:
        The parsed dataclasses, as `parse_args_and_config` returns them.
    """
    try:
        return parser.parse_args_and_config(args)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as error:
        parser.error(str(error))


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
