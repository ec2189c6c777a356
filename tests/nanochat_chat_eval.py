"""nanochat's own ChatCORE code (scripts/chat_eval.py `run_chat_eval`, its Engine and tasks/*.py), run from a checkout
on a checkpoint in `NANOCHAT_BASE_DIR`, for tests/test_chatcore_parity.py. Not part of hfl3: nanochat is imported
from the checkout given, never copied.

    NANOCHAT_BASE_DIR=BASE python tests/nanochat_chat_eval.py NANOCHAT_DIR MAX_NEW_TOKENS BATCH_SIZE EXPRESSIONS_JSON

The base folder holds `tokenizer/tokenizer.pkl`, `chatsft_checkpoints/<tag>/` and each task's data in nanochat's cache
layout (`task_data/<repo>/<subset>/<split>/manifest.json` + parquet). Prints one line `RESULT {json}`: per task its
accuracy, per problem the prompt's token ids, the answer nanochat evaluated (the letter, or the decoded completion)
and the outcome; and `use_calculator` of each expression. `write_nanochat_task_data` lays the fixture rows out there.
"""

import json
import sys
import types
from pathlib import Path


def write_nanochat_task_data(base: Path, fixtures: Path) -> None:
    """The ChatCORE fixture rows of `fixtures` as nanochat's `load_hub_dataset` caches a Hub dataset's parquet export
    (`base/task_data/<repo>/<subset>/<split>/`)."""
    import datasets

    from hfl3.evaluate.chat_tasks import TASKS

    for task in TASKS.values():
        folder = base / "task_data" / task.hub_id.replace("/", "--") / task.config / task.split
        folder.mkdir(parents=True, exist_ok=True)
        files = sorted(str(p) for p in (fixtures / task.hub_id / task.config).glob(f"{task.split}*"))
        datasets.load_dataset("json", data_files=files, split="train").to_parquet(str(folder / "00000.parquet"))
        (folder / "manifest.json").write_text(json.dumps(["00000.parquet"]))


def main() -> None:
    nanochat_dir, max_new_tokens, batch_size, expressions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        json.loads(sys.argv[4])
    sys.path.insert(0, nanochat_dir)
    sys.modules["rustbpe"] = types.ModuleType("rustbpe")  # nanochat's tokenizer trainer: not needed to encode
    import torch

    from nanochat.checkpoint_manager import load_model
    from nanochat.engine import Engine, use_calculator
    from scripts import chat_eval

    recorded: dict[str, list] = {}
    for name, cls in (("ARC", chat_eval.ARC), ("MMLU", chat_eval.MMLU), ("GSM8K", chat_eval.GSM8K),
                      ("HumanEval", chat_eval.HumanEval)):
        def evaluate(self, conversation, answer, _original=cls.evaluate):
            outcome = bool(_original(self, conversation, answer))
            recorded.setdefault(self._label, []).append({"answer": answer, "passed": outcome})
            return outcome
        cls.evaluate = evaluate

    torch.set_grad_enabled(False)
    model, tokenizer, _ = load_model("sft", torch.device("cpu"), phase="eval")
    engine = Engine(model, tokenizer)
    results = {"tasks": {}, "calculator": [None if (value := use_calculator(expression)) is None else str(value)
                                           for expression in expressions]}
    tasks = {"ARC-Easy": lambda: chat_eval.ARC(subset="ARC-Easy", split="test"),
             "ARC-Challenge": lambda: chat_eval.ARC(subset="ARC-Challenge", split="test"),
             "MMLU": lambda: chat_eval.MMLU(subset="all", split="test"),
             "GSM8K": lambda: chat_eval.GSM8K(subset="main", split="test"), "HumanEval": chat_eval.HumanEval}
    for label, make in tasks.items():
        for cls in (chat_eval.ARC, chat_eval.MMLU, chat_eval.GSM8K, chat_eval.HumanEval):
            cls._label = label
        task = make()
        accuracy = chat_eval.run_chat_eval(label, model, tokenizer, engine, batch_size=batch_size,
                                           max_new_tokens=max_new_tokens)
        prompts = [tokenizer.render_for_completion(task[i]) for i in range(len(task))]
        results["tasks"][label] = {"accuracy": accuracy, "prompts": prompts, "problems": recorded.pop(label)}
    print("RESULT " + json.dumps(results, default=str))


if __name__ == "__main__":
    main()
