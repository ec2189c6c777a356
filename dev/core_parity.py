"""One-off proof that hfl3's CORE evaluation equals nanochat's own `evaluate_task` (karpathy/nanochat 92d63d4,
nanochat/core_eval.py) for the same model and items; results in dev/LOG.md.

    # 1. a small bundle in nanochat's layout, built from local text (lines split into words; seeded)
    python dev/core_parity.py make_bundle --output_dir build/core_bundle_text \
        --source tests/fixtures/text/gutenberg/*.txt
    # 2. per task: nanochat's evaluate_task and per-item evaluate_example vs hfl3's evaluate_task, and the prompts
    python dev/core_parity.py compare --model_name_or_path outputs/demo --core_bundle_dir build/core_bundle_text \
        --nanochat_dir /path/to/nanochat

The tasks mirror the real bundle's kinds: `lm_last_word` (language modelling, 0-shot, like LAMBADA) and
`lm_last_word_5shot` ("\\nAnswer: " delimiter), `mc_last_word` (multiple choice among the true last word and three
others, 10-shot and 0-shot), `schema_first_half` (which first half goes with the second half, 0-shot). nanochat's
code is imported from `--nanochat_dir` and given the model as `model(input_ids) -> logits` (no `max_seq_len`: not
cropped, as hfl3 does not crop L3GPT) and the HF tokenizer as nanochat's tokenizer interface.
"""

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import torch


def lines_of_words(sources: list[str], min_words: int = 6, max_words: int = 24) -> list[list[str]]:
    """Sentences (prose: split at . ! ?) or lines (code) of `min_words`..`max_words` whitespace-separated words."""
    pieces = []
    for source in sources:
        text = Path(source).read_text(encoding="utf-8", errors="replace")
        for piece in re.split(r"(?<=[.!?])\s+|\n", text):
            words = piece.split()
            if min_words <= len(words) <= max_words:
                pieces.append(words)
    return list(dict.fromkeys(map(tuple, pieces)))


def make_bundle(output_dir: Path, sources: list[str], items: int, seed: int, lm_max_word_chars: int) -> None:
    rng = random.Random(seed)
    pieces = [list(words) for words in lines_of_words(sources)]
    rng.shuffle(pieces)
    if len(pieces) < 3 * items:
        raise SystemExit(f"{len(pieces)} usable lines in the sources; need {3 * items}")
    mc, schema = pieces[items:2 * items], pieces[2 * items:3 * items]
    # language modelling: lines ending in a short word when asked (a small model then gets some right)
    lm = [words for words in pieces if len(words[-1]) <= lm_max_word_chars][:items] if lm_max_word_chars else \
        pieces[:items]
    data = output_dir / "eval_data" / "text"
    data.mkdir(parents=True, exist_ok=True)

    def write(name: str, rows: list[dict]) -> None:
        (data / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    write("last_word.jsonl", [{"context": " ".join(w[:-1]) + rng.choice(["", " "]), "continuation": w[-1]}
                              for w in lm])
    mc_rows = []
    for words in mc:
        others = [rng.choice(pieces)[-1] for _ in range(3)]
        gold = rng.randrange(4)
        mc_rows.append({"query": " ".join(words[:-1]), "choices": others[:gold] + [words[-1]] + others[gold:],
                        "gold": gold})
    write("mc_last_word.jsonl", mc_rows)
    schema_rows = []
    for words in schema:
        half = len(words) // 2
        other = rng.choice(pieces)
        gold = rng.randrange(2)
        options = [" ".join(other[:len(other) // 2])]
        options.insert(gold, " ".join(words[:half]))
        schema_rows.append({"context_options": options, "continuation": " ".join(words[half:]), "gold": gold})
    write("schema.jsonl", schema_rows)
    (output_dir / "core.yaml").write_text("""icl_tasks:
- {label: lm_last_word, dataset_uri: text/last_word.jsonl, num_fewshot: [0], icl_task_type: language_modeling}
- label: lm_last_word_5shot
  dataset_uri: text/last_word.jsonl
  num_fewshot: [5]
  icl_task_type: language_modeling
  continuation_delimiter: "\\nAnswer: "
- {label: mc_last_word, dataset_uri: text/mc_last_word.jsonl, num_fewshot: [10], icl_task_type: multiple_choice}
- {label: mc_last_word_zeroshot, dataset_uri: text/mc_last_word.jsonl, num_fewshot: [0],
   icl_task_type: multiple_choice}
- {label: schema_first_half, dataset_uri: text/schema.jsonl, num_fewshot: [0], icl_task_type: schema}
""", encoding="utf-8")
    (output_dir / "eval_meta_data.csv").write_text(
        "Eval Task,Random baseline\nlm_last_word,0\nlm_last_word_5shot,0\nmc_last_word,25\nmc_last_word_zeroshot,25\n"
        "schema_first_half,50\n", encoding="utf-8")
    print(f"wrote {output_dir}: {items} items per file from {len(sources)} source(s)")


class NanochatTokenizer:
    """An HF tokenizer behind nanochat's tokenizer interface (`__call__(texts, prepend=id)`, `get_bos_token_id`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_bos_token_id(self):
        return self.tokenizer.bos_token_id

    def __call__(self, texts, prepend=None):
        ids = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [([prepend] if prepend is not None else []) + list(row) for row in ids]


class NanochatModel(torch.nn.Module):
    """An HF causal LM behind nanochat's model interface: `model(input_ids) -> logits`."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits.float()


def compare(args) -> None:
    import hfl3  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfl3.evaluate import evaluate_task, load_core_bundle
    from hfl3.evaluate.core import fewshot_examples, render_prompts

    sys.path.insert(0, str(args.nanochat_dir))
    from nanochat import core_eval

    renderers = {"multiple_choice": core_eval.render_prompts_mc, "schema": core_eval.render_prompts_schema,
                 "language_modeling": core_eval.render_prompts_lm}
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    nanochat_model, nanochat_tokenizer = NanochatModel(model), NanochatTokenizer(tokenizer)
    bundle = load_core_bundle(args.core_bundle_dir, args.max_per_task)
    print(f"{'task':<24} {'items':>5} {'nanochat':>9} {'hfl3':>9} {'items differing':>16} {'prompts differing':>18} "
          f"{'nanochat s':>10} {'hfl3 s':>7}")
    total_differing, seconds = 0, [0.0, 0.0]
    for task in bundle.tasks:
        meta = {"task_type": task.task_type, "num_fewshot": task.num_fewshot,
                "continuation_delimiter": task.continuation_delimiter}
        started = time.perf_counter()
        reference = core_eval.evaluate_task(nanochat_model, nanochat_tokenizer, task.items, "cpu", meta)
        middle = time.perf_counter()
        ours = evaluate_task(model, tokenizer, task)
        timing = (middle - started, time.perf_counter() - middle)
        seconds = [total + part for total, part in zip(seconds, timing)]
        per_item = [bool(core_eval.evaluate_example(i, nanochat_model, nanochat_tokenizer, task.items, "cpu", meta))
                    for i in range(len(task.items))]
        prompts_differing = sum(
            render_prompts(task.task_type, item, task.continuation_delimiter, shots) != renderers[task.task_type](
                item, task.continuation_delimiter, shots)
            for i, item in enumerate(task.items) for shots in [fewshot_examples(task.items, i, task.num_fewshot)])
        differing = sum(a != b for a, b in zip(per_item, ours.correct))
        total_differing += differing + prompts_differing + (abs(reference - ours.accuracy) > 1e-6)
        print(f"{task.label:<24} {len(task.items):>5} {reference:>9.4f} {ours.accuracy:>9.4f} {differing:>16} "
              f"{prompts_differing:>18} {timing[0]:>10.1f} {timing[1]:>7.1f}")
    ratio = seconds[0] / seconds[1]
    print("identical" if total_differing == 0 else f"{total_differing} differences",
          f"| evaluate_task time, nanochat / hfl3: {seconds[0]:.1f} s / {seconds[1]:.1f} s = {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make_bundle")
    make.add_argument("--output_dir", type=Path, required=True)
    make.add_argument("--source", nargs="+", required=True)
    make.add_argument("--items", type=int, default=100)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--lm_max_word_chars", type=int, default=0, help="language-modelling items end in a word of "
                      "at most this many characters (0: any)")
    run = commands.add_parser("compare")
    run.add_argument("--model_name_or_path", required=True)
    run.add_argument("--core_bundle_dir", required=True)
    run.add_argument("--nanochat_dir", type=Path, required=True)
    run.add_argument("--max_per_task", type=int, default=-1)
    args = parser.parse_args()
    if args.command == "make_bundle":
        make_bundle(args.output_dir, args.source, args.items, args.seed, args.lm_max_word_chars)
    else:
        torch.set_grad_enabled(False)
        compare(args)


if __name__ == "__main__":
    main()
