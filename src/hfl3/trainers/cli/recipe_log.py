"""What a recipe's log shows (`recipe_log`, around each recipe's run in `hfl3.trainers.cli.exits.run_recipe`): no
credential, and a warning that another library repeats at every step once, with a count at the end.

- Every record is redacted (`hfl3.provenance.portable.redact`: the values of the run's credential fields, and any
  `hf_...` token).
- A warning (or error) of another library's logger (not `hfl3.*` nor the recipe's own module) is shown the first time
  it is logged from one place with one message template; later records of it are counted, not shown, and when the
  run ends one line per repeated warning says how many were held back (bitsandbytes' "MatMul8bitLt: inputs will be
  cast from torch.float32 to float16" was logged 5,040 times in 10 steps of `--load_in_8bit`). Python warnings are
  logged through the `py.warnings` logger meanwhile (`logging.captureWarnings`) and count by their file, line and
  category; Python's own filters still show a warning with the same text from the same line once.

The filter sits on every logging handler that exists when `recipe_log` starts (the root logger's, transformers',
datasets', ...); `cover_new_handlers` adds it to those created since (the trainers call it when training starts,
after DeepSpeed or an integration may have added theirs).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Iterator

from hfl3.provenance.portable import redact

logger = logging.getLogger(__name__)

OWN_LOGGERS = ("hfl3", "__main__", "pretrain", "sft_lora")
"""Loggers whose warnings are all shown: hfl3's and the recipes' (run as `__main__`, or imported by name)."""
SHOWN_CHARACTERS = 160
"""Characters of a repeated warning quoted in the count line."""


class RecipeLogFilter(logging.Filter):
    """The logging filter of `recipe_log` (module docstring).

    Attributes:
        secrets: values to redact from every record (the run's credentials, set once the arguments are parsed).
        repeats: `{key: times held back}` per repeated warning; `first`: `{key: its first record's text}`.
    """

    def __init__(self):
        super().__init__()
        self.secrets: tuple[str, ...] = ()
        self.repeats: Counter = Counter()
        self.first: dict[tuple, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, "_hfl3_shown", None)  # a record that reaches several handlers is decided once
        if decided is not None:
            return decided
        message = record.getMessage()
        redacted = redact(message, self.secrets)
        if redacted != message:
            record.msg, record.args = redacted, ()
        shown = True
        if record.levelno >= logging.WARNING and record.name.split(".")[0] not in OWN_LOGGERS:
            key = self._key(record, redacted)
            if key in self.first:
                self.repeats[key] += 1
                shown = False
            else:
                self.first[key] = f"{record.name}: {redacted}"
        record._hfl3_shown = shown
        return shown

    @staticmethod
    def _key(record: logging.LogRecord, message: str) -> tuple:
        """Where a warning comes from and its message template (its arguments may change at every step); for a
        Python warning, its file, line and category (the text before the warning's own words)."""
        if record.name == "py.warnings":  # "FILE:LINE: Category: text"
            return (record.name, *message.split(": ", 2)[:2])
        template = record.msg if isinstance(record.msg, str) else repr(record.msg)
        return record.name, record.levelno, record.pathname, record.lineno, template

    def report(self) -> None:
        """One log line per warning held back, with its count."""
        for key, count in self.repeats.items():
            text = self.first[key].splitlines()[0]
            shown = text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "…"
            logger.warning("a warning shown once above was repeated %d more time%s: %s", count,
                           "" if count == 1 else "s", shown)


_ACTIVE: list[RecipeLogFilter] = []


def _handlers() -> list[logging.Handler]:
    loggers = [logging.getLogger(), *(item for item in logging.Logger.manager.loggerDict.values()
                                      if isinstance(item, logging.Logger))]
    return [handler for item in loggers for handler in item.handlers]


def cover_new_handlers() -> None:
    """Add the active `recipe_log` filter to the logging handlers created since it started (none active: nothing)."""
    for active in _ACTIVE:
        for handler in _handlers():
            if active not in handler.filters:
                handler.addFilter(active)


@contextlib.contextmanager
def recipe_log() -> Iterator[RecipeLogFilter]:
    """`with recipe_log() as log:` around a recipe's run: the filter on every logging handler, Python warnings logged,
    and at the end (also when the block raises) the count line of each repeated warning; then both undone. Set
    `log.secrets` once the credentials are known."""
    log = RecipeLogFilter()
    _ACTIVE.append(log)
    cover_new_handlers()
    logging.captureWarnings(True)
    try:
        yield log
    finally:
        log.report()
        logging.captureWarnings(False)
        _ACTIVE.remove(log)
        for handler in _handlers():
            handler.removeFilter(log)
