"""A recipe's arguments as its `__main__` takes them, for tests: parsed by its parser, then checked by what its `main`
runs first (`hfl3.trainers.cli.setup.set_up_pretraining` / `set_up_sft`)."""

from hfl3.trainers.cli.arguments import parse_recipe_args, parsed_secrets
from hfl3.trainers.cli.exits import recipe_exits
from hfl3.trainers.pretraining.config import PretrainConfig
from hfl3.trainers.cli.setup import set_up_pretraining, set_up_sft


def parse_and_set_up(recipe, args) -> tuple:
    """`(script_args, training_args, model_args, setup)` for `args` given to `recipe` (the module of
    `recipes/pretrain.py` or `recipes/sft_lora.py`); what the parser or the checks refuse is raised (the checks'
    refusals as `hfl3.trainers.cli.arguments.ArgumentsError`, a `ValueError`)."""
    parser, args = recipe.make_parser(), list(args)
    parsed = parser.parse_args_and_config(args)
    set_up = set_up_pretraining if isinstance(parsed[1], PretrainConfig) else set_up_sft
    return (*parsed, set_up(*parsed, parser.given_arguments(args)))


def set_up_recipe(recipe, args) -> tuple:
    """`parse_and_set_up`, where a refused argument ends as the recipe ends: `SystemExit(2)` after argparse's usage
    line and one line on stderr, whether the parser or the checks refused it."""
    parser, args = recipe.make_parser(), list(args)
    with recipe_exits(parser.prog, parser.format_usage()) as ending:
        parsed = parse_recipe_args(parser, args)
        ending.secrets = tuple(parsed_secrets(*parsed))
        set_up = set_up_pretraining if isinstance(parsed[1], PretrainConfig) else set_up_sft
        return (*parsed, set_up(*parsed, parser.given_arguments(args)))


def recipe_main(recipe, args) -> tuple:
    """`recipe.main` on `args` as its `__main__` calls it (parsed, then `main(*parsed, given=...)`, which checks them
    first), in this process and without `recipe_exits`: `(what main returned, (script_args, training_args,
    model_args))`."""
    parser, args = recipe.make_parser(), list(args)
    parsed = parse_recipe_args(parser, args)
    return recipe.main(*parsed, given=parser.given_arguments(args)), parsed
