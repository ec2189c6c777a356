"""ChatCORE during SFT (nanochat's scripts/chat_sft.py `--chatcore-every`, `--chatcore-max-cat`,
`--chatcore-max-sample`): the arguments (`ChatCoreArguments`, which `hfl3.trainers.sft.config.ChatSFTConfig`
inherits), their checks, the problems loaded before training, and `ChatCoreCallback`.

When it runs: every `chatcore_every` optimizer steps (not at step 0, as nanochat) and once more for the final model.
Its values are evaluation metrics, `eval_chatcore_metric`, `eval_chatcore_cat` and `eval_chatcore/<task>`:
- when the Trainer evaluates at that step (evaluation data and an `eval_strategy` that evaluates then), inside that
  evaluation (`ChatSFTTrainer.evaluation_loop` adds them), so `metric_for_best_model` and early stopping see them;
  the final evaluation (`hfl3.trainers.training.train_and_evaluate`, of the best model when one is loaded) carries
  them too, and so `all_results.json`;
- otherwise on its own, logged through `trainer.log` at that step and at the end, and added to the run's results
  (`ChatSFTTrainer.run_results`).
Picking the best model by a ChatCORE metric needs every evaluation to carry it: `--eval_strategy steps` with
`--eval_steps` a multiple of `--chatcore_every` (`check_chatcore_setup`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from transformers import TrainerCallback
from transformers.trainer_utils import IntervalStrategy

from hfl3.distributed import from_main
from hfl3.evaluate.chat_tasks import TASKS, Problem, data_problem, load_problems
from hfl3.evaluate.chatcore import DEFAULT_MAX_NEW_TOKENS, ChatCoreResults, evaluate_chatcore

logger = logging.getLogger(__name__)


@dataclass
class ChatCoreArguments:
    """ChatCORE during training, with nanochat chat_sft's subset sizes (it evaluates every 200 steps; here -1, off by
    default: the data is a download)."""

    chatcore_every: int = field(default=-1, metadata={
        "help": "ChatCORE every N optimizer steps and at the end of training (-1: off; nanochat chat_sft: 200)."})
    chatcore_max_cat: int = field(default=-1, metadata={
        "help": "ChatCORE problems per categorical task (ARC-Easy, ARC-Challenge, MMLU); -1: all (nanochat's)."})
    chatcore_max_sample: int = field(default=24, metadata={
        "help": "ChatCORE problems per generative task (GSM8K, HumanEval); nanochat chat_sft: 24."})
    chatcore_max_new_tokens: int = field(default=DEFAULT_MAX_NEW_TOKENS, metadata={
        "help": "Longest ChatCORE reply in tokens (nanochat: 512)."})
    chatcore_data_dir: str | None = field(default=None, metadata={
        "help": "A local copy of ChatCORE's data (DIR/<hub id>/<config>/<split>-*.parquet); default: the Hub."})


def check_chatcore_arguments(args) -> None:
    """Refuse ChatCORE values that cannot work (no other argument needed; from the config's `__post_init__`).

    Raises:
        ValueError: `chatcore_every` 0 or below -1, a problem count 0 or below -1, `chatcore_max_new_tokens` < 1.
    """
    if args.chatcore_every == 0 or args.chatcore_every < -1:
        raise ValueError(f"chatcore_every={args.chatcore_every}: expected N > 0 (ChatCORE every N steps and at the "
                         "end of training) or -1 (off)")
    for name in ("chatcore_max_cat", "chatcore_max_sample"):
        if getattr(args, name) == 0 or getattr(args, name) < -1:
            raise ValueError(f"{name}={getattr(args, name)}: expected a positive number of problems, or -1 (all)")
    if args.chatcore_max_new_tokens < 1:
        raise ValueError(f"chatcore_max_new_tokens={args.chatcore_max_new_tokens}: expected a positive number of "
                         "tokens")


def is_chatcore_metric(name: str | None) -> bool:
    """Whether a `metric_for_best_model` names one of ChatCORE's metrics (with or without `eval_`)."""
    return bool(name) and name.removeprefix("eval_").startswith("chatcore")


def check_chatcore_setup(args) -> None:
    """With the recipe's other checks, before any work: with ChatCORE on, its data can be read (`chatcore_data_dir`
    holds every task, or offline the datasets cache does; global rank 0 reads it for all), and a ChatCORE
    `metric_for_best_model` is computed at every evaluation.

    Raises:
        ValueError: one line naming the argument and what to download or pass.
    """
    if is_chatcore_metric(args.metric_for_best_model):
        every = args.chatcore_every
        steps = IntervalStrategy(args.eval_strategy) == IntervalStrategy.STEPS
        if every < 0 or not steps or args.eval_steps is None or args.eval_steps % every:
            raise ValueError(f"--metric_for_best_model {args.metric_for_best_model}: every evaluation must compute "
                             "ChatCORE; pass --chatcore_every N --eval_strategy steps --eval_steps M with M a multiple "
                             "of N")
    if args.chatcore_every > 0 and args.process_index == 0:
        problem = data_problem(list(TASKS), args.chatcore_data_dir)
        if problem:
            raise ValueError(f"--chatcore_every {args.chatcore_every}: {problem}")


def chatcore_problems_for_training(args) -> dict[str, list[Problem]] | None:
    """The problems a training run evaluates (None when `chatcore_every` is -1): every task, `chatcore_max_cat`
    problems of the categorical ones and `chatcore_max_sample` of the generative ones after nanochat's shuffle; read by
    global rank 0 and sent to every rank. Call it before the heavy work."""
    if args.chatcore_every < 0:
        return None

    def load() -> dict[str, list[Problem]]:
        return {name: load_problems(name, args.chatcore_data_dir, args.chatcore_max_cat if task.kind == "categorical"
                                    else args.chatcore_max_sample) for name, task in TASKS.items()}

    problems = from_main(load)
    logger.info("ChatCORE: %s problems, every %d steps and at the end",
                ", ".join(f"{name} {len(items)}" for name, items in problems.items()), args.chatcore_every)
    return problems


class ChatCoreCallback(TrainerCallback):
    """Evaluates ChatCORE (`hfl3.evaluate.evaluate_chatcore`) on the model being trained, when the module docstring
    says, on every process (each takes its share of the problems), with FP8 layers swapped back to high precision,
    under the Trainer's mixed-precision autocast; `latest` holds the last `ChatCoreResults`. Given the trainer, as
    TRL's callbacks that log: `trainer.add_callback(ChatCoreCallback(trainer, problems, every))`."""

    def __init__(self, trainer, problems: dict[str, list[Problem]], every: int,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS):
        self.trainer, self.problems, self.every, self.max_new_tokens = trainer, problems, every, max_new_tokens
        self.latest: ChatCoreResults | None = None
        self._evaluated_step: int | None = None
        self._due = False

    def trainer_evaluates(self) -> bool:
        args = self.trainer.args
        return IntervalStrategy(args.eval_strategy) != IntervalStrategy.NO and self.trainer.eval_dataset is not None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every:
            return
        if control.should_evaluate and self.trainer_evaluates():
            self._due = True  # the Trainer's evaluation of this step adds it (`evaluation_metrics`)
        else:
            should_log = control.should_log
            self.evaluate_and_log()
            # `Trainer.log` clears `should_log`; this step's own loss log must still happen (see CoreMetricCallback)
            control.should_log = should_log

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer_evaluates():
            self._due = True  # train_and_evaluate's final evaluation adds it
        elif self._evaluated_step != state.global_step:
            self.evaluate_and_log()

    def evaluation_metrics(self, prefix: str = "eval") -> dict[str, float]:
        """ChatCORE's metrics for the Trainer's evaluation in progress (`prefix` its `metric_key_prefix`), when due;
        empty otherwise. The final evaluation of the same weights as the last ChatCORE reuses it."""
        if not self._due:
            return {}
        self._due = False
        reload = self.trainer.args.load_best_model_at_end
        if self.latest is None or self._evaluated_step != self.trainer.state.global_step or reload:
            self.evaluate()
        return self.latest.metrics(f"{prefix}_")

    def evaluate(self) -> ChatCoreResults:
        """Evaluate now (every process) and keep the results in `latest`."""
        from hfl3 import fp8

        trainer = self.trainer
        model = trainer.model
        started = time.perf_counter()
        with fp8.float8_disabled(model), trainer.autocast_smart_context_manager():
            self.latest = evaluate_chatcore(model, trainer.processing_class, self.problems,
                                            max_new_tokens=self.max_new_tokens,
                                            batch_size=trainer.args.per_device_eval_batch_size)
        self._evaluated_step = trainer.state.global_step
        if trainer.is_world_process_zero():
            shown = f"{self.latest.chatcore:.4f}" if self.latest.chatcore is not None else "n/a"
            logger.info("step %d: ChatCORE %s (%.1f s)", trainer.state.global_step, shown,
                        time.perf_counter() - started)
        step_metrics = getattr(trainer, "step_metrics", None)  # hfl3's trainers (no import of the layer above)
        if step_metrics is not None:  # left out of the throughput window, as CoreMetricCallback's
            step_metrics.throughput.exclude_time(time.perf_counter() - started)
        return self.latest

    def evaluate_and_log(self) -> None:
        """Evaluate, and log the metrics through `trainer.log` with the model in eval mode (the SFT trainer adds its
        training metrics to a log made in train mode)."""
        self.evaluate()
        model = self.trainer.model
        was_training = model.training
        model.eval()
        try:
            self.trainer.log(self.latest.metrics("eval_"))
        finally:
            model.train(was_training)
