"""The errors a user fixes by changing what they gave a recipe: `InputError` and its subclasses. A recipe ends with one
as one line, `PROG: error: <message>`, and exit status 2 (argparse's convention for bad input), on every rank
(`hfl3.trainers.cli.exits.recipe_exits`); any other exception keeps its traceback, since it is hfl3's bug or the
environment's.

Raised where the input is first read: arguments when checked (`hfl3.trainers.cli.arguments`), data before the model is
built (`hfl3.data`), a model folder before its weights load, a run the compute-optimal dial cannot size
(`hfl3.trainers.pretraining.compute_optimal.PlanError`). Each message names the file, record or argument and the fix.
"""


class InputError(ValueError):
    """Bad input to a run (arguments, data, a model or checkpoint folder), found before or instead of the work it would
    spoil; the message is one line naming what and where, and the fix."""
