"""How a recipe runs and ends: `run_recipe(parser, main)` parses the arguments, runs `main` (whose first call checks
them, `hfl3.trainers.cli.setup`) and ends every rank through `hfl3.distributed.end_distributed_run` (`run_main`: the same
without ending the process); when the run stops early, `recipe_exits` turns what stopped it into one line on stderr and
an exit status instead of a traceback:

| what stopped the run | exit status | the line |
|---|---|---|
| an argument the recipe's checks refused (`hfl3.trainers.cli.arguments.ArgumentsError`) | 2 | argparse's usage line, then the error's own words |
| bad input: `hfl3.errors.InputError` (data and chat records, a model folder, a plan), `LaunchError` | 2 | the error's own words |
| a NaN/inf loss or gradient (`NonFiniteTrainingError`) | 1 | the step, the newest checkpoint, what to change |
| Ctrl-C (`KeyboardInterrupt`) | 130 | what was saved and the command's flags that resume it |
| a lost or frozen rank (the process group failed) | 1 | the lost ranks (`hfl3.distributed.lost_peer_message`) |

Anything else keeps its traceback: it is hfl3's bug or the environment's. In every case but success an output folder
that this run created is left without its staging area (work files, a partial final folder) and removed when
nothing else is in it; its checkpoints stay.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from hfl3.distributed import end_distributed_run, lost_peer_message
from hfl3.errors import InputError
from hfl3.provenance.portable import redact
from hfl3.trainers.cli.arguments import ArgumentsError, parse_recipe_args, parsed_secrets
from hfl3.trainers.metrics import NonFiniteTrainingError
from hfl3.trainers.cli.launch import LOG_FORMAT, LaunchError
from hfl3.trainers.outputs import STAGING, OutputFolder, latest_checkpoint
from hfl3.trainers.cli.recipe_log import recipe_log

logger = logging.getLogger(__name__)

INPUT_ERRORS = (InputError, LaunchError)
"""What a recipe reports as bad input: one line, exit status 2 (hfl3's data errors are `InputError`s)."""


class RecipeEnding:
    """What `recipe_exits` needs to say how a run ended: its output folder and the credentials its line must not
    show, once the arguments are parsed."""

    output: OutputFolder | None = None
    secrets: tuple[str, ...] = ()


_ENDING: contextvars.ContextVar[RecipeEnding | None] = contextvars.ContextVar("hfl3_recipe_ending", default=None)


def record_output(output: OutputFolder | None) -> None:
    """Tell the `recipe_exits` block this runs in (if any) the run's output folder, once the checks resolved it
    (`hfl3.trainers.cli.setup`): a failure or Ctrl-C from then on discards its staging area and says what was saved."""
    if (ending := _ENDING.get()) is not None:
        ending.output = output


def _say(prog: str | None, message: str, secrets=()) -> None:
    # one write of the whole line: the ranks of a launch print at the same moment into one unbuffered stream
    sys.stderr.write(f"{prog or os.path.basename(sys.argv[0])}: error: {redact(message, secrets)}\n")
    sys.stdout.flush()
    sys.stderr.flush()


def interrupted_message(output: OutputFolder | None) -> str:
    """What a Ctrl-C leaves and how to continue: the newest complete checkpoint of the run and the flags that resume
    it, or that nothing was saved."""
    if output is None:
        return "interrupted before the run started; nothing was written"
    newest = latest_checkpoint(output.run_dir) if output.run_dir.is_dir() else None
    if newest is None:
        return (f"interrupted; no checkpoint was saved ({output.path}'s files are as they were before this run); run "
                "the same command again to start over")
    again = "--overwrite_output_dir --resume_from_checkpoint latest" if output.replacing else \
        "--resume_from_checkpoint latest"
    kept = f" ({output.path}'s own files are as they were before this run)" if output.replacing else ""
    return f"interrupted; the newest checkpoint is {Path(newest).name}{kept}: add {again} to continue from it"


def discard_staging(output: OutputFolder | None) -> None:
    """After a run that did not finish: an output folder this run created loses its staging area (work files, a
    partial final folder), and is removed when nothing else is left in it. A folder that existed before is left as
    it is (a replacing run's staged checkpoints live there, for its resume)."""
    if output is None or not output.created or not output.path.is_dir():
        return
    shutil.rmtree(output.path / STAGING, ignore_errors=True)
    with contextlib.suppress(OSError):
        output.path.rmdir()  # only when empty: the run's checkpoints stay


@contextlib.contextmanager
def recipe_exits(prog: str | None = None, usage: str | None = None) -> Iterator[RecipeEnding]:
    """`with recipe_exits() as ending:` around a recipe's parsing and `main`; `ending.output` is set once the output
    folder is known (`record_output`). Ends the program as the module docstring's table says when the block raises;
    `usage` (the parser's `format_usage()`) is printed above an `ArgumentsError`'s line, as argparse does. Every rank
    prints its message (the same on each): the launcher stops the others as soon as one exits, so a message left to
    rank 0 alone could be cut off."""
    ending = RecipeEnding()
    token = _ENDING.set(ending)
    try:
        yield ending
    except ArgumentsError as error:
        discard_staging(ending.output)
        if usage:
            sys.stderr.write(usage)
        _say(prog, str(error), ending.secrets)
        sys.exit(2)
    except INPUT_ERRORS as error:
        discard_staging(ending.output)
        _say(prog, str(error), ending.secrets)
        sys.exit(2)
    except NonFiniteTrainingError as error:
        discard_staging(ending.output)
        _say(prog, str(error), ending.secrets)
        sys.exit(1)
    except KeyboardInterrupt:
        discard_staging(ending.output)
        _say(prog, interrupted_message(ending.output))
        os._exit(130)  # no interpreter shutdown: DataLoader workers and process-group threads may still be running
    except RuntimeError as error:  # the process group failed: a lost rank is named, anything else propagates
        message = lost_peer_message(error)
        if message is None:
            discard_staging(ending.output)
            raise
        _say(prog, message)
        os._exit(1)  # no interpreter shutdown: it would wait on the broken group's threads and the data workers
    except BaseException:
        discard_staging(ending.output)
        raise
    finally:
        _ENDING.reset(token)


def run_recipe(parser, main: Callable[..., object], args: Sequence[str] | None = None) -> None:
    """A recipe's `__main__`: log lines in `LOG_FORMAT`, `run_main`, then end every rank through
    `end_distributed_run` (exit status 0)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    run_main(parser, main, args)
    end_distributed_run()  # every rank: the others done, the process group destroyed, outputs flushed, exit 0


def run_main(parser, main: Callable[..., object], args: Sequence[str] | None = None):
    """Parse (`parse_recipe_args`: the parser's argument classes, in its order: script, training, model), then
    `main(script_args, training_args, model_args, given=...)` (`given`: the fields the user set, for the checks that
    `main` runs first); inside `recipe_exits` and `recipe_log` (no credential in the log, another library's repeated
    warnings once, with their counts). Returns what `main` returns; the process goes on (tests, benchmarks)."""
    args = list(args) if args is not None else sys.argv[1:]
    with recipe_exits(parser.prog, parser.format_usage()) as ending, recipe_log() as log:
        parsed = parse_recipe_args(parser, args)
        ending.secrets = tuple(parsed_secrets(*parsed))
        log.secrets = ending.secrets
        return main(*parsed, given=parser.given_arguments(args))
