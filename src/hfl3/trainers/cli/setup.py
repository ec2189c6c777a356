"""What a recipe's `main` does first, on the arguments its parser returned: `set_up_pretraining` and `set_up_sft`
check the launch, that every rank was given the same arguments, and the recipe's inputs (`check_pretrain_inputs`,
`check_sft_inputs`: paths, Hub ids, the output folder and resume checkpoint, the evaluation), and return what the
checks decided (`RunSetup`) for the builder. Parsing itself only parses (`hfl3.trainers.cli.arguments.RecipeParser`): this
is where the collectives, the disk and the Hub are first touched.

A refused argument is an `ArgumentsError`: the recipe ends as for an argument argparse refuses, argparse's usage line
then `PROG: error: <one line>`, exit status 2 (`hfl3.trainers.cli.exits.recipe_exits`); the same line on every rank
(`hfl3.distributed.on_all_ranks`), so that no rank is left waiting for the others.
"""

from __future__ import annotations

from collections.abc import Callable

from hfl3.distributed import check_same_on_all_ranks, on_all_ranks, rank
from hfl3.trainers.cli.arguments import (ArgumentsError, RunSetup, check_pretrain_inputs, check_sft_inputs,
                                    launch_arguments)
from hfl3.trainers.cli.exits import record_output
from hfl3.trainers.cli.launch import check_launch


def set_up_pretraining(script_args, training_args, model_args, given: frozenset[str] = frozenset()) -> RunSetup:
    """`recipes/pretrain.py`'s arguments checked before any work (`check_pretrain_inputs`), on every rank.

    Args:
        script_args, training_args, model_args: as `make_parser().parse_args_and_config()` returned them.
        given: the fields the user set (`RecipeParser.given_arguments`), for the flags that cannot act.

    Returns:
        The `RunSetup`: the output folder (None for a dry run) and the evaluation.

    Raises:
        LaunchError: accelerate set up something else than was launched (`check_launch`).
        ArgumentsError: a refused argument (one line).
    """
    return _set_up(check_pretrain_inputs, (script_args, training_args, model_args), given)


def set_up_sft(script_args, training_args, model_args, given: frozenset[str] = frozenset()) -> RunSetup:
    """`recipes/sft_lora.py`'s arguments checked before any work (`check_sft_inputs`), on every rank. Arguments,
    returns and raises as `set_up_pretraining`'s; the `RunSetup` also holds what a full fine-tuning takes from its
    base."""
    return _set_up(check_sft_inputs, (script_args, training_args, model_args), given)


def _set_up(check: Callable[..., RunSetup], parsed: tuple, given: frozenset[str]) -> RunSetup:
    check_launch(parsed[1])  # refuse a distributed setup that accelerate silently replaced
    try:
        check_same_on_all_ranks(launch_arguments(parsed), "the arguments", "start every machine with the same "
                                "command line (only accelerate's --machine_rank differs)")
        setup = on_all_ranks(lambda: check(*parsed, given=given))[rank()]
    except (ValueError, TypeError, OSError) as error:
        raise ArgumentsError(str(error)) from None
    record_output(setup.output)  # a failure or Ctrl-C from here on cleans the staging area and says what was saved
    return setup
