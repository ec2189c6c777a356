"""ChatCORE's speed on a 135M-class model on this machine, and what `--chatcore_every` costs an SFT run at nanochat's
settings.

- The model: a dense L3GPT of nanochat's d12 shape (12 layers, hidden 768, value embeddings; vocabulary 8,192 from a
  byte-level BPE trained on the text fixtures: 135M parameters), random weights, float32. A random model never ends
  its reply, so every generative problem runs to `--max_new_tokens` (nanochat's 512): an upper bound on the time a
  trained model takes.
- Problems/s per task (`evaluate_chatcore` on the fixture rows, tests/fixtures/chatcore): the categorical tasks in
  batches of `--batch_size` prompts; the generative ones batched (`--batch_size` replies per `generate`) and one at a
  time (nanochat chat_eval's way), each timed once (a warm-up pass first).
- The SFT share: nanochat chat_sft evaluates ChatCORE every 200 steps with every categorical problem (ARC-Easy 2,376,
  ARC-Challenge 1,172, MMLU 14,042: the test splits' sizes) and 24 of each generative task, and steps on 2^19 tokens
  (its d12 total batch). A training step's time is measured (forward + backward + AdamW on `--train_rows` rows of
  `--train_length` tokens, median of `--train_steps`) and scaled to 2^19 tokens; ChatCORE's time is the measured
  per-problem times times those counts. share = ChatCORE / (200 steps + ChatCORE).

    OMP_NUM_THREADS=1 python benchmarks/chatcore.py --json benchmarks/results/chatcore_cpu.json
"""

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.evaluate.chat_tasks import TASKS, load_problems
from hfl3.evaluate.chatcore import evaluate_chatcore
from hfl3.tokenization import train_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, machine_name, write_result  # noqa: E402

NANOCHAT_PROBLEMS = {"ARC-Easy": 2376, "ARC-Challenge": 1172, "MMLU": 14042, "GSM8K": 24, "HumanEval": 24}
NANOCHAT_EVERY = 200  # scripts/chat_sft.py --chatcore-every
NANOCHAT_STEP_TOKENS = 2**19  # d12's total batch, which chat_sft inherits


@dataclass
class Args:
    max_new_tokens: int = field(default=512, metadata={"help": "longest reply (nanochat's 512)"})
    batch_size: int = field(default=8, metadata={"help": "prompts per forward or generate call"})
    generative_problems: int = field(default=4, metadata={"help": "GSM8K and HumanEval problems timed"})
    vocab_size: int = field(default=8192, metadata={"help": "the BPE's vocabulary"})
    train_rows: int = field(default=1, metadata={"help": "rows per timed training step"})
    train_length: int = field(default=256, metadata={"help": "tokens per row"})
    train_steps: int = field(default=3, metadata={"help": "timed training steps (median), after one warm-up"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})


def build(vocab_size: int):
    texts = [path.read_text(encoding="utf-8") for path in sorted((REPO_ROOT / "tests" / "fixtures" / "text").rglob(
        "*.txt"))]
    tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(12, vocab_size=len(tokenizer), l3_after_layers=[], max_position_embeddings=2048)
    model = L3GPTForCausalLM(config).eval()
    with torch.no_grad():  # nanochat zero-initialises the output projections: give them values, as training would
        for parameter in model.parameters():
            if parameter.ndim == 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    return model, tokenizer


def seconds_per_training_token(model, rows: int, length: int, steps: int) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    times = []
    for step in range(steps + 1):
        input_ids = torch.randint(0, model.config.vocab_size, (rows, length))
        started = time.perf_counter()
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up
            times.append(time.perf_counter() - started)
    model.eval()
    return statistics.median(times) / (rows * length)


def main(args: Args) -> dict:
    model, tokenizer = build(args.vocab_size)
    fixtures = REPO_ROOT / "tests" / "fixtures" / "chatcore"
    problems = {name: load_problems(name, fixtures, args.generative_problems if task.kind == "generative" else None)
                for name, task in TASKS.items()}
    evaluate_chatcore(model, tokenizer, {name: items[:2] for name, items in problems.items()}, max_new_tokens=4,
                      batch_size=2)  # warm-up
    arms = {"batched": args.batch_size, "one at a time": 1}
    per_problem: dict[str, dict[str, float]] = {arm: {} for arm in arms}
    for arm, batch_size in arms.items():
        chosen = problems if arm == "batched" else {n: p for n, p in problems.items() if TASKS[n].kind == "generative"}
        results = evaluate_chatcore(model, tokenizer, chosen, max_new_tokens=args.max_new_tokens,
                                    batch_size=batch_size)
        per_problem[arm] = {task.name: task.seconds / len(task.passed) for task in results.tasks}
    per_token = seconds_per_training_token(model, args.train_rows, args.train_length, args.train_steps)
    step_seconds = per_token * NANOCHAT_STEP_TOKENS
    chatcore_seconds = sum(per_problem["batched"][name] * count for name, count in NANOCHAT_PROBLEMS.items())
    one_at_a_time = chatcore_seconds + sum(
        (per_problem["one at a time"][name] - per_problem["batched"][name]) * NANOCHAT_PROBLEMS[name]
        for name in per_problem["one at a time"])
    share = chatcore_seconds / (NANOCHAT_EVERY * step_seconds + chatcore_seconds)
    share_unbatched = one_at_a_time / (NANOCHAT_EVERY * step_seconds + one_at_a_time)
    print(f"{'task':<14} {'problems':>8} {'batched problems/s':>19} {'one at a time':>14} {'ratio':>6}")
    for name in TASKS:
        batched = 1 / per_problem["batched"][name]
        single = 1 / per_problem["one at a time"][name] if name in per_problem["one at a time"] else None
        print(f"{name:<14} {len(problems[name]):>8} {batched:>19.3f} "
              + (f"{single:>14.3f} {batched / single:>5.2f}×" if single else f"{'(batched only)':>14}"))
    print(f"training step of 2^19 tokens: {step_seconds:.0f} s ({1 / per_token:.0f} tok/s); ChatCORE at nanochat's "
          f"settings: {chatcore_seconds:.0f} s batched, {one_at_a_time:.0f} s one problem at a time; share of a run "
          f"evaluating every {NANOCHAT_EVERY} steps: {100 * share:.2f} % ({100 * share_unbatched:.2f} % unbatched)")
    return write_result(args.json, {
        "machine": machine_name("cpu"), "threads": torch.get_num_threads(), "arguments": asdict(args),
        "parameters": model.num_parameters(),
        "problems_per_second": {arm: {name: 1 / s for name, s in values.items()} for arm, values in
                                per_problem.items()},
        "train_tokens_per_second": 1 / per_token, "step_seconds_2e19_tokens": step_seconds,
        "chatcore_seconds_nanochat_settings": chatcore_seconds, "chatcore_seconds_one_at_a_time": one_at_a_time,
        "share_of_sft_run": share, "share_of_sft_run_one_at_a_time": share_unbatched,
        "nanochat_settings": {"every": NANOCHAT_EVERY, "problems": NANOCHAT_PROBLEMS,
                              "step_tokens": NANOCHAT_STEP_TOKENS}})


if __name__ == "__main__":
    main(HfArgumentParser(Args).parse_args_into_dataclasses()[0])
