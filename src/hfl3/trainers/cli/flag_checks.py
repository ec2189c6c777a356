"""The checks that read `hfl3.trainers.cli.flags`' tables, run first among a recipe's checks
(`hfl3.trainers.cli.arguments.check_pretrain_inputs`, `check_sft_inputs`): `refuse_flags` (a refused field given with a
value the recipe does not take, an honoured field given without what it needs), `OPTIMIZER_BOUNDS` (the range of every
learning rate, weight decay, momentum, epsilon and fraction of an optimizer group, refused outside it by each argument
class's `__post_init__`: `check_training_arguments`) and `with_choices` (a refusal that names a value hfl3 chose for the
user says so)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from hfl3.optim.settings import GroupLearningRates
from hfl3.provenance.portable import REDACTED, is_secret
from hfl3.trainers.cli.flags import NEEDS, REFUSED


@dataclass(frozen=True)
class Bounds:
    """The values an optimizer setting may take (`OPTIMIZER_BOUNDS`): above `low` (or equal to it with `low_closed`)
    and below `high` (or equal with `high_closed`); NaN never. A field whose default is None may be None.

    Attributes:
        expected: what the one-line refusal says is expected (`name=value: expected EXPECTED (WHY); e.g. --name
            EXAMPLE`).
        why: what a value outside does.
        example: a value in the range (the usual one).
    """

    low: float
    high: float = math.inf
    low_closed: bool = False
    high_closed: bool = False
    expected: str = ""
    why: str = ""
    example: str = ""

    def holds(self, value: float) -> bool:
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below  # False for NaN


_LR = "0 trains nothing, a negative rate climbs the loss"
_MOMENTUM = "torch's AdamW refuses others: 1 or more never forgets a gradient, and the moments grow without bound"


def _group_lr(example: float) -> Bounds:
    return Bounds(0, expected="a positive learning rate", why=_LR, example=f"{example:g}")


OPTIMIZER_BOUNDS: dict[str, Bounds] = {
    "learning_rate": Bounds(0, expected="a positive learning rate", why=_LR, example="3e-4"),
    **{item.name: _group_lr(item.default if item.default is not None else GroupLearningRates.embedding_lr)
       for item in fields(GroupLearningRates)},
    "weight_decay": Bounds(0, low_closed=True, expected="a weight decay of 0 or more", why="a negative decay grows "
                           "the weights", example="0.1"),
    "adam_beta1": Bounds(0, 1, low_closed=True, expected="a momentum coefficient in [0, 1)", why=_MOMENTUM,
                         example="0.9"),
    "adam_beta2": Bounds(0, 1, low_closed=True, expected="a momentum coefficient in [0, 1)", why=_MOMENTUM,
                         example="0.95"),
    "adam_epsilon": Bounds(0, low_closed=True, expected="an epsilon of 0 or more", why="it keeps AdamW's division "
                           "by the second moment away from 0; torch refuses a negative one", example="1e-8"),
    "warmdown_ratio": Bounds(0, 1, True, True, expected="a fraction of the steps in [0, 1]", why="the share of "
                             "the steps in the final linear warmdown", example="0.2"),
    "final_lr_frac": Bounds(0, 1, True, True, expected="a fraction of the group LRs in [0, 1]", why="the LR at the "
                            "end of the warmdown; below 0 it climbs the loss", example="0"),
    "init_lr_frac": Bounds(0, 1, high_closed=True, expected="a fraction of the group LRs in (0, 1]", why="the LRs "
                           "start at this fraction of the group LRs; 0 trains nothing", example="0.8"),
}
"""Every learning rate, weight decay, momentum coefficient, epsilon and fraction of an optimizer group that a recipe
takes, with its range (`hfl3.trainers.cli.arguments.check_training_arguments` refuses a value outside; `tests/test_flags.py` finds every such
field of the recipes' argument classes in this table). A Muon group LR of 0 is refused like `--learning_rate 0`."""



def _shown(value, name: str = "") -> str:
    """`value` as a refusal quotes it; `<redacted>` for a field that holds a credential (`is_secret`)."""
    if is_secret(name):
        return REDACTED
    value = getattr(value, "value", value)
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value) if isinstance(value, dict) else str(value)


def with_choices(message: str, choices: Mapping[str, str]) -> str:
    """`message` (a refusal; one line) followed by the note of each value in `choices` it names (`{field: note}`: a
    value hfl3 chose for the user, and the flag that changes it, e.g. `ChatSFTConfig.hfl3_choices`), so that a
    refusal never blames a flag the user did not set. A field counts as named by its name, or by its words (`eval
    strategy`, `evaluation strategy` for `eval_strategy`), as transformers' messages write them."""
    line = " ".join(message.split())
    named = [note for name, note in choices.items()
             if re.search("|".join(re.escape(form) for form in {name, name.replace("_", " "),
                                                                 name.replace("eval_", "evaluation ").replace("_", " ")}),
                          line, re.IGNORECASE)]
    return f"{line} ({'; '.join(named)})" if named else line


def refuse_flags(recipe: str, given: frozenset[str], *parsed) -> None:
    """Refuse the fields of `recipe` (`RECIPES`) that were `given` (set on the command line or in the `--config`
    file) and cannot act: a `REFUSED` field with a value other than its accepted ones, a `NEEDS` field without what
    it needs. Call it first among the recipe's checks, before any file is read or written.

    Args:
        recipe: "pretrain" or "sft_lora".
        given: the names of the fields the user set (`RecipeParser.given_arguments`).
        parsed: the recipe's parsed argument dataclasses.

    Raises:
        ValueError: `--FIELD VALUE: why; the fix`, for the first such field in the tables' order (VALUE
            `<redacted>` for a credential, `hfl3.provenance.portable.is_secret`).
    """
    values = {item.name: getattr(arguments, item.name) for arguments in parsed for item in fields(arguments)}
    for name, refusal in REFUSED[recipe].items():
        if name in given and getattr(values[name], "value", values[name]) not in refusal.accepted:
            raise ValueError(f"--{name} {_shown(values[name], name)}: {refusal.reason}")
    for name, needs in NEEDS[recipe].items():
        if name in given and not needs.holds(values):
            fix = (needs.fix or "add it, or leave --{name} out").format(name=name)
            raise ValueError(f"--{name} {_shown(values[name], name)}: acts only with {needs.setting}; {fix}")
