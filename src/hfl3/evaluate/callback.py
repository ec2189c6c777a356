"""CORE during training: the arguments' checks, the bundle loaded before training, and `CoreMetricCallback`, which
evaluates every `core_metric_every` optimizer steps and at the end of training (nanochat's base_train.py
`--core-metric-every`, `--core-metric-max-per-task`)."""

from __future__ import annotations

import logging
import time

from transformers import TrainerCallback

from hfl3.distributed import from_main
from hfl3.evaluate.bundle import (
    CoreBundle,
    bundle_problem,
    default_bundle_dir,
    load_core_bundle,
    missing_bundle_message,
    offline,
    resolve_bundle_dir,
)
from hfl3.evaluate.core import DEFAULT_BATCH_TOKENS, CoreResults, default_max_length, evaluate_core

logger = logging.getLogger(__name__)


def check_core_arguments(args) -> None:
    """Refuse CORE settings that cannot work, while the arguments are parsed (no file is read; the bundle folder is
    checked by `check_core_bundle`, with the recipe's other paths).

    Reads `core_metric_every` and `core_metric_max_per_task` of `args`.

    Raises:
        ValueError: `core_metric_every` is 0 or below -1; `core_metric_max_per_task` is 0 or below -1.
    """
    if args.core_metric_every == 0 or args.core_metric_every < -1:
        raise ValueError(f"core_metric_every={args.core_metric_every}: expected N > 0 (CORE every N steps and at the "
                         "end of training) or -1 (off)")
    if args.core_metric_max_per_task == 0 or args.core_metric_max_per_task < -1:
        raise ValueError(f"core_metric_max_per_task={args.core_metric_max_per_task}: expected a positive number of "
                         "items per task, or -1 (all)")


def check_core_bundle(args) -> None:
    """With CORE on (`args.core_metric_every` > 0), refuse a `core_bundle_dir` that is not an eval-bundle folder, or
    none given while downloads are off (`HF_HUB_OFFLINE`) and no copy is cached. Reads the folder's listing only, on
    global rank 0 only (the one that reads the bundle, `core_bundle_for_training`).

    Raises:
        ValueError: one line naming `core_bundle_dir`, the value and what a bundle holds.
    """
    if args.core_metric_every < 0 or args.process_index != 0:  # global rank 0 reads it for every rank
        return
    if args.core_bundle_dir is not None:
        problem = bundle_problem(args.core_bundle_dir)
        if problem:
            raise ValueError(f"core_bundle_dir: {problem}; pass nanochat's eval_bundle folder (core.yaml, "
                             "eval_meta_data.csv, eval_data/)")
    elif offline() and bundle_problem(default_bundle_dir()) is not None:
        raise ValueError(missing_bundle_message())


def core_bundle_for_training(args) -> CoreBundle | None:
    """The bundle a training run evaluates (None when `core_metric_every` is -1): `core_bundle_dir`, or the cached
    copy, downloaded first when missing, with `core_metric_max_per_task` items per task; read by global rank 0 and
    sent to every rank through the process group (`hfl3.distributed.from_main`: only machine 0 needs the bundle).
    Call it before the heavy work, so a bad bundle stops the run early (on every rank)."""
    if args.core_metric_every < 0:
        return None
    bundle = from_main(lambda: load_core_bundle(resolve_bundle_dir(args.core_bundle_dir),
                                                args.core_metric_max_per_task))
    logger.info("CORE: %d tasks, %d items (max %d per task), every %d steps and at the end", len(bundle.tasks),
                sum(len(task.items) for task in bundle.tasks), args.core_metric_max_per_task, args.core_metric_every)
    return bundle


class CoreMetricCallback(TrainerCallback):
    """Evaluates CORE (`hfl3.evaluate.evaluate_core`) on the model being trained after every `every` optimizer steps
    and once more at the end of training (unless the last step was just evaluated), on every process (each scores
    its share of the items), with FP8 layers swapped back to high precision, under the Trainer's mixed-precision
    autocast. The results go through `trainer.log` (`core_metric`, `core_accuracy/<task>`, `core_centered/<task>`:
    the log history and every `report_to` integration); `latest` holds the last `CoreResults`.

    Like TRL's callbacks that log, it is given the trainer: `trainer.add_callback(CoreMetricCallback(trainer, ...))`.
    The evaluation's time is left out of the trainer's tokens per second when it keeps them (hfl3's trainers:
    `trainer.step_metrics.throughput.exclude_time(seconds)`, `hfl3.trainers.metrics.Throughput`).
    """

    def __init__(self, trainer, bundle: CoreBundle, every: int, batch_tokens: int = DEFAULT_BATCH_TOKENS):
        self.trainer = trainer
        self.bundle = bundle
        self.every = every
        self.batch_tokens = batch_tokens
        self.latest: CoreResults | None = None
        self._evaluated_step: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.every > 0 and state.global_step % self.every == 0:
            should_log = control.should_log
            self.evaluate()
            # `Trainer.log` clears `should_log` (`CallbackHandler.on_log`): without this, the Trainer's own loss log of
            # this step would be skipped, folded into the next one, and at the last step left out of `train_loss`'s
            # gathered sum (transformers 5.23 then adds rank 0's own loss only)
            control.should_log = should_log

    def on_train_end(self, args, state, control, **kwargs):
        if self._evaluated_step != state.global_step:
            self.evaluate()

    def evaluate(self) -> CoreResults:
        """Evaluate now (every process), log the metrics and keep them in `latest`."""
        from hfl3 import fp8

        trainer = self.trainer
        model = trainer.model
        started = time.perf_counter()
        with fp8.float8_disabled(model), trainer.autocast_smart_context_manager():
            self.latest = evaluate_core(model, trainer.processing_class, self.bundle, batch_tokens=self.batch_tokens,
                                        max_length=default_max_length(model))
        self._evaluated_step = trainer.state.global_step
        if trainer.is_world_process_zero():
            logger.info("step %d: CORE %.4f", trainer.state.global_step, self.latest.core_metric)
        trainer.log(self.latest.metrics())
        step_metrics = getattr(trainer, "step_metrics", None)  # hfl3's trainers (no import of the layer above)
        if step_metrics is not None:
            step_metrics.throughput.exclude_time(time.perf_counter() - started)
        return self.latest
