"""ChatCORE (karpathy/nanochat 92d63d4, scripts/chat_eval.py and scripts/chat_sft.py): a chat model's accuracy on
ARC-Easy, ARC-Challenge, MMLU, GSM8K and HumanEval, each centered on its baseline, `(accuracy - b) / (1 - b)`, and
averaged, so that 0 is chance and 1 is perfect. `chatcore_cat` is the same mean over the three categorical tasks
(nanochat chat_sft's `chatcore_cat`).

- Categorical tasks (`evaluate_categorical`): the prediction is the choice letter with the highest logit at the
  assistant's first position (nanochat's `run_categorical_eval`), in batches of `batch_size` prompts.
- Generative tasks (`evaluate_generative`): one greedy reply per problem, at most `max_new_tokens` (nanochat's
  chat_eval defaults: temperature 0, one sample, 512 tokens), checked by extraction (GSM8K) or by running the program
  (HumanEval, `hfl3.evaluate.execution.run_python`, up to `EXECUTION_WORKERS` at a time).

The tasks and prompts are `hfl3.evaluate.chat_tasks`'; the model side is `hfl3.evaluate.chat_generation`'. Under
torch.distributed each process takes problems `rank, rank + world_size, ...` (nanochat splits the same way, by
problem or by batch) and the per-problem outcomes are summed (`all_reduce`): every process gets the whole result.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from hfl3.evaluate.chat_generation import (
    CalculatorTool,
    batches_by_length,
    generate_completions,
    letter_logits,
    letter_token_ids,
    model_device,
    prompt_ids,
    stop_token_ids,
)
from hfl3.evaluate.chat_tasks import CATEGORICAL, TASKS, Problem, final_answer, gsm8k_number, humaneval_program
from hfl3.evaluate.core import _distributed
from hfl3.evaluate.execution import run_python

logger = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 512  # nanochat chat_eval.py --max-new-tokens
DEFAULT_BATCH_SIZE = 8  # nanochat chat_eval.py --batch-size (categorical)
EXECUTION_WORKERS = 4
NANOCHAT_PROMPT_TOKENS = 2048  # nanochat's render_conversation keeps the first 2048 tokens of a conversation


@dataclass
class ChatTaskResult:
    """One task's outcome: `accuracy` (share of its problems passed), `centered` ((accuracy - baseline) / (1 -
    baseline)), `passed` (per problem, in the shuffled order), and counts: `cut_at_max_new_tokens` (replies that hit
    the limit), `execution_timeouts` (HumanEval programs killed at the time limit), `calculator_calls`,
    `long_prompts` (prompts over 2048 tokens, which nanochat would cut), `seconds` (wall time); `replies`: this
    process's decoded replies by problem index (generative tasks)."""

    name: str
    kind: str
    baseline: float
    accuracy: float
    centered: float
    passed: list[bool] = field(repr=False)
    cut_at_max_new_tokens: int = 0
    execution_timeouts: int = 0
    calculator_calls: int = 0
    long_prompts: int = 0
    seconds: float = 0.0
    replies: dict[int, str] = field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        return {"accuracy": self.accuracy, "centered": self.centered, "passed": sum(self.passed),
                "problems": len(self.passed), "cut_at_max_new_tokens": self.cut_at_max_new_tokens,
                "execution_timeouts": self.execution_timeouts, "calculator_calls": self.calculator_calls,
                "long_prompts": self.long_prompts, "seconds": round(self.seconds, 2)}


@dataclass
class ChatCoreResults:
    """Per-task results (in nanochat's task order), `chatcore` (the mean centered accuracy over the five tasks; None
    unless all five were evaluated, as nanochat), `chatcore_cat` (over the three categorical tasks; None unless all
    three were) and the settings they were computed with."""

    tasks: list[ChatTaskResult]
    chatcore: float | None
    chatcore_cat: float | None
    settings: dict

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """Flat metrics for logs and all_results.json, nanochat chat_sft's names after `prefix`: `chatcore_metric`,
        `chatcore_cat` (when computed) and `chatcore/<task>` (accuracy)."""
        metrics = {f"{prefix}chatcore/{task.name}": task.accuracy for task in self.tasks}
        if self.chatcore_cat is not None:
            metrics = {f"{prefix}chatcore_cat": self.chatcore_cat, **metrics}
        if self.chatcore is not None:
            metrics = {f"{prefix}chatcore_metric": self.chatcore, **metrics}
        return metrics

    def summary(self) -> dict:
        """JSON-safe: `chatcore`, `chatcore_cat`, per task its accuracy, centered accuracy and counts, the settings."""
        return {"chatcore": self.chatcore, "chatcore_cat": self.chatcore_cat,
                "tasks": {task.name: task.summary() for task in self.tasks}, "settings": self.settings}

    def table(self) -> str:
        """A fixed-width table: task, kind, problems, accuracy, centered; then ChatCORE."""
        lines = [f"{'task':<14} {'kind':<12} {'problems':>8} {'accuracy':>9} {'centered':>9}"]
        for task in self.tasks:
            lines.append(f"{task.name:<14} {task.kind:<12} {len(task.passed):>8} {task.accuracy:>9.4f} "
                         f"{task.centered:>9.4f}")
        for label, value, needs in (("ChatCORE", self.chatcore, "all five tasks"),
                                    ("ChatCORE_cat", self.chatcore_cat, "the three categorical tasks")):
            shown = f"{value:>9.4f}" if value is not None else f"(needs {needs})"
            lines.append(f"{label:<14} {'':<12} {'':>8} {'':>9} {shown}")
        return "\n".join(lines)


def _pad_token_id(tokenizer) -> int:
    return next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id, 0)
                if i is not None)


def _most_calls(count: int, device) -> int:
    """The largest `count` over the processes (how many forwards or `generate` calls each must make)."""
    if _distributed()[1] == 1:
        return count
    value = torch.tensor([count], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())


def _combine(outcomes: dict[int, bool], total: int, counts: list[int], device) -> tuple[list[bool], list[int]]:
    """Every process's per-problem outcomes and counts, summed over the processes."""
    values = torch.zeros(total + len(counts), dtype=torch.float64, device=device)
    for index, passed in outcomes.items():
        values[index] = float(passed)
    values[total:] = torch.tensor(counts, dtype=torch.float64)
    if _distributed()[1] > 1:
        torch.distributed.all_reduce(values)
    values = values.tolist()
    return [bool(v) for v in values[:total]], [int(v) for v in values[total:]]


def _result(name: str, passed: list[bool], started: float, **counts) -> ChatTaskResult:
    task = TASKS[name]
    accuracy = sum(passed) / len(passed) if passed else 0.0
    return ChatTaskResult(name, task.kind, task.baseline, accuracy, (accuracy - task.baseline) / (1 - task.baseline),
                          passed, seconds=time.perf_counter() - started, **counts)


@torch.no_grad()
def evaluate_categorical(model, tokenizer, name: str, problems: list[Problem], batch_size: int = DEFAULT_BATCH_SIZE
                         ) -> ChatTaskResult:
    """Accuracy of `model` on a categorical task's `problems` (a collective under torch.distributed).

    Raises:
        ValueError: the tokenizer has no chat template, or an answer letter is not one token of it."""
    started = time.perf_counter()
    rank, world_size = _distributed()
    mine = problems[rank::world_size]
    rows = prompt_ids(tokenizer, [problem.prompt for problem in mine])
    letters = {letter: token for problem in problems for letter, token in
               zip(problem.letters, letter_token_ids(tokenizer, problem.letters))}
    pad, device = _pad_token_id(tokenizer), model_device(model)
    groups = batches_by_length(rows, batch_size)
    outcomes = {}
    for number in range(_most_calls(len(groups), device)):
        if number >= len(groups):  # a filler forward keeps ZeRO-3/FSDP collectives in step
            letter_logits(model, [[pad]], [[pad]], pad)
            continue
        group = groups[number]
        scores = letter_logits(model, [rows[i] for i in group],
                               [[letters[letter] for letter in mine[i].letters] for i in group], pad)
        for i, logits in zip(group, scores):
            # nanochat: argmax over the letters' logits, the first on a tie
            predicted = mine[i].letters[max(range(len(logits)), key=lambda k: (logits[k], -k))]
            outcomes[mine[i].index] = predicted == mine[i].answer
    long_prompts = sum(len(row) > NANOCHAT_PROMPT_TOKENS for row in rows)
    passed, (long_prompts,) = _combine(outcomes, len(problems), [long_prompts], device)
    return _result(name, passed, started, long_prompts=long_prompts)


def check_reply(name: str, problem: Problem, completion: str) -> tuple[bool, bool]:
    """Whether a generative task's `completion` is correct, and whether its program timed out (HumanEval)."""
    answer = final_answer(completion)
    if name == "GSM8K":
        return gsm8k_number(answer) == problem.answer, False
    result = run_python(humaneval_program(problem.row, answer))
    return result.success, result.timeout


@torch.no_grad()
def evaluate_generative(model, tokenizer, name: str, problems: list[Problem], *,
                        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = DEFAULT_BATCH_SIZE
                        ) -> ChatTaskResult:
    """Accuracy of `model`'s greedy replies on a generative task's `problems` (a collective under
    torch.distributed).

    Raises:
        ValueError: the tokenizer has no chat template."""
    started = time.perf_counter()
    rank, world_size = _distributed()
    mine = problems[rank::world_size]
    rows = prompt_ids(tokenizer, [problem.prompt for problem in mine])
    tool = CalculatorTool.for_tokenizer(tokenizer)
    device = model_device(model)
    calls = _most_calls(math.ceil(len(rows) / batch_size), device)
    replies = generate_completions(model, tokenizer, rows, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                   stop_ids=stop_token_ids(model, tokenizer), tool=tool,
                                   pad_token_id=_pad_token_id(tokenizer), calls=calls)
    # special tokens decoded as their text, as nanochat's tokenizer.decode does (the calculator's included)
    completions = [tokenizer.decode(reply, skip_special_tokens=False) for reply, _ in replies]
    with ThreadPoolExecutor(max_workers=EXECUTION_WORKERS) as pool:  # HumanEval: programs run in parallel
        checked = list(pool.map(lambda pair: check_reply(name, *pair), zip(mine, completions)))
    outcomes = {problem.index: passed for problem, (passed, _) in zip(mine, checked)}
    counts = [sum(cut for _, cut in replies), sum(timeout for _, timeout in checked),
              tool.calls if tool is not None else 0, sum(len(row) > NANOCHAT_PROMPT_TOKENS for row in rows)]
    passed, counts = _combine(outcomes, len(problems), counts, device)
    return _result(name, passed, started, cut_at_max_new_tokens=counts[0], execution_timeouts=counts[1],
                   calculator_calls=counts[2], long_prompts=counts[3],
                   replies={problem.index: completion for problem, completion in zip(mine, completions)})


def evaluate_chatcore(model, tokenizer, problems: dict[str, list[Problem]], *,
                      max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, batch_size: int = DEFAULT_BATCH_SIZE
                      ) -> ChatCoreResults:
    """ChatCORE of `model` over `problems` (task name -> its problems, `hfl3.evaluate.chat_tasks.load_problems`), in
    nanochat's task order, the model in eval mode and put back as it was (a collective under torch.distributed; the
    main process logs each task).

    Args:
        model: a causal LM (or a PEFT model of one); `generate` and `model(input_ids=...).logits`.
        tokenizer: its tokenizer, with a chat template.
        problems: the tasks to evaluate and their problems.
        max_new_tokens: the longest generated reply, in tokens.
        batch_size: prompts per forward (categorical) or per `generate` call.
    """
    rank, world_size = _distributed()
    was_training = model.training
    model.eval()
    results = []
    try:
        for name in (name for name in TASKS if name in problems):
            if TASKS[name].kind == "categorical":
                result = evaluate_categorical(model, tokenizer, name, problems[name], batch_size)
            else:
                result = evaluate_generative(model, tokenizer, name, problems[name], max_new_tokens=max_new_tokens,
                                             batch_size=batch_size)
            results.append(result)
            if rank == 0:
                logger.info("ChatCORE %s (%s, %d problems): accuracy %.4f | centered %.4f | %.1f s", name,
                            result.kind, len(result.passed), result.accuracy, result.centered, result.seconds)
                if result.long_prompts:
                    logger.warning("ChatCORE %s: %d prompt(s) over 2048 tokens, kept whole (nanochat cuts "
                                   "conversations to their first 2048 tokens)", name, result.long_prompts)
    finally:
        model.train(was_training)
    evaluated = {result.name: result for result in results}

    def centered_mean(names) -> float | None:
        if not all(name in evaluated for name in names):
            return None
        return math.fsum(evaluated[name].centered for name in names) / len(names)

    settings = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "num_processes": world_size,
                "problems": {name: len(items) for name, items in problems.items()}}
    return ChatCoreResults(results, centered_mean(TASKS), centered_mean(CATEGORICAL), settings)


def chatcore_eval_results(summary: dict) -> list:
    """The model card's `model-index` entries (`huggingface_hub.EvalResult`) for a `ChatCoreResults.summary()`:
    ChatCORE when computed, then each task's accuracy (dataset: the task's Hub id, config and split)."""
    from huggingface_hub import EvalResult

    common = dict(task_type="text-generation", task_name="Chat evaluation (ChatCORE, nanochat)")
    results = []
    if summary.get("chatcore") is not None:
        results.append(EvalResult(**common, dataset_type="chatcore", dataset_name="ChatCORE (5 tasks)",
                                  metric_type="chatcore_metric", metric_name="ChatCORE (mean centered accuracy)",
                                  metric_value=round(summary["chatcore"], 4)))
    for name, task in summary["tasks"].items():
        spec = TASKS[name]
        results.append(EvalResult(**common, dataset_type=spec.hub_id, dataset_name=name, dataset_config=spec.config,
                                  dataset_split=spec.split, metric_type="accuracy",
                                  metric_value=round(task["accuracy"], 4)))
    return results
