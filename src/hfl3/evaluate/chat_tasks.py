"""ChatCORE's five tasks as nanochat defines them (karpathy/nanochat 92d63d4: tasks/arc.py, tasks/mmlu.py,
tasks/gsm8k.py, tasks/humaneval.py, tasks/common.py, scripts/chat_eval.py): their data, the prompt each problem
becomes, and how an answer is checked.

| task | Hub dataset (config, split) | kind | baseline | correct when |
|---|---|---|---|---|
| ARC-Easy | allenai/ai2_arc (ARC-Easy, test) | categorical | 0.25 | the answer's letter has the highest logit |
| ARC-Challenge | allenai/ai2_arc (ARC-Challenge, test) | categorical | 0.25 | same (letters: the row's labels) |
| MMLU | cais/mmlu (all, test) | categorical | 0.25 | same, letters A-D |
| GSM8K | openai/gsm8k (main, test) | generative | 0 | the number after the first `#### ` is the reference's |
| HumanEval | openai/openai_humaneval (openai_humaneval, test) | generative | 0 | the program passes its tests |

Data: `datasets.load_dataset(hub_id, config, split=split)`, or with `data_dir` the files of a local copy laid out as
the Hub repository is (`DATA_DIR/<hub_id>/<config>/<split>-*.parquet`, as `hf download <hub_id> --repo-type dataset
--include '<config>/<split>-*' --local-dir DATA_DIR/<hub_id>` writes it; `.jsonl`, `.jsonl.gz` and `.json` files
named `<split>*` too). Rows are
shuffled with `Dataset.shuffle(seed=42)` (nanochat's `HubDataset.shuffle(42)` is the same permutation,
`numpy.random.default_rng(42).permutation`) and the first `max_problems` kept, so the same subset is chosen as
nanochat's `--max-problems`.

Prompts: one user message rendered by the model's own chat template with its generation prompt. Multiple choice
(nanochat's `render_mc`): `"Multiple Choice question: {question}\\n"`, one `"- {choice}={letter}\\n"` line per choice
(the letter after the choice, no space before it), then `"\\nRespond only with the letter of the correct answer."`;
GSM8K: the question; HumanEval: the prompt (the function's signature and docstring).
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHUFFLE_SEED = 42  # nanochat tasks/*.py: load_hub_dataset(...).shuffle(seed=42)
MMLU_LETTERS = ("A", "B", "C", "D")
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")  # nanochat tasks/gsm8k.py, after OpenAI's grade-school-math
CODE_BLOCK = re.compile(r"```(?:python)?\s*\n(.*?)\n```", re.DOTALL)  # nanochat tasks/humaneval.py extract_program
LOCAL_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".gz": "json"}


@dataclass(frozen=True)
class ChatTask:
    """One ChatCORE task: its name (nanochat's), Hub dataset, `kind` (`categorical` or `generative`), the accuracy of
    guessing (`baseline`) and the columns each row needs."""

    name: str
    hub_id: str
    config: str
    split: str
    kind: str
    baseline: float
    columns: tuple[str, ...]

    def download_command(self, data_dir: str | os.PathLike = "DATA_DIR") -> str:
        """The `hf` command that copies this task's split into `data_dir` as `--data_dir` reads it."""
        return (f"hf download {self.hub_id} --repo-type dataset --include '{self.config}/{self.split}-*' "
                f"--local-dir {data_dir}/{self.hub_id}")


TASKS = {task.name: task for task in (
    ChatTask("ARC-Easy", "allenai/ai2_arc", "ARC-Easy", "test", "categorical", 0.25,
             ("question", "choices", "answerKey")),
    ChatTask("ARC-Challenge", "allenai/ai2_arc", "ARC-Challenge", "test", "categorical", 0.25,
             ("question", "choices", "answerKey")),
    ChatTask("MMLU", "cais/mmlu", "all", "test", "categorical", 0.25, ("question", "choices", "answer")),
    ChatTask("GSM8K", "openai/gsm8k", "main", "test", "generative", 0.0, ("question", "answer")),
    ChatTask("HumanEval", "openai/openai_humaneval", "openai_humaneval", "test", "generative", 0.0,
             ("prompt", "canonical_solution", "test", "entry_point")),
)}
"""nanochat's ChatCORE tasks, in scripts/chat_eval.py's order."""
CATEGORICAL = tuple(name for name, task in TASKS.items() if task.kind == "categorical")


@dataclass
class Problem:
    """One problem: `index` (its place in the shuffled task), the user message `prompt`, and what checks an answer:
    `letters` and `answer` (the correct letter) for categorical tasks; `answer` (GSM8K's reference number) or `row`
    (HumanEval's test and entry point) for generative ones."""

    index: int
    prompt: str
    answer: str | None = None
    letters: tuple[str, ...] = ()
    row: dict | None = None


def render_multiple_choice(question: str, letters, choices) -> str:
    """nanochat's `render_mc`: the letter after each choice, with no space before it, so that it is the token the
    assistant answers with."""
    lines = "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return f"Multiple Choice question: {question}\n{lines}\nRespond only with the letter of the correct answer."


def gsm8k_number(text: str) -> str | None:
    """The number after the first `#### ` in `text`, commas removed (nanochat's `extract_answer`), or None."""
    match = GSM8K_ANSWER.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def gsm8k_reference(answer: str) -> str | None:
    """The reference number of a GSM8K `answer`: read from the text after its last `<<...>>` calculator annotation,
    as nanochat reads the last text part of the assistant message it builds from the annotations."""
    return gsm8k_number(re.split(r"(<<[^>]+>>)", answer)[-1])


def prompt_imports(prompt: str) -> str:
    """The import lines at the start of a HumanEval prompt (nanochat's `extract_imports`: up to the first line that
    is neither an import nor a comment)."""
    imports = []
    for line in prompt.split("\n"):
        stripped = line.strip()
        if stripped.startswith(("import ", "from ")):
            imports.append(stripped)
        elif stripped and not stripped.startswith("#"):
            break
    return "\n".join(imports)


def completion_program(completion: str) -> str:
    """The code of a completion: its first fenced code block (```python or ```), else the whole text, stripped
    (nanochat's `extract_program`)."""
    blocks = CODE_BLOCK.findall(completion)
    return (blocks[0] if blocks else completion).strip()


def humaneval_program(row: dict, completion: str) -> str:
    """The program run for a HumanEval completion: the prompt's imports, the completion's code, the tests and
    `check(entry_point)` (nanochat's `HumanEval.evaluate`)."""
    return (f"{prompt_imports(row['prompt'])}\n\n{completion_program(completion)}\n\n{row['test']}\n"
            f"check({row['entry_point']})")


def final_answer(completion: str) -> str:
    """The part of a completion that answers: after the last `</think>` when a reasoning model wrote one (Qwen3);
    nanochat's models write none, so theirs is whole."""
    return completion.rsplit("</think>", 1)[-1] if "</think>" in completion else completion


def to_problem(task: ChatTask, index: int, row: dict, where: str) -> Problem:
    """The `Problem` of a data row. Raises `ValueError` naming `where` for a row nanochat would reject (an ARC answer
    that is not one of its labels, an MMLU row without 4 choices)."""
    if task.name.startswith("ARC"):
        letters, choices = tuple(row["choices"]["label"]), row["choices"]["text"]
        if row["answerKey"] not in letters:
            raise ValueError(f"{where}: answerKey {row['answerKey']!r} is not one of its labels {list(letters)}")
        return Problem(index, render_multiple_choice(row["question"], letters, choices), row["answerKey"], letters)
    if task.name == "MMLU":
        if len(row["choices"]) != 4 or row["answer"] not in range(4):
            raise ValueError(f"{where}: expected 4 choices and an answer in 0-3; got {len(row['choices'])} choices "
                             f"and answer {row['answer']!r}")
        return Problem(index, render_multiple_choice(row["question"], MMLU_LETTERS, row["choices"]),
                       MMLU_LETTERS[row["answer"]], MMLU_LETTERS)
    if task.name == "GSM8K":
        return Problem(index, row["question"], gsm8k_reference(row["answer"]))
    return Problem(index, row["prompt"], row=dict(row))


def local_files(task: ChatTask, data_dir: str | os.PathLike) -> list[str]:
    """The files of `task`'s split in a local copy (see the module docstring), sorted; empty when there are none."""
    folder = Path(data_dir) / task.hub_id / task.config
    files = sorted(glob.glob(str(folder / f"{task.split}-*")) + glob.glob(str(folder / f"{task.split}.*")))
    return [file for file in files if Path(file).suffix in LOCAL_SUFFIXES]


def missing_data_message(names: list[str], data_dir: str | os.PathLike | None) -> str:
    """One line naming what to download for the tasks `names` and where it goes."""
    tasks = [TASKS[name] for name in names]
    commands = [task.download_command(data_dir or "DATA_DIR") for task in tasks]
    where = f"--data_dir {data_dir} has no copy of" if data_dir else \
        "downloads are off (HF_HUB_OFFLINE=1) and the datasets cache has no copy of"
    shown = ", ".join(f"{task.name} ({task.hub_id} {task.config}/{task.split})" for task in tasks)
    return (f"ChatCORE: {where} {shown}; where the Hub is reachable run `{'; '.join(commands)}`"
            + ("" if data_dir else " and pass --data_dir DATA_DIR"))


def data_problem(names: list[str], data_dir: str | os.PathLike | None) -> str | None:
    """Why the tasks `names` cannot be read, without reading them (a cheap check before any heavy work): with
    `data_dir`, the tasks without files there; without it, offline, the tasks not in the datasets cache. None when
    nothing is known to be missing."""
    if data_dir is not None:
        if not Path(data_dir).is_dir():
            return f"--data_dir {data_dir} is not a folder"
        missing = [name for name in names if not local_files(TASKS[name], data_dir)]
        return missing_data_message(missing, data_dir) if missing else None
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        return None
    missing = [name for name in names if not _in_datasets_cache(TASKS[name])]
    return missing_data_message(missing, None) if missing else None


def _in_datasets_cache(task: ChatTask) -> bool:
    """Whether `datasets` can load `task` offline (it reads its cache, or the Hub cache, without the network)."""
    try:
        _load_rows(task, None)
    except Exception:  # noqa: BLE001 (datasets raises several kinds when a dataset is not cached)
        return False
    return True


def _load_rows(task: ChatTask, data_dir: str | os.PathLike | None):
    import datasets

    if data_dir is None:
        return datasets.load_dataset(task.hub_id, task.config, split=task.split)
    files = local_files(task, data_dir)
    if not files:
        raise ValueError(missing_data_message([task.name], data_dir))
    builders = {LOCAL_SUFFIXES[Path(file).suffix] for file in files}
    if len(builders) > 1:
        raise ValueError(f"{Path(data_dir) / task.hub_id / task.config}: mixes parquet and JSON files for split "
                         f"{task.split}; keep one kind")
    return datasets.load_dataset(builders.pop(), data_files=files, split="train")


def load_problems(name: str, data_dir: str | os.PathLike | None = None, max_problems: int | None = None
                  ) -> list[Problem]:
    """The problems of task `name` (a key of `TASKS`): its rows shuffled with seed 42, the first `max_problems` kept
    (None or -1: all), each made a `Problem`.

    Raises:
        ValueError: the data cannot be found (one line naming what to download), lacks a column the task needs, or has
            a row nanochat would reject (named by task, file and shuffled index).
    """
    task = TASKS[name]
    try:
        rows = _load_rows(task, data_dir)
    except Exception as error:  # noqa: BLE001 (offline, a missing or broken dataset: datasets' own kinds)
        from huggingface_hub import constants

        if data_dir is not None and isinstance(error, ValueError) and str(error).startswith("ChatCORE"):
            raise
        if data_dir is None and constants.HF_HUB_OFFLINE:
            raise ValueError(missing_data_message([name], None)) from None
        source = f"{task.hub_id} ({task.config}, {task.split})" if data_dir is None else ", ".join(
            local_files(task, data_dir))
        raise ValueError(f"ChatCORE {name}: datasets cannot load {source}: "
                         f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None
    where = f"{task.hub_id} ({task.config}, {task.split})" if data_dir is None else str(
        Path(data_dir) / task.hub_id / task.config)
    missing = [column for column in task.columns if column not in rows.column_names]
    if missing:
        raise ValueError(f"ChatCORE {name}: {where} has no column {', '.join(missing)}; expected "
                         f"{', '.join(task.columns)}")
    rows = rows.shuffle(seed=SHUFFLE_SEED)
    if max_problems is not None and max_problems >= 0:
        rows = rows.select(range(min(max_problems, len(rows))))
    return [to_problem(task, index, row, f"ChatCORE {name}, {where}, shuffled row {index}")
            for index, row in enumerate(rows)]
