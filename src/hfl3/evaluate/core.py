"""The CORE metric (DCLM, arXiv 2406.11794 section 3.5 and appendix G) for any causal LM, as nanochat computes it
(karpathy/nanochat 92d63d4, nanochat/core_eval.py and scripts/base_eval.py): the same items, few-shot picks, prompts,
token boundaries and scoring, with an HF tokenizer and batched forwards.

Per item (`CoreTask.items[i]`):
- few-shot examples: `random.Random(1234 + i).sample(other items' indices, num_fewshot)`;
- prompts (`render_prompts`): each shot is `context + delimiter + answer + "\\n\\n"`, then the item; one prompt per
  choice (multiple choice) or per context option (schema); for language modelling the prompt without its
  continuation (stripped) and with it;
- tokens: each prompt is encoded whole (`add_special_tokens=False`, special-token text encoded as text), BOS first
  (see below); the scored span is what follows the choices' common token prefix (multiple choice), the options'
  common token suffix (schema), or the prompt without the continuation (language modelling); prompts longer than
  `max_length` keep their last `max_length` tokens;
- correct: multiple choice and schema, the option whose span has the lowest mean cross-entropy is `gold` (the first
  one on a tie); language modelling, the argmax prediction equals every span token.
Accuracy per task; centered accuracy `(acc - b) / (1 - b)` with b the task's random baseline; CORE is the mean of the
centered accuracies.

BOS: nanochat prepends its `<|bos|>` to every prompt, as every training document starts with it. hfl3 prepends the
tokenizer's `bos_token_id` when it has one (`prepend_bos=None`): hfl3's own tokenizers (`<|bos|>`, which the packing
puts before every document) and GPT-2's `<|endoftext|>` (what nanochat used for GPT-2). A tokenizer without one
(Qwen3) gets nothing prepended; its first prompt token is then context only, never scored.

Batching: each process scores its items (`i = rank, rank + world_size, ...`, nanochat's split) as right-padded rows
sorted by length, up to `batch_tokens` tokens per forward, without an attention mask: in a causal LM a scored
position never sees the padding after it (as lm-evaluation-harness scores log-likelihoods). The per-item results
are summed across processes (`torch.distributed.all_reduce`); every process runs the same number of forwards, since
ZeRO-3 and FSDP gather the weights inside each one.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hfl3.evaluate.bundle import CoreBundle, CoreTask

logger = logging.getLogger(__name__)

FEWSHOT_SEED = 1234  # nanochat core_eval.py: random.Random(1234 + item index)
DEFAULT_BATCH_TOKENS = 8192


def fewshot_examples(items: Sequence[dict], index: int, num_fewshot: int) -> list[dict]:
    """The `num_fewshot` examples shown before `items[index]`: a seeded sample of the other items (nanochat's)."""
    if num_fewshot == 0:
        return []
    others = [i for i in range(len(items)) if i != index]
    return [items[i] for i in random.Random(FEWSHOT_SEED + index).sample(others, num_fewshot)]


def render_prompts(task_type: str, item: dict, delimiter: str, fewshot: Sequence[dict] = ()) -> list[str]:
    """The prompts of `item`: one per choice (`multiple_choice`), one per context option (`schema`), or the prompt
    without its continuation (whitespace stripped at both ends) and with it (`language_modeling`). Values are shown
    with `str()`, as nanochat's Jinja templates show them; language-modelling contexts are stripped."""
    if task_type == "multiple_choice":
        shots = "".join(f"{shot['query']}{delimiter}{shot['choices'][shot['gold']]}\n\n" for shot in fewshot)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        shots = "".join(f"{shot['context_options'][shot['gold']]}{delimiter}{shot['continuation']}\n\n"
                        for shot in fewshot)
        return [f"{shots}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]
    if task_type == "language_modeling":
        shots = "".join(f"{str(shot['context']).strip()}{delimiter}{shot['continuation']}\n\n" for shot in fewshot)
        prompt = f"{shots}{str(item['context']).strip()}{delimiter}"
        return [prompt.strip(), f"{prompt}{item['continuation']}"]
    raise ValueError(f"unknown task type {task_type!r}")


def common_length(sequences: Sequence[Sequence[int]], from_end: bool = False) -> int:
    """Length of the longest common prefix (or suffix, `from_end`) of token sequences."""
    shortest = min(len(sequence) for sequence in sequences)
    for offset in range(shortest):
        position = -1 - offset if from_end else offset
        if any(sequence[position] != sequences[0][position] for sequence in sequences):
            return offset
    return shortest


@dataclass
class ScoredSequence:
    """One row to score: `input_ids` and the span `[start, end)` of the tokens scored (each predicted from the
    position before it); `item` and `option` say whose it is."""

    item: int
    option: int
    input_ids: list[int]
    start: int
    end: int


def item_sequences(task: CoreTask, index: int, token_ids: list[list[int]], max_length: int | None) -> tuple[
        list[ScoredSequence], bool]:
    """The rows of item `index` from its prompts' tokens (BOS already prepended), cropped on the left to
    `max_length`; and whether a language-modelling prompt's tokens without the continuation were not a prefix of its
    tokens with it (the span then starts at the first token where they differ; nanochat stops on an assertion).

    Raises:
        ValueError: a span would start at position 0 (nothing before it to predict it from) or is empty.
    """
    boundary_moved = False
    if task.task_type == "multiple_choice":
        start = common_length(token_ids)
        spans = [(ids, start, len(ids)) for ids in token_ids]
    elif task.task_type == "schema":
        suffix = common_length(token_ids, from_end=True)
        spans = [(ids, len(ids) - suffix, len(ids)) for ids in token_ids]
    else:
        without, with_continuation = token_ids
        start = common_length(token_ids)
        boundary_moved = start < len(without)
        if start == len(with_continuation):
            raise ValueError(f"task {task.label}, item {index}: the continuation adds no token")
        spans = [(with_continuation, start, len(with_continuation))]
    rows = []
    for option, (ids, start, end) in enumerate(spans):
        crop = len(ids) - max_length if max_length and len(ids) > max_length else 0
        if start - crop < 1:
            raise ValueError(f"task {task.label}, item {index}: nothing precedes the scored tokens"
                             + (f" within max_length={max_length}" if crop else " (no BOS token and no context)"))
        rows.append(ScoredSequence(index, option, ids[crop:], start - crop, end - crop))
    return rows, boundary_moved


def default_max_length(model) -> int | None:
    """The longest row a model is given: none for L3GPT (nanochat's GPT, which nanochat never crops: rotary
    positions run past the training length), else `config.max_position_embeddings` when set (GPT-2's 1024 learned
    positions; nanochat crops a model that has a `max_seq_len` the same way)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "l3gpt":
        return None
    return getattr(config, "max_position_embeddings", None)


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    return torch.device(device) if device is not None else next(model.parameters()).device


def _batches(sequences: list[ScoredSequence], batch_tokens: int) -> list[list[ScoredSequence]]:
    """Rows longest first, grouped so that rows × longest row ≤ `batch_tokens` (a longer row alone)."""
    batches: list[list[ScoredSequence]] = []
    for sequence in sorted(sequences, key=lambda s: len(s.input_ids), reverse=True):
        if batches and (len(batches[-1]) + 1) * len(batches[-1][0].input_ids) <= batch_tokens:
            batches[-1].append(sequence)
        else:
            batches.append([sequence])
    return batches


@torch.no_grad()
def score_batch(model, rows: list[ScoredSequence], pad_token_id: int) -> list[tuple[float, bool]]:
    """Forward `rows` as one right-padded batch; per row, the mean cross-entropy (nats, float32) of its span's tokens
    and whether the argmax prediction equals every one of them.

    The model is called as `model(input_ids=(B, T), use_cache=False)` and must return `.logits` `(B, T, vocab)`."""
    device = _model_device(model)
    width = max(len(row.input_ids) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    for r, row in enumerate(rows):
        input_ids[r, :len(row.input_ids)] = torch.tensor(row.input_ids, dtype=torch.long)
    input_ids = input_ids.to(device)
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, T, V)
    lengths = [row.end - row.start for row in rows]
    batch_index = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths)).to(device)  # (N,)
    positions = torch.cat([torch.arange(row.start - 1, row.end - 1) for row in rows]).to(device)  # (N,)
    targets = input_ids[batch_index, positions + 1]  # (N,)
    scored = logits[batch_index, positions].float()  # (N, V)
    losses = F.cross_entropy(scored, targets, reduction="none")  # (N,)
    hits = scored.argmax(dim=-1) == targets  # (N,)
    return [(float(loss.mean()), bool(hit.all())) for loss, hit in
            zip(losses.cpu().split(lengths), hits.cpu().split(lengths))]


@dataclass
class TaskResult:
    """A task's outcome: `accuracy` (share of its items correct), `centered` ((accuracy - b)/(1 - b), b = random
    baseline / 100), `correct` (per item, in `CoreTask.items` order), `boundary_moved` (language-modelling items whose
    continuation did not start on a token boundary), `seconds` (wall time)."""

    label: str
    task_type: str
    num_fewshot: int
    random_baseline: float
    accuracy: float
    centered: float
    correct: list[bool] = field(repr=False)
    boundary_moved: int = 0
    seconds: float = 0.0


def evaluate_task(model, tokenizer, task: CoreTask, *, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                  max_length: int | None = None, prepend_bos: bool | None = None) -> TaskResult:
    """Evaluate `model` on one task; with torch.distributed initialized, every process scores its share of the items
    and all get the combined result (a collective: call it on every process).

    Args:
        model: a causal LM, `model(input_ids=..., use_cache=False).logits` of shape `(batch_size, seq_len, vocab)`.
        tokenizer: its HF tokenizer.
        task: the task and its items (`hfl3.evaluate.load_core_bundle`).
        batch_tokens: padded tokens per forward (rows × longest row); a longer row goes alone.
        max_length: rows keep their last `max_length` tokens (None: whole; see `default_max_length`).
        prepend_bos: put `tokenizer.bos_token_id` first (None: when the tokenizer has one).

    Raises:
        ValueError: `prepend_bos=True` without a BOS token, or an item without tokens to score (`item_sequences`).
    """
    started = time.perf_counter()
    bos = _bos_token_id(tokenizer, prepend_bos)
    pad = next((i for i in (bos, tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    rank, world_size = _distributed()
    indices = list(range(rank, len(task.items), world_size))
    prompts = [render_prompts(task.task_type, task.items[i], task.continuation_delimiter,
                              fewshot_examples(task.items, i, task.num_fewshot)) for i in indices]
    flat = [prompt for item_prompts in prompts for prompt in item_prompts]
    encoded = tokenizer(flat, add_special_tokens=False, split_special_tokens=True)["input_ids"] if flat else []
    prefix = [bos] if bos is not None else []
    sequences, moved, offset, problem = [], 0, 0, None
    for index, item_prompts in zip(indices, prompts):
        token_ids = [prefix + list(ids) for ids in encoded[offset:offset + len(item_prompts)]]
        offset += len(item_prompts)
        try:
            rows, boundary_moved = item_sequences(task, index, token_ids, max_length)
        except ValueError as error:
            problem = problem or error
            continue
        sequences += rows
        moved += boundary_moved

    device = _model_device(model)
    batches = _batches(sequences, batch_tokens)
    # [forwards, failed]: the most forwards any process needs, and whether one of them found a bad item (each sees
    # only its share: all raise together instead of leaving the others waiting in a collective)
    plan = torch.tensor([len(batches), problem is not None], device=device)
    if world_size > 1:
        torch.distributed.all_reduce(plan, op=torch.distributed.ReduceOp.MAX)
    if plan[1]:
        raise problem or ValueError(f"task {task.label}: another process found an item it cannot score")
    scores: dict[tuple[int, int], tuple[float, bool]] = {}
    was_training = model.training
    model.eval()
    try:
        for number in range(int(plan[0])):
            if number < len(batches):
                scores.update({(row.item, row.option): score for row, score in
                               zip(batches[number], score_batch(model, batches[number], pad))})
            else:  # this process has fewer rows: a two-token forward keeps the collectives of ZeRO-3/FSDP in step
                score_batch(model, [ScoredSequence(-1, 0, [pad, pad], 1, 2)], pad)
    finally:
        model.train(was_training)

    # Per item: correct (0/1) on the process that scored it, 0 elsewhere; the last entry counts moved boundaries
    outcome = torch.zeros(len(task.items) + 1, dtype=torch.float64, device=device)
    for index in indices:
        outcome[index] = float(_is_correct(task, index, scores))
    outcome[-1] = moved
    if world_size > 1:
        torch.distributed.all_reduce(outcome)
    *flags, moved = outcome.tolist()
    flags = [bool(flag) for flag in flags]
    accuracy = sum(flags) / len(flags)
    baseline = task.random_baseline / 100
    return TaskResult(task.label, task.task_type, task.num_fewshot, task.random_baseline, accuracy,
                      (accuracy - baseline) / (1 - baseline), flags, int(moved), time.perf_counter() - started)


def _is_correct(task: CoreTask, index: int, scores: dict) -> bool:
    if task.task_type == "language_modeling":
        return scores[(index, 0)][1]
    item = task.items[index]
    options = item["choices"] if task.task_type == "multiple_choice" else item["context_options"]
    mean_losses = [scores[(index, option)][0] for option in range(len(options))]
    # nanochat's `min` + `index`: the first lowest; a NaN (an empty span) wins only in first place
    predicted = min(range(len(options)), key=lambda option: mean_losses[option])
    return predicted == item["gold"]


def _bos_token_id(tokenizer, prepend_bos: bool | None) -> int | None:
    if prepend_bos is False:
        return None
    if prepend_bos and tokenizer.bos_token_id is None:
        raise ValueError("prepend_bos=True but the tokenizer has no bos_token; set one or leave prepend_bos unset")
    return tokenizer.bos_token_id


@dataclass
class CoreResults:
    """Per-task results (`TaskResult`, in `core.yaml` order), `core_metric` (mean centered accuracy) and the bundle
    they come from (`CoreBundle.describe()`)."""

    tasks: list[TaskResult]
    core_metric: float
    bundle: dict

    def metrics(self) -> dict[str, float]:
        """Flat metrics for logs and all_results.json: `core_metric`, `core_accuracy/<task>`, `core_centered/<task>`."""
        metrics = {"core_metric": self.core_metric}
        for task in self.tasks:
            metrics[f"core_accuracy/{task.label}"] = task.accuracy
            metrics[f"core_centered/{task.label}"] = task.centered
        return metrics

    def summary(self) -> dict:
        """JSON-safe: nanochat's `results` (accuracy) and `centered_results` per task, `core_metric`, the bundle."""
        return {"core_metric": self.core_metric,
                "results": {task.label: task.accuracy for task in self.tasks},
                "centered_results": {task.label: task.centered for task in self.tasks},
                "bundle": self.bundle}

    def table(self) -> str:
        """A fixed-width table: task, type, shots, items, accuracy, centered; then CORE."""
        lines = [f"{'task':<36} {'type':<17} {'shots':>5} {'items':>6} {'accuracy':>9} {'centered':>9}"]
        for task in self.tasks:
            lines.append(f"{task.label:<36} {task.task_type:<17} {task.num_fewshot:>5} {len(task.correct):>6} "
                         f"{task.accuracy:>9.4f} {task.centered:>9.4f}")
        lines.append(f"{'CORE':<36} {'':<17} {'':>5} {'':>6} {'':>9} {self.core_metric:>9.4f}")
        return "\n".join(lines)


def evaluate_core(model, tokenizer, bundle: CoreBundle, *, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                  max_length: int | None = None, prepend_bos: bool | None = None) -> CoreResults:
    """The CORE metric of `model` over every task of `bundle` (see `evaluate_task` for the arguments; a collective
    under torch.distributed). Logs each task's accuracy on the main process.

    Returns:
        `CoreResults`; `core_metric` is the mean centered accuracy over the tasks (nanochat's, DCLM's CORE).
    """
    rank, _ = _distributed()
    results = []
    for task in bundle.tasks:
        result = evaluate_task(model, tokenizer, task, batch_tokens=batch_tokens, max_length=max_length,
                               prepend_bos=prepend_bos)
        results.append(result)
        if rank == 0:
            logger.info("CORE %s (%d-shot, %s, %d items): accuracy %.4f | centered %.4f | %.1f s", task.label,
                        task.num_fewshot, task.task_type, len(task.items), result.accuracy, result.centered,
                        result.seconds)
            if result.boundary_moved:
                logger.warning("CORE %s: %d item(s) whose continuation does not start on a token boundary of this "
                               "tokenizer (scored from the first differing token)", task.label, result.boundary_moved)
    core = math.fsum(task.centered for task in results) / len(results)
    return CoreResults(results, core, bundle.describe())


def core_eval_results(summary: dict) -> list:
    """The model card's `model-index` entries (`huggingface_hub.EvalResult`) for a `CoreResults.summary()`: CORE, then
    per task its accuracy and centered accuracy (the dataset named by the task's label and shots)."""
    from huggingface_hub import EvalResult

    tasks = summary.get("bundle", {}).get("tasks", {})
    common = dict(task_type="text-generation", task_name="In-context learning (CORE, DCLM)")
    results = [EvalResult(**common, dataset_type="core", dataset_name=f"CORE ({len(summary['results'])} tasks)",
                          metric_type="core_metric", metric_name="CORE (mean centered accuracy)",
                          metric_value=round(summary["core_metric"], 4))]
    for label, accuracy in summary["results"].items():
        shots = tasks.get(label, {}).get("num_fewshot")
        dataset = dict(dataset_type=label, dataset_name=label if shots is None else f"{label} ({shots}-shot)")
        results.append(EvalResult(**common, **dataset, metric_type="accuracy", metric_value=round(accuracy, 4)))
        results.append(EvalResult(**common, **dataset, metric_type="centered_accuracy",
                                  metric_name="accuracy centered on the random baseline",
                                  metric_value=round(summary["centered_results"][label], 4)))
    return results
