"""ChatCORE's speed on a 135M-class model on this machine, beside nanochat's own chat_eval on the same weights, and
what `--chatcore_every` costs an SFT run at nanochat's settings.

- The model: a nanochat master chat checkpoint of d12's shape (12 layers, hidden 768, 6 heads, window pattern SSSL,
  value embeddings; a BPE of 8,192 tokens trained on the text fixtures: 135M parameters), random weights, written in
  nanochat's format (tests/nanochat_reference.py) and converted with `hfl3.nanochat`; float32. A random model rarely
  ends its reply, so generative problems run to `--max_new_tokens` (nanochat's 512): an upper bound on a trained
  model's time.
- Problems/s per task on the fixture rows (tests/fixtures/chatcore): hfl3's `evaluate_chatcore` with categorical
  prompts and generated replies in batches of `--batch_size` ("batched"), its replies one at a time ("one at a time"),
  and, with `--nanochat_dir` (a checkout; tiktoken installed), nanochat's `run_chat_eval` (categorical batches of
  `--batch_size`, one problem at a time through its Engine) in a fresh process on the same checkpoint. A warm-up pass
  first in each process; each arm timed once.
- The SFT share: nanochat chat_sft evaluates ChatCORE every 200 steps with every categorical problem (ARC-Easy 2,376,
  ARC-Challenge 1,172, MMLU 14,042: the test splits' sizes) and 24 of each generative task, and steps on 2^19 tokens
  (its d12 total batch). A training step's time is measured (forward + backward + AdamW on `--train_rows` rows of
  `--train_length` tokens, median of `--train_steps`) and scaled to 2^19 tokens; ChatCORE's time is the measured
  per-problem times times those counts. share = ChatCORE / (200 steps + ChatCORE).

    OMP_NUM_THREADS=1 python benchmarks/chatcore.py --nanochat_dir build/nanochat \
        --json benchmarks/results/chatcore_cpu.json
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from hfl3.evaluate.chat_tasks import TASKS, load_problems
from hfl3.evaluate.chatcore import evaluate_chatcore
from hfl3.nanochat.convert_nanochat_to_hf import convert

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, in_fresh_process, machine_name, shown_path, write_result  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "tests"))  # nanochat's file formats, as the tests write them
from nanochat_chat_eval import write_nanochat_task_data  # noqa: E402
from nanochat_reference import Spec, random_weights, train_ranks, write_checkpoint, write_tokenizer_pickle  # noqa: E402

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "chatcore"
NANOCHAT_PROBLEMS = {"ARC-Easy": 2376, "ARC-Challenge": 1172, "MMLU": 14042, "GSM8K": 24, "HumanEval": 24}
NANOCHAT_EVERY = 200  # scripts/chat_sft.py --chatcore-every
NANOCHAT_STEP_TOKENS = 2**19  # d12's total batch, which chat_sft inherits


@dataclass
class Args:
    nanochat_dir: str | None = field(default=None, metadata={"help": "a nanochat checkout: adds nanochat's arm"})
    max_new_tokens: int = field(default=512, metadata={"help": "longest reply (nanochat's 512)"})
    batch_size: int = field(default=8, metadata={"help": "prompts per forward or generate call"})
    generative_problems: int = field(default=4, metadata={"help": "GSM8K and HumanEval problems timed"})
    vocab_size: int = field(default=8192, metadata={"help": "the BPE's vocabulary, its 9 special tokens included"})
    train_rows: int = field(default=1, metadata={"help": "rows per timed training step"})
    train_length: int = field(default=256, metadata={"help": "tokens per row"})
    train_steps: int = field(default=3, metadata={"help": "timed training steps (median), after one warm-up"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})


def build(base: Path, vocab_size: int) -> Path:
    """nanochat's base folder (tokenizer, chat checkpoint, task data) under `base`; returns the converted folder."""
    text = "".join(path.read_text(encoding="utf-8") for path in sorted((REPO_ROOT / "tests" / "fixtures" / "text")
                                                                      .rglob("*.txt")))
    ranks = train_ranks(text, vocab_size - 9)
    write_tokenizer_pickle(base / "tokenizer", ranks)
    spec = Spec("master", vocab=len(ranks) + 9, sequence_len=2048, n_layer=12, n_head=6, n_kv_head=6, n_embd=768,
                window_pattern="SSSL")
    checkpoint = write_checkpoint(base / "chatsft_checkpoints" / "d12", random_weights(spec, seed=0), spec, step=1)
    write_nanochat_task_data(base, FIXTURES)
    return convert(checkpoint, base / "tokenizer", base / "hf")


def nanochat_seconds_per_problem(nanochat_dir: str, base: str, counts: dict[str, int], max_new_tokens: int,
                                 batch_size: int) -> dict[str, float]:
    """nanochat's `run_chat_eval` per task on `base`'s checkpoint (a fresh process: nanochat imported from the
    checkout, its tokenizer trainer stubbed), after a warm-up; seconds per problem."""
    import types

    os.environ["NANOCHAT_BASE_DIR"] = base
    sys.path.insert(0, nanochat_dir)
    sys.modules["rustbpe"] = types.ModuleType("rustbpe")
    from nanochat.checkpoint_manager import load_model
    from nanochat.engine import Engine
    from scripts.chat_eval import run_chat_eval

    torch.set_grad_enabled(False)
    model, tokenizer, _ = load_model("sft", torch.device("cpu"), phase="eval")
    engine = Engine(model, tokenizer)
    for name in counts:  # warm-up
        run_chat_eval(name, model, tokenizer, engine, batch_size=2, max_new_tokens=4, max_problems=2)
    seconds = {}
    for name, count in counts.items():
        started = time.perf_counter()
        run_chat_eval(name, model, tokenizer, engine, batch_size=batch_size, max_new_tokens=max_new_tokens,
                      max_problems=count)
        seconds[name] = (time.perf_counter() - started) / count
    return seconds


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


def run_sft_share(per_problem: dict[str, float], step_seconds: float) -> tuple[float, float]:
    """(ChatCORE's seconds at nanochat chat_sft's settings, its share of a run evaluating every 200 steps)."""
    seconds = sum(per_problem[name] * count for name, count in NANOCHAT_PROBLEMS.items())
    return seconds, seconds / (NANOCHAT_EVERY * step_seconds + seconds)


def main(args: Args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_chatcore_") as work:
        return measure(args, Path(work))


def measure(args: Args, work: Path) -> dict:
    folder = build(work, args.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    problems = {name: load_problems(name, FIXTURES, args.generative_problems if task.kind == "generative" else None)
                for name, task in TASKS.items()}
    evaluate_chatcore(model, tokenizer, {name: items[:2] for name, items in problems.items()}, max_new_tokens=4,
                      batch_size=2)  # warm-up
    per_problem: dict[str, dict[str, float]] = {}
    cut = {}
    for arm, batch_size in (("batched", args.batch_size), ("one at a time", 1)):
        chosen = problems if arm == "batched" else {n: p for n, p in problems.items() if TASKS[n].kind == "generative"}
        results = evaluate_chatcore(model, tokenizer, chosen, max_new_tokens=args.max_new_tokens,
                                    batch_size=batch_size)
        per_problem[arm] = {task.name: task.seconds / len(task.passed) for task in results.tasks}
        cut[arm] = {task.name: task.cut_at_max_new_tokens for task in results.tasks if task.kind == "generative"}
    if args.nanochat_dir:
        counts = {name: len(items) for name, items in problems.items()}
        per_problem["nanochat"] = in_fresh_process(nanochat_seconds_per_problem, str(Path(args.nanochat_dir).resolve()),
                                                   str(work), counts, args.max_new_tokens, args.batch_size)
    per_token = seconds_per_training_token(model, args.train_rows, args.train_length, args.train_steps)
    step_seconds = per_token * NANOCHAT_STEP_TOKENS
    unbatched = {**per_problem["batched"], **per_problem["one at a time"]}
    shares = {"batched": run_sft_share(per_problem["batched"], step_seconds),
              "one at a time": run_sft_share(unbatched, step_seconds)}
    if "nanochat" in per_problem:
        shares["nanochat"] = run_sft_share(per_problem["nanochat"], step_seconds)
    arms = list(per_problem)
    print(f"{'task':<14} {'problems':>8} " + " ".join(f"{arm + ' problems/s':>24}" for arm in arms)
          + (f" {'batched / nanochat':>19}" if "nanochat" in arms else ""))
    for name in TASKS:
        rates = [f"{1 / per_problem[arm][name]:>24.3f}" if name in per_problem[arm] else f"{'-':>24}" for arm in arms]
        ratio = (f" {per_problem['nanochat'][name] / per_problem['batched'][name]:>18.2f}×"
                 if "nanochat" in arms else "")
        print(f"{name:<14} {len(problems[name]):>8} " + " ".join(rates) + ratio)
    print(f"training step of 2^19 tokens: {step_seconds:.0f} s ({1 / per_token:.0f} tok/s); ChatCORE at nanochat "
          f"chat_sft's settings, its share of a run evaluating every {NANOCHAT_EVERY} steps: "
          + "; ".join(f"{arm} {seconds:.0f} s, {100 * share:.2f} %" for arm, (seconds, share) in shares.items()))
    return write_result(args.json, {
        "machine": machine_name("cpu"), "threads": torch.get_num_threads(),
        "arguments": asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir)},
        "parameters": model.num_parameters(), "replies_cut_at_max_new_tokens": cut,
        "problems_per_second": {arm: {name: 1 / s for name, s in values.items()} for arm, values in
                                per_problem.items()},
        "train_tokens_per_second": 1 / per_token, "step_seconds_2e19_tokens": step_seconds,
        "chatcore_seconds_nanochat_settings": {arm: seconds for arm, (seconds, _) in shares.items()},
        "share_of_sft_run": {arm: share for arm, (_, share) in shares.items()},
        "nanochat_settings": {"every": NANOCHAT_EVERY, "problems": NANOCHAT_PROBLEMS,
                              "step_tokens": NANOCHAT_STEP_TOKENS}})


if __name__ == "__main__":
    main(HfArgumentParser(Args).parse_args_into_dataclasses()[0])
