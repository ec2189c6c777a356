"""A recipe's arguments: parsed (`RecipeParser`, `parse_recipe_args`: `--config FILE` then the command line, a bad
argument in one line with exit status 2; parsing only parses) and checked once, in one pass, before any heavy work,
by the first call of the recipe's `main` (`hfl3.trainers.cli.setup.set_up_pretraining`, `set_up_sft`). The checks return
what they decide (`RunSetup`: the resolved output folder, whether and when the run evaluates); the recipe's builder
applies it. They never change the arguments they check. Every function here takes a recipe's arguments in the
parser's order: (script, training, model), TRL's.

Which check lives where, and why:
- here, run on every rank by `set_up_*` (`check_pretrain_inputs`, `check_sft_inputs`): every path and name given
  (the output folder, the resume checkpoint, corpora, datasets, models, tokenizers, templates), combinations of
  arguments, and what a flag cannot do in this recipe;
- in the argument classes' `__post_init__` (`check_training_arguments` and the classes' own): values that need no
  other argument, so that a `PretrainConfig` or `ChatSFTConfig` built in Python is refused the same way;
- first in `set_up_*` (`hfl3.trainers.cli.launch.check_launch`): the launch as accelerate set it up, which needs the
  process group;
- when the run's optimizer is built (`hfl3.trainers.optimizers.OptimizerSetup`:
  `hfl3.optim.refuse_unsupported_sharding`, in the builders before any data work) and when the Trainer exists (`hfl3.fp8.check_ao_backend`): what Muon or
  accelerate's FP8 backend cannot run under, read from the launch (`hfl3.optim.launch.Launch`) and the model.
How a value typed into a recipe is read and checked (a file, a folder, a Hub id): `hfl3.trainers.cli.inputs`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from transformers.trainer_utils import IntervalStrategy
from trl import TrlParser

from hfl3.data.sft_sources import check_jsonl_file
from hfl3.errors import InputError
from hfl3.evaluate import check_core_bundle
from hfl3.evaluate.chat_callback import check_chatcore_setup
from hfl3.provenance.hub import is_hub_id
from hfl3.provenance.portable import REDACTED, is_secret, redact
from hfl3.trainers.sft.base_model import check_model_flags
from hfl3.trainers.cli.flag_checks import OPTIMIZER_BOUNDS, refuse_flags, with_choices
from hfl3.trainers.cli.inputs import (MODEL, MODEL_FILES, TOKENIZER, TOKENIZER_FILES, check_corpus, check_file,
                                 check_hub_repo, check_model_folder, check_pretrained, check_sft_dataset,
                                 check_tokenizer_folder)
from hfl3.trainers.outputs import OutputFolder, base_model_hub_id, prepare_output_dir
from hfl3.trainers.sft.base_model import check_quantization_arguments
from hfl3.trainers.sft.inheritance import decide_from_base

logger = logging.getLogger(__name__)

PER_MACHINE_ARGUMENTS = frozenset({"output_dir", "logging_dir", "local_rank", "resume_from_checkpoint"})
"""Arguments that may differ between machines: where each writes (only machine 0 keeps outputs), and the checkpoint,
which global rank 0 resolves for all (`hfl3.trainers.outputs.prepare_output_dir`)."""


class ArgumentsError(InputError):
    """An argument a recipe's checks refused (a path that does not exist, a combination that cannot act:
    `hfl3.trainers.cli.setup`): one line naming the argument, the value and what was expected, which the recipe shows
    under argparse's usage line with exit status 2, as for an argument argparse refuses (`recipe_exits`)."""


@dataclass(frozen=True)
class Evaluation:
    """Whether a run evaluates, decided once from its arguments and data (`decide_evaluation`).

    Attributes:
        enabled: the run evaluates (during training as `eval_strategy` says, and at the end).
        on_start: it evaluates at step 0 too, inside `train()` (`eval_on_start`).
    """

    enabled: bool
    on_start: bool


@dataclass(frozen=True)
class RunSetup:
    """What the checks of a recipe's arguments decided, carried into its builder (`hfl3.trainers.cli.setup`'s
    `set_up_pretraining` and `set_up_sft` return it).

    Attributes:
        output: where the run writes (`hfl3.trainers.outputs.prepare_output_dir`); None for a dry run.
        evaluation: whether and when it evaluates.
        settings: training arguments the checks decided, `{name: (value, source)}` (SFT: what a full fine-tuning
            takes from its base, `hfl3.trainers.sft.inheritance`); the builder sets and logs each.
        optimizer_state: a saved optimizer state to warm-start from (`--load_optimizer`), or None.
    """

    output: OutputFolder | None
    evaluation: Evaluation
    settings: dict = dataclasses.field(default_factory=dict)
    optimizer_state: Path | None = None


class RecipeParser(TrlParser):
    """TRL's `TrlParser` (`--config FILE`, then the command line) over a recipe's argument classes, in TRL's order
    (script, training, model): `parse_args_and_config` returns the parsed dataclasses and nothing else; it reads no
    file but the `--config` one, and needs no process group and no Hub (checking the values is the first thing the
    recipe's `main` does, `hfl3.trainers.cli.setup`).

    `--config FILE` is documented in `--help`, first among the options, and the usage line is short:
    `usage: PROG [--config FILE] [options] (--help lists them)` (argparse's would list every option, hundreds of
    lines, also above each error message). `TrlParser.parse_args_and_config` takes `--config` out of the arguments
    itself before argparse sees them, so the argument only shows in the help (`default=SUPPRESS`: it never reaches
    the parsed dataclasses). The recipe's dataclasses carry `_argument_group_name`, so each is its own group of
    options listed after this one, in the parser's order."""

    def __init__(self, dataclass_types: Sequence[type]):
        super().__init__(dataclass_types)
        self.usage = "%(prog)s [--config FILE] [options] (--help lists them)"
        self.add_argument(
            "--config", metavar="FILE", default=argparse.SUPPRESS,
            help="YAML file of option values (recipes/configs/*.yaml); options given on the command line override it",
        )

    def given_arguments(self, args: Sequence[str]) -> frozenset[str]:
        """The fields `args` set explicitly: keys of the `--config` YAML file and options on the command line
        (`--name`, `--name=value`, `--no_name`), by field name. A check tells a value the user chose from a default
        with it (a value equal to the default, given, counts as given)."""
        return frozenset(self._given_values(args))

    def secret_values(self, args: Sequence[str]) -> list[str]:
        """The values `args` give to fields that hold credentials (`is_secret`: `--hub_token`), on the command line
        or in the `--config` file, for `redact`."""
        return [str(value) for name, values in self._given_values(args).items() if is_secret(name)
                for value in values if value not in (None, "")]

    def _given_values(self, args: Sequence[str]) -> dict[str, list]:
        """`{field name: [the values args give it]}` (an option without its value: none listed)."""
        given: dict[str, list] = {}
        if "--config" in args and args.index("--config") + 1 < len(args):
            with contextlib.suppress(OSError, yaml.YAMLError):  # the parser reports an unreadable file itself
                config = yaml.safe_load(Path(args[args.index("--config") + 1]).read_text())
                for name, value in (config.items() if isinstance(config, dict) else ()):
                    if name != "env":
                        given.setdefault(name, []).append(value)
        for index, token in enumerate(args):
            option, equals, value = token.partition("=") if token.startswith("--") else (token, "", "")
            action = self._option_string_actions.get(option) if token.startswith("--") else None
            if action is not None and action.dest not in ("help", "config"):
                following = args[index + 1] if not equals and index + 1 < len(args) else None
                shown = value if equals else following if following and not following.startswith("--") else None
                given.setdefault(action.dest, []).extend([shown] if shown is not None else [])
        return given


def launch_arguments(parsed: Sequence) -> dict[str, str]:
    """The parsed arguments (dataclass fields given at construction) as `{name: JSON text}`, without
    `PER_MACHINE_ARGUMENTS`: what every machine of a launch must agree on. A credential (`is_secret`) is compared by
    its sha256 (`<redacted sha256:...>`), so that a message naming a difference never shows it."""
    def shown(name: str, value) -> str:
        text = json.dumps(value, default=str, sort_keys=True)
        if not is_secret(name) or value is None:
            return text
        return f"{REDACTED} (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})"

    return {field.name: shown(field.name, getattr(values, field.name)) for values in parsed
            for field in dataclasses.fields(values) if field.init and field.name not in PER_MACHINE_ARGUMENTS}


def parsed_secrets(*parsed) -> list[str]:
    """The values of the parsed arguments' fields that hold credentials (`is_secret`), for `redact`."""
    return [str(getattr(values, field.name)) for values in parsed for field in dataclasses.fields(values)
            if is_secret(field.name) and isinstance(getattr(values, field.name), str)]


def parse_recipe_args(parser, args: Sequence[str] | None = None) -> tuple:
    """`parser.parse_args_and_config(args)` (a TRL `TrlParser`: `--config FILE`, then command-line overrides), where
    a bad argument stops the program with one message instead of a traceback: the usage line (short, from
    `RecipeParser`), then `PROG: error: <what is wrong>`, exit status 2 (argparse's convention).

    Bad arguments: those argparse rejects (an invalid value, a missing one), flags no argument class declares, a
    `--config` file that cannot be read or is not a YAML mapping, and values an argument class rejects in its
    `__post_init__` (`ValueError`/`TypeError`, e.g. `--eval_strategy bogus`). The message never shows a credential:
    the values given to fields that hold one (`--hub_token`) and any `hf_...` token are `<redacted>`. What the
    recipe's checks refuse later (`hfl3.trainers.cli.setup.ArgumentsError`) ends the same way, through
    `hfl3.trainers.cli.exits.recipe_exits`.

    Args:
        parser: the recipe's `RecipeParser`.
        args: the arguments (default: `sys.argv[1:]`).

    Returns:
        The parsed dataclasses, in the parser's order (script, training, model).
    """
    args = list(args) if args is not None else sys.argv[1:]
    try:
        return parser.parse_args_and_config(args)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as error:
        parser.error(redact(str(error), parser.secret_values(args)))


def check_training_arguments(args) -> None:
    """Refuse arguments that would train nothing or the wrong way, before any data work (call it from a
    `TrainingArguments` subclass's `__post_init__`, so that `parse_recipe_args` shows it as an argument error).

    Raises:
        ValueError: a value of `OPTIMIZER_BOUNDS` outside its range (`learning_rate <= 0`, a negative `--matrix_lr`,
            `--adam_beta2 1`, ...); `max_steps` 0 or below -1 (-1, the default, trains `num_train_epochs` epochs, or in
            pretraining sizes the run by the compute-optimal dial: `max_steps_meaning`); `num_train_epochs <= 0`
            with `max_steps = -1`.
    """
    for name, bounds in OPTIMIZER_BOUNDS.items():
        value = getattr(args, name, None)
        if value is not None and not bounds.holds(value):
            raise ValueError(f"{name}={value}: expected {bounds.expected} ({bounds.why}); e.g. --{name} "
                             f"{bounds.example}")
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(f"max_steps={args.max_steps}: expected a positive number of optimizer steps, or -1 (the "
                         f"default) {getattr(args, 'max_steps_meaning', 'to train --num_train_epochs epochs')}")
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        raise ValueError(f"num_train_epochs={args.num_train_epochs} with max_steps=-1 trains nothing: pass a "
                         "positive --num_train_epochs or --max_steps")


def check_pretrain_inputs(script_args, training_args, model_args, given: frozenset[str] = frozenset()) -> RunSetup:
    """`recipes/pretrain.py`'s arguments, checked by `set_up_pretraining` on every rank: the output folder, resume
    checkpoint and push (`prepare_output_dir`), the corpora, the CORE bundle and the tokenizer. A dry run reads no
    data and leaves the output folder alone: only its tokenizer is checked.

    Returns:
        The `RunSetup`: the output folder (None for a dry run) and the evaluation (`decide_evaluation`; the
        validation rows always exist).

    Raises:
        ValueError, OSError: one line naming the argument, the value and what was expected.
    """
    refuse_flags("pretrain", given, script_args, training_args, model_args)
    output = None
    if not script_args.dry_run:
        output = prepare_output_dir(training_args)
        check_corpus("dataset", script_args.dataset)
        if script_args.eval_dataset:
            check_corpus("eval_dataset", script_args.eval_dataset)
        check_core_bundle(training_args)
    if tokenizer := script_args.tokenizer_name_or_path:
        check_pretrained("tokenizer_name_or_path", tokenizer, TOKENIZER, TOKENIZER_FILES)
        if Path(tokenizer).is_dir():
            check_tokenizer_folder("tokenizer_name_or_path", tokenizer)
    resuming = bool(output and output.resume_checkpoint)
    return RunSetup(output, decide_evaluation(training_args, has_eval_data=True, resuming=resuming))


def decide_evaluation(training_args, has_eval_data: bool, resuming: bool) -> Evaluation:
    """Whether and when a run evaluates, one rule for both recipes: it evaluates when it has evaluation data and
    `--eval_strategy` is not `no`; at step 0 too (inside `train()`) when `--eval_on_start` says so, or, left unset,
    unless it resumes. A configuration that defaults to evaluating (`evaluate_by_default`: the SFT recipe's
    `eval_strategy` left unset) trains without evaluating when there is no evaluation data, and one log line says
    so.

    Raises:
        ValueError: an evaluation strategy, best-model loading or step-0 evaluation asked for without evaluation
            data; early stopping without evaluation (data, a strategy other than `no`, and best-model loading). A
            value the configuration chose for the user that the message names is said to be one (`hfl3_choices`,
            `hfl3.trainers.cli.flag_checks.with_choices`).
    """
    strategy = IntervalStrategy(training_args.eval_strategy)
    choices = getattr(training_args, "hfl3_choices", {})  # values a refusal must say hfl3 chose (ChatSFTConfig)
    if not has_eval_data and getattr(training_args, "evaluate_by_default", False):
        logger.info("no --dataset_test_split, --val_split or --eval_file: training without evaluation (no "
                    "best-model selection)")
        strategy = IntervalStrategy.NO
    elif not has_eval_data and strategy != IntervalStrategy.NO:
        raise ValueError(with_choices(f"eval_strategy={strategy.value} needs --dataset_test_split, --val_split or "
                                      "--eval_file", choices))
    enabled = has_eval_data and strategy != IntervalStrategy.NO
    if getattr(training_args, "early_stopping_patience", None) and not (enabled and
                                                                         training_args.load_best_model_at_end):
        raise ValueError(with_choices("--early_stopping_patience needs evaluation: evaluation data, an --eval_strategy "
                                      "other than no, and --load_best_model_at_end true", choices))
    if training_args.eval_on_start and not enabled:
        raise ValueError("--eval_on_start true needs evaluation: evaluation data and an --eval_strategy other than no")
    on_start = enabled and (not resuming if training_args.eval_on_start is None else training_args.eval_on_start)
    return Evaluation(enabled, on_start)


def apply_evaluation(training_args, evaluation: Evaluation) -> None:
    """Set `training_args` to `evaluation` (what `decide_evaluation` decided): `eval_on_start`, and without
    evaluation `eval_strategy` no, `do_eval` and best-model loading off. The builders call it once, before the
    Trainer is built."""
    training_args.eval_on_start = evaluation.on_start
    if not evaluation.enabled:
        training_args.eval_strategy, training_args.do_eval = IntervalStrategy.NO, False
        training_args.load_best_model_at_end = False


def check_sft_inputs(script_args, training_args, model_args, given: frozenset[str] = frozenset()) -> RunSetup:
    """`recipes/sft_lora.py`'s arguments, checked by `set_up_sft` on every rank: the flags that cannot act
    (`refuse_flags`), `prepare_output_dir` (output folder, resume checkpoint, a push's `--hub_model_id` and network),
    `check_sft_arguments`, the model and tokenizer (`check_sft_model`), then every other path and name given; a push
    needs a Hub id for the base model (`base_model_hub_id`).

    Returns:
        The `RunSetup`: the output folder, and the evaluation `decide_evaluation` decides.

    Raises:
        ValueError, OSError: one line naming the argument, the value and what was expected.
    """
    refuse_flags("sft_lora", given, script_args, training_args, model_args)
    output = prepare_output_dir(training_args)
    has_eval_data = check_sft_arguments(script_args, training_args, model_args)
    evaluation = decide_evaluation(training_args, has_eval_data, resuming=bool(output.resume_checkpoint))
    check_chatcore_setup(training_args)  # its data, and a ChatCORE metric_for_best_model
    check_sft_model(model_args, training_args)
    settings, optimizer_state = decide_from_base(model_args, training_args, given)
    for argument in ("train_file", "eval_file"):
        if getattr(script_args, argument):
            check_file(argument, getattr(script_args, argument), 'a chat JSONL file (one {"messages": [...]} per '
                       'line, or {"text": ...}; gzip-compressed too)')
            check_jsonl_file(getattr(script_args, argument), argument)  # Parquet, another compression, no record
    if script_args.dataset_name:
        splits = {"dataset_train_split": script_args.dataset_train_split or "train"}
        if script_args.dataset_test_split:
            splits["dataset_test_split"] = script_args.dataset_test_split
        check_sft_dataset(script_args.dataset_name, script_args.dataset_config, splits)
    model = model_args.model_name_or_path
    if model_args.base_model_hub_id:
        if not Path(model).is_dir():
            raise ValueError(f"--base_model_hub_id {model_args.base_model_hub_id}: only for a local "
                             f"--model_name_or_path; {model} is a Hub id already")
        if not is_hub_id(model_args.base_model_hub_id):
            raise ValueError(f"--base_model_hub_id {model_args.base_model_hub_id}: not a Hub repository id; expected "
                             "USER/NAME, the Hub repository of --model_name_or_path")
    if training_args.push_to_hub and base_model_hub_id(model, model_args.base_model_hub_id) is None:
        raise ValueError(f"--push_to_hub: the base model {model} is a local folder with no Hub id in its "
                         "metadata.json; pass --base_model_hub_id USER/NAME (its Hub repository), which the pushed "
                         "adapter_config.json and model card name")
    if training_args.push_to_hub and model_args.base_model_hub_id:
        check_hub_repo("base_model_hub_id", model_args.base_model_hub_id, "the Hub repository of "
                       "--model_name_or_path")
    return RunSetup(output, evaluation, settings, optimizer_state)


def check_sft_model(model_args, training_args) -> None:
    """The SFT recipe's model (`check_model_folder`, a GGUF file, or a Hub id), its tokenizer (with a chat template
    unless `--chat_template_path`: `check_tokenizer_folder`) and the flags that act on some models only
    (`hfl3.trainers.sft.base_model.check_model_flags`), before any data is read. Raises `ValueError` (one line)."""
    if training_args.chat_template_path:
        check_file("chat_template_path", training_args.chat_template_path, "a Jinja chat template file (applied "
                   "before tokenization)", suffixes=(".jinja", ".j2"))
    model, gguf, tokenizer = model_args.model_name_or_path, model_args.gguf_file, model_args.tokenizer_name_or_path
    if gguf and Path(model).is_dir():
        check_file("gguf_file", str(Path(model) / gguf), "a GGUF file inside --model_name_or_path", (".gguf",))
    check_pretrained("model_name_or_path", model, MODEL, [gguf] if gguf else MODEL_FILES, model_args.model_revision)
    if not gguf and Path(model).is_dir():
        check_model_folder("model_name_or_path", model)
    if tokenizer:
        check_pretrained("tokenizer_name_or_path", tokenizer, TOKENIZER, TOKENIZER_FILES)
    argument, folder = ("tokenizer_name_or_path", tokenizer) if tokenizer else ("model_name_or_path", model)
    if Path(folder).is_dir() and not (gguf and not tokenizer):
        check_tokenizer_folder(argument, folder, chat_template=not training_args.chat_template_path)
    check_model_flags(model_args, training_args)


def check_sft_arguments(script_args, training_args, model_args) -> bool:
    """Reject SFT argument combinations that would train something else than asked. Returns whether the run has
    evaluation data (`--dataset_test_split`, `--val_split` or `--eval_file`).

    Raises:
        ValueError: no model; no or two data sources (or two evaluation sources); `dataset_*` options without
            `--dataset_name`; Muon with LoRA; `--merge` without LoRA; quantization flags that cannot act
            (`hfl3.trainers.sft.base_model.check_quantization_arguments`).
    """
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required (a folder, a Hub id, or the folder of --gguf_file)")
    sources = [name for name in ("dataset_name", "train_file", "stdlib_chats") if getattr(script_args, name)]
    if len(sources) != 1:
        raise ValueError("give exactly one of --dataset_name, --train_file and --stdlib_chats")
    evaluation = [name for name in ("dataset_test_split", "val_split", "eval_file") if getattr(script_args, name)]
    if len(evaluation) > 1:
        raise ValueError(f"give at most one of --dataset_test_split, --val_split and --eval_file (got --"
                         f"{' and --'.join(evaluation)})")
    for name in ("dataset_config", "dataset_train_split", "dataset_test_split"):
        if getattr(script_args, name) and not script_args.dataset_name:
            raise ValueError(f"--{name} needs --dataset_name")
    if training_args.use_muon and model_args.use_peft:
        raise ValueError("--optim muon with LoRA: Muon orthogonalises whole weight matrices, and a LoRA factor (rank x "
                         "width) is not one; train every weight with Muon (--use_peft false), or LoRA with AdamW")
    if script_args.merge and not model_args.use_peft:
        raise ValueError("--merge with --use_peft false: there is no adapter to merge; the output folder is the "
                         "whole fine-tuned model")
    check_quantization_arguments(model_args, training_args)
    return bool(evaluation)
