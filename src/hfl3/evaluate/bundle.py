"""The CORE eval bundle: nanochat's layout, its items subsampled as nanochat does, and its download.

Layout (karpathy/nanochat 92d63d4, scripts/base_eval.py `evaluate_core`; the DCLM tasks, arXiv 2406.11794):

    eval_bundle/
      core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot: [k], icl_task_type,
                           continuation_delimiter (default " ")}
      eval_meta_data.csv   one row per task: "Eval Task" (= label), "Random baseline" (percent), ...
      eval_data/<dataset_uri>   JSONL, one item per line:
                           multiple_choice: {"query", "choices": [...], "gold": index}
                           schema: {"context_options": [...], "continuation", "gold": index}
                           language_modeling: {"context", "continuation"}

nanochat downloads it from `EVAL_BUNDLE_URL`; hfl3 keeps one copy in the Hugging Face assets cache
(`huggingface_hub.cached_assets_path`, under `HF_HOME`), downloaded on first use when online.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hfl3.provenance import sha256_file, sha256_records

logger = logging.getLogger(__name__)

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat base_eval.py
# nanochat shuffles each task's items with random.Random(1337) before keeping the first max_per_task.
SUBSAMPLE_SEED = 1337
# Per task type: its text fields, and the field listing its options (None: none), which `gold` indexes.
ITEM_FIELDS = {
    "multiple_choice": (("query",), "choices"),
    "schema": (("continuation",), "context_options"),
    "language_modeling": (("context", "continuation"), None),
}
TASK_TYPES = tuple(ITEM_FIELDS)
# JSON values a prompt shows as text: nanochat renders them with Jinja, i.e. `str(value)` (numbers included).
TEXT_TYPES = (str, int, float)
BUNDLE_FILES = ("core.yaml", "eval_meta_data.csv", "eval_data")


@dataclass
class CoreTask:
    """One in-context task of the bundle, with the items an evaluation uses.

    Attributes:
        label: the task's name (`core.yaml` `label`, the `eval_meta_data.csv` row).
        task_type: `multiple_choice`, `schema` or `language_modeling`.
        num_fewshot: examples shown before each item (`num_fewshot[0]`).
        continuation_delimiter: text between a context and its continuation.
        dataset_uri: the JSONL file, relative to `eval_data/`.
        random_baseline: accuracy of guessing, in percent (CORE centers on it).
        items: the items evaluated: the file's items shuffled with `random.Random(1337)`, the first
            `max_per_task` kept (all when -1), as nanochat does; few-shot examples are drawn from these.
        total_items: items in the file.
    """

    label: str
    task_type: str
    num_fewshot: int
    continuation_delimiter: str
    dataset_uri: str
    random_baseline: float
    items: list[dict] = field(repr=False)
    total_items: int


@dataclass
class CoreBundle:
    """The tasks of a bundle folder, in `core.yaml` order, and what identifies them (`describe`)."""

    tasks: list[CoreTask]
    max_per_task: int
    sha256: str

    def describe(self) -> dict:
        """JSON-safe description for metadata.json: the bundle's sha256 (over core.yaml, eval_meta_data.csv and the
        task files), `max_per_task`, and per task its type, shots and item counts."""
        return {"sha256": self.sha256, "max_per_task": self.max_per_task,
                "tasks": {task.label: {"task_type": task.task_type, "num_fewshot": task.num_fewshot,
                                       "items": len(task.items), "total_items": task.total_items,
                                       "random_baseline": task.random_baseline} for task in self.tasks}}


def bundle_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not an eval-bundle folder (a missing `core.yaml`, `eval_meta_data.csv` or `eval_data/`), or None.
    Cheap: checks names only, for argument checks before any heavy work."""
    path = Path(path)
    if not path.is_dir():
        return f"{path} is not a folder"
    missing = [name for name in BUNDLE_FILES if not (path / name).exists()]
    return f"{path} has no {', '.join(missing)}" if missing else None


def load_core_bundle(path: str | os.PathLike, max_per_task: int = -1) -> CoreBundle:
    """Read and check a bundle folder: every task of `core.yaml`, its baseline and its items.

    Args:
        path: the bundle folder (see the module docstring for its layout).
        max_per_task: items kept per task after the seeded shuffle (-1: all).

    Returns:
        The `CoreBundle`.

    Raises:
        ValueError: the layout is incomplete, `core.yaml` is not a list of tasks with the fields above, a task has no
            "Random baseline" row, an item misses a field or has one of the wrong type or a `gold` out of range
            (`eval_data/x.jsonl:17: ...`), or a task keeps fewer items than its few-shot examples need.
    """
    path = Path(path)
    problem = bundle_problem(path)
    if problem:
        raise ValueError(f"CORE eval bundle: {problem}; expected nanochat's eval_bundle folder (core.yaml, "
                         "eval_meta_data.csv, eval_data/)")
    if max_per_task == 0 or max_per_task < -1:
        raise ValueError(f"max_per_task={max_per_task}: expected a positive number of items per task, or -1 (all)")
    config = yaml.safe_load((path / "core.yaml").read_text(encoding="utf-8"))
    specs = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(specs, list) or not specs:
        raise ValueError(f"{path / 'core.yaml'}: expected a non-empty list under 'icl_tasks'")
    baselines = _random_baselines(path / "eval_meta_data.csv")
    tasks = [_load_task(path, spec, number, baselines, max_per_task) for number, spec in enumerate(specs)]
    used = ["core.yaml", "eval_meta_data.csv", *sorted({f"eval_data/{task.dataset_uri}" for task in tasks})]
    digest = sha256_records([name, sha256_file(path / name)] for name in used)
    return CoreBundle(tasks, max_per_task, digest)


def _random_baselines(csv_path: Path) -> dict[str, float]:
    with open(csv_path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        if not {"Eval Task", "Random baseline"} <= set(reader.fieldnames or ()):
            raise ValueError(f"{csv_path}: expected the columns 'Eval Task' and 'Random baseline'")
        baselines = {}
        for line, row in enumerate(reader, start=2):
            try:
                baselines[row["Eval Task"]] = float(row["Random baseline"])
            except (TypeError, ValueError):
                raise ValueError(f"{csv_path}:{line}: 'Random baseline' {row['Random baseline']!r} is not a "
                                 "number (percent)") from None
    return baselines


def _load_task(path: Path, spec, number: int, baselines: dict[str, float], max_per_task: int) -> CoreTask:
    where = f"{path / 'core.yaml'}: icl_tasks[{number}]"
    if not isinstance(spec, dict) or not {"label", "dataset_uri", "num_fewshot", "icl_task_type"} <= set(spec):
        raise ValueError(f"{where}: expected label, dataset_uri, num_fewshot and icl_task_type")
    label, task_type, shots = spec["label"], spec["icl_task_type"], spec["num_fewshot"]
    if task_type not in ITEM_FIELDS:
        raise ValueError(f"{where} ({label}): icl_task_type {task_type!r}; expected one of {', '.join(TASK_TYPES)}")
    if not (isinstance(shots, list) and shots and isinstance(shots[0], int) and shots[0] >= 0):
        raise ValueError(f"{where} ({label}): num_fewshot {shots!r}; expected a list like [10]")
    if label not in baselines:
        raise ValueError(f"{path / 'eval_meta_data.csv'}: no 'Random baseline' row for task {label!r}")
    if not 0 <= baselines[label] < 100:
        raise ValueError(f"{path / 'eval_meta_data.csv'}: task {label!r} has 'Random baseline' {baselines[label]}; "
                         "expected a percentage in [0, 100)")
    uri = str(spec["dataset_uri"])
    items = _read_items(path / "eval_data" / uri, f"eval_data/{uri}", task_type)
    total = len(items)
    random.Random(SUBSAMPLE_SEED).shuffle(items)
    if max_per_task > 0:
        items = items[:max_per_task]
    if shots[0] >= len(items):
        raise ValueError(f"task {label}: {shots[0]}-shot prompts need at least {shots[0] + 1} items, {len(items)} "
                         f"kept (of {total}); raise max_per_task")
    return CoreTask(label, task_type, shots[0], str(spec.get("continuation_delimiter", " ")), uri,
                    baselines[label], items, total)


def _read_items(file: Path, name: str, task_type: str) -> list[dict]:
    if not file.is_file():
        raise ValueError(f"{name}: no such file in the bundle")
    items = []
    with open(file, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{name}:{line_number}: not JSON ({error.msg})") from None
            _check_item(item, f"{name}:{line_number}", task_type)
            items.append(item)
    if not items:
        raise ValueError(f"{name}: no items")
    return items


def _check_item(item, where: str, task_type: str) -> None:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a JSON object")
    text_fields, options_field = ITEM_FIELDS[task_type]
    for key in text_fields:
        if not _is_text(item.get(key)):
            raise ValueError(f"{where}: {task_type} items need {key!r} (text); got {item.get(key)!r}")
    if options_field is None:
        return
    options = item.get(options_field)
    if not (isinstance(options, list) and options and all(_is_text(option) for option in options)):
        raise ValueError(f"{where}: {task_type} items need {options_field!r} (a non-empty list of texts); got "
                         f"{options!r}")
    gold = item.get("gold")
    if not (isinstance(gold, int) and not isinstance(gold, bool) and 0 <= gold < len(options)):
        raise ValueError(f"{where}: gold {gold!r} is not an index of its {len(options)} {options_field}")


def _is_text(value) -> bool:
    return isinstance(value, TEXT_TYPES) and not isinstance(value, bool)


def default_bundle_dir() -> Path:
    """Where the downloaded bundle lives: `HF_HOME/assets/hfl3/core/default/eval_bundle` (huggingface_hub's
    assets cache; `HF_ASSETS_CACHE` moves it)."""
    from huggingface_hub import cached_assets_path, constants

    # read at call time (huggingface_hub's own default is the value at its import)
    folder = cached_assets_path(library_name="hfl3", namespace="core", assets_dir=constants.HF_ASSETS_CACHE)
    return folder / "eval_bundle"


def offline() -> bool:
    """Whether the Hub and other downloads are off (`HF_HUB_OFFLINE=1`)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_bundle_dir(core_bundle_dir: str | os.PathLike | None) -> Path:
    """The bundle folder to read: `core_bundle_dir` when given, else the cached copy (`default_bundle_dir`),
    downloaded from `EVAL_BUNDLE_URL` first if absent (one process at a time: a file lock).

    Raises:
        ValueError: `core_bundle_dir` is not a bundle; or none is given, none is cached and downloads are off.
        OSError: the download or the unzip failed.
    """
    if core_bundle_dir is not None:
        problem = bundle_problem(core_bundle_dir)
        if problem:
            raise ValueError(f"--core_bundle_dir: {problem}; pass nanochat's eval_bundle folder (core.yaml, "
                             "eval_meta_data.csv, eval_data/)")
        return Path(core_bundle_dir)
    target = default_bundle_dir()
    if bundle_problem(target) is None:
        return target
    if offline():
        raise ValueError(missing_bundle_message())
    from filelock import FileLock

    with FileLock(str(target.parent / ".eval_bundle.lock")):
        if bundle_problem(target) is not None:
            download_bundle(target)
    return target


def missing_bundle_message() -> str:
    """The one-line error for CORE without a bundle while offline."""
    return ("the CORE metric needs nanochat's eval bundle and downloads are off (HF_HUB_OFFLINE=1): pass "
            f"--core_bundle_dir DIR (a nanochat checkout keeps it in ~/.cache/nanochat/eval_bundle), run once online "
            f"to cache it from {EVAL_BUNDLE_URL}, or set --core_metric_every -1")


def download_bundle(target: Path, url: str = EVAL_BUNDLE_URL) -> Path:
    """Download `url` (a zip holding an `eval_bundle/` folder, as nanochat's) and move that folder to `target` once
    it is complete and checked: a reader never sees half a bundle.

    Raises:
        ValueError: the archive holds no bundle.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".eval_bundle.") as tmp:
        archive = Path(tmp) / "eval_bundle.zip"
        logger.info("downloading the CORE eval bundle from %s", url)
        with open(archive, "wb") as f:
            fetch(url, f)
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(Path(tmp) / "extracted")  # zipfile drops absolute and ".." member paths
        extracted = Path(tmp) / "extracted" / "eval_bundle"
        problem = bundle_problem(extracted)
        if problem:
            raise ValueError(f"{url}: the archive holds no eval_bundle folder ({problem})")
        if target.exists():  # an incomplete copy left by hand
            shutil.rmtree(target)
        os.replace(extracted, target)
    logger.info("CORE eval bundle cached in %s", target)
    return target


def fetch(url: str, file) -> None:
    """Write the bytes at `url` into the open binary `file` (huggingface_hub's downloader: retries, progress bar)."""
    from huggingface_hub.file_download import http_get

    http_get(url, file, displayed_filename="eval_bundle.zip")
