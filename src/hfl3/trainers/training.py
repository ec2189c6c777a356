"""Train → evaluate → results, one function both recipes use (`train_and_evaluate`), with one rule for the step-0
evaluation: it runs inside `train()` (`eval_on_start`, decided by `hfl3.trainers.cli.arguments.decide_evaluation`) and is
reported as `eval_before_*`. An `evaluate()` before `train()` would prepare the model for inference only (no DDP
wrapper, so no gradient all-reduce; a raise under ZeRO-2, no engine under ZeRO-3: docs/design.md, Known traps)."""

import logging
import math

from transformers.trainer_utils import IntervalStrategy

from hfl3.trainers.cli.recipe_log import cover_new_handlers

logger = logging.getLogger(__name__)

LOGGED = ("eval_before_loss", "eval_before_bpb", "eval_loss", "eval_bpb", "eval_perplexity",
          "train_supervised_tokens_per_second")
"""The results `train_and_evaluate` logs (local main process), when present and finite."""


def eval_before(log_history: list[dict]) -> dict:
    """The step-0 evaluation (`eval_on_start`) of `log_history`, its `eval_*` keys renamed `eval_before_*`; empty
    when there was none."""
    for entry in log_history:
        if entry.get("step") == 0 and any(key.startswith("eval_") for key in entry):
            return {k.replace("eval_", "eval_before_", 1): v for k, v in entry.items() if k.startswith("eval_")}
    return {}


def train_and_evaluate(trainer) -> dict:
    """Train (from the checkpoint the trainer's output folder resolved, if any), evaluate at the end when the run
    evaluates (an `eval_strategy` other than `no` and evaluation data), and return the run's results: the step-0
    evaluation as `eval_before_*`, the Trainer's training metrics (`train_loss`, `train_runtime`, ... over the whole
    run, resumes included), the final evaluation's `eval_*`, what the trainer adds (`run_results()`: pretraining's
    CORE metric, SFT's supervised tokens and their rate), `global_step` and `best_model_checkpoint`. Call on every
    rank."""
    cover_new_handlers()  # the log handlers created while the run was built (DeepSpeed's, an integration's)
    train_result = trainer.train()
    results = {**eval_before(trainer.state.log_history), **train_result.metrics}
    if IntervalStrategy(trainer.args.eval_strategy) != IntervalStrategy.NO and trainer.eval_dataset is not None:
        results.update(trainer.evaluate())
    results.update(trainer.run_results())
    results["global_step"] = trainer.state.global_step
    results["best_model_checkpoint"] = trainer.state.best_model_checkpoint
    if trainer.is_local_process_zero():
        for key in LOGGED:
            if isinstance(results.get(key), float) and math.isfinite(results[key]):
                logger.info("%s = %.4f", key, results[key])
    return results
