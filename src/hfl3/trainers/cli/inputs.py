"""A value a user types into a recipe, checked before any work: a file (`check_file`), a folder (`check_folder`), a
model or tokenizer given as a folder or a Hub id (`check_pretrained`, `check_model_folder`, `check_tokenizer_folder`),
a Hub repository (`check_hub_repo`, `in_cache`), a pretraining corpus (`check_corpus`) and an SFT dataset
(`check_sft_dataset`). Each refusal is a `ValueError` of one line: `--ARGUMENT VALUE: problem; expected WHAT`. The
recipes' checks (`hfl3.trainers.cli.arguments`) call them. Once the tokenizer, the data and the model are loaded, the SFT
builder checks that the token ids fit the model's embeddings (`check_vocabulary_fits`).

How a value is read:
- a value that exists on disk is local: a file or a folder, which must hold what the argument needs (a model folder
  its `config.json`, a tokenizer folder its `tokenizer.json` or `tokenizer_config.json`);
- a value that does not exist is a Hub id only when huggingface_hub accepts it as one (`name` or `namespace/name`,
  `validate_repo_id`). `/nope`, `./model`, `~/model` or `a/b/c` are local paths that do not exist and are reported
  as such, never sent to the Hub (transformers would answer "Repo id must use alphanumeric chars" for them);
- a Hub id is looked up in the local Hugging Face cache when offline (`HF_HUB_OFFLINE=1`), else on the Hub with a
  `HUB_TIMEOUT_S` timeout and no retry: a mistyped name fails in about a second instead of after the loaders'
  retries (transformers 5.23 waits ~50 s before it reports an unreachable Hub).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import huggingface_hub
import pyarrow.compute as pc
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.file_download import repo_folder_name

from hfl3.data.sft_sources import BUILDERS, dataset_splits
from hfl3.data.sources import LOCAL_SUFFIXES, file_format
from hfl3.provenance.hub import is_hub_id
from hfl3.trainers.outputs import safetensors_problem

logger = logging.getLogger(__name__)

HUB_TIMEOUT_S = 10.0
"""Seconds one Hub lookup may take before the Hub counts as unreachable."""
MODEL = "a model folder (config.json and weights, as save_pretrained writes them) or a Hub model id"
TOKENIZER = "a tokenizer folder (tokenizer.json or tokenizer_config.json, as save_pretrained writes them) or a Hub id"
CORPUS = ("stdlib, a text/.jsonl/.json/.parquet file, a folder or glob of them, or a datasets name (Hub id or "
          "folder)")
SFT_DATASET = ("a datasets name: a Hub dataset id, a local folder of data files, or a "
               f"{'/'.join(BUILDERS)} file")
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _error(argument: str, value, problem: str, expected: str) -> ValueError:
    return ValueError(f"--{argument} {value}: {problem}; expected {expected}")


def check_file(argument: str, value: str, expected: str, suffixes: Sequence[str] = ()) -> Path:
    """`value` must be an existing file (with one of `suffixes`, when given). Returns it as a `Path`.

    Raises:
        ValueError: `--ARGUMENT VALUE: no such file; expected EXPECTED` (or `is a folder`, `not a .X file`).
    """
    path = Path(value)
    if path.is_dir():
        raise _error(argument, value, "is a folder", expected)
    if not path.is_file():
        raise _error(argument, value, "no such file", expected)
    if suffixes and path.suffix not in suffixes:
        raise _error(argument, value, f"not a {' or '.join(suffixes)} file", expected)
    return path


def check_folder(argument: str, value: str, expected: str, contains: Sequence[str] = ()) -> Path:
    """`value` must be an existing folder that holds at least one of `contains` (when given). Returns it as a `Path`.

    Raises:
        ValueError: `--ARGUMENT VALUE: no such folder; expected EXPECTED` (or `is a file`, `the folder holds no X`).
    """
    path = Path(value)
    if path.is_file():
        raise _error(argument, value, "is a file", expected)
    if not path.is_dir():
        raise _error(argument, value, "no such folder", expected)
    if contains and not any((path / name).exists() for name in contains):
        raise _error(argument, value, f"the folder holds no {' or '.join(contains)}", expected)
    return path


def check_pretrained(argument: str, value: str, expected: str, files: Sequence[str], revision: str | None = None
                     ) -> None:
    """`value` is an existing local folder holding one of `files`, or a Hub model id (`check_hub_repo`).

    Raises:
        ValueError: one line naming the argument, the value and `expected`.
    """
    if Path(value).exists() or not is_hub_id(value):
        check_folder(argument, value, expected, files)
    else:
        check_hub_repo(argument, value, expected, files, revision)


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weights `from_pretrained` looks for in a model folder, in its order."""
SAVE_AGAIN = "restore it from where the folder came from, or save the folder again with save_pretrained"


def read_json(argument: str, value: str, path: Path):
    """The JSON in `path`, a file of the folder `value` given as `--ARGUMENT`. Raises `ValueError`: `--ARGUMENT
    VALUE: NAME is not valid JSON (where); restore it ...`."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # json.JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"--{argument} {value}: {path.name} is not valid JSON ({error}); {SAVE_AGAIN}") from None


def check_model_folder(argument: str, value: str) -> None:
    """A local model folder holds what `from_pretrained` reads: a `config.json` that is JSON, and whole weights (the
    first of `WEIGHTS`, or the shards its index names): a `.safetensors` file's header and size
    (`hfl3.trainers.outputs.safetensors_problem`; no tensor is read), a `.bin` file not empty. Raises `ValueError`:
    one line naming the argument, the folder, the file and the fix."""
    folder = Path(value)
    read_json(argument, value, folder / "config.json")
    found = next((name for name in WEIGHTS if (folder / name).is_file()), None)
    if found is None:
        raise _error(argument, value, f"the folder holds no weights ({', '.join(WEIGHTS)})", MODEL)
    files = sorted(set(read_json(argument, value, folder / found).get("weight_map", {}).values())) \
        if found.endswith(".index.json") else [found]
    for name in files:
        path = folder / name
        problem = f"missing (named by {found})" if not path.is_file() else "empty" if not path.stat().st_size \
            else safetensors_problem(path) if path.suffix == ".safetensors" else None
        if problem:
            raise ValueError(f"--{argument} {value}: {name} {problem}; {SAVE_AGAIN}")


def check_tokenizer_folder(argument: str, value: str, chat_template: bool = False) -> None:
    """A local tokenizer folder (`--tokenizer_name_or_path`, or a model folder holding its tokenizer) holds
    `TOKENIZER_FILES`: `tokenizer_config.json` JSON, `tokenizer.json` closed (its tail: a full parse takes a second)
    and, with `chat_template`, a template (`chat_template.jinja`, or in a JSON file), which hfl3's masks render every
    record with. Raises `ValueError`: one line naming the argument, the folder, the file and the fix."""
    folder = Path(value)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):  # a model folder's (check_pretrained: others)
        raise ValueError(f"--{argument} {value}: the folder holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); pass "
                         "--tokenizer_name_or_path, or save the tokenizer into the folder (tokenizer.save_pretrained)")
    if (folder / "tokenizer.json").is_file():
        with open(folder / "tokenizer.json", "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 64))
            if not handle.read().rstrip().endswith(b"}"):
                raise ValueError(f"--{argument} {value}: tokenizer.json is cut short (its JSON object is not closed); "
                                 f"{SAVE_AGAIN}")
    configs = [read_json(argument, value, folder / name) for name in ("tokenizer_config.json", "chat_template.json")
               if (folder / name).is_file()]
    if chat_template and not ((folder / "chat_template.jinja").is_file() or any(
            isinstance(config, dict) and config.get("chat_template") for config in configs)):
        raise ValueError(f"--{argument} {value}: the tokenizer has no chat template, which hfl3 renders every record "
                         "with to mask it (hfl3.data.masks); pass --chat_template_path FILE.jinja, or a tokenizer "
                         "with one")


def in_cache(repo_id: str, files: Sequence[str] = (), revision: str | None = None, repo_type: str = "model") -> bool:
    """Whether the local Hugging Face cache holds one of `files` of the Hub repository (any file when `files` is
    empty); a dataset also counts when `datasets` has prepared it in its own cache."""
    if files:
        return any(isinstance(huggingface_hub.try_to_load_from_cache(repo_id, name, revision=revision,
                                                                     repo_type=repo_type), str) for name in files)
    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    if any((folder / "snapshots").glob("*/*")):
        return True
    if repo_type == "dataset":
        import datasets

        return (Path(datasets.config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")).is_dir()
    return False


def check_hub_repo(argument: str, repo_id: str, expected: str, files: Sequence[str] = (), revision: str | None = None,
                   repo_type: str = "model") -> None:
    """The Hub repository `repo_id` (a model or a dataset) exists: offline, `in_cache`; online, its `*_info` answers
    within `HUB_TIMEOUT_S`. A gated repository counts as existing (its loader explains how to get access); when the
    Hub answers with another HTTP error, or cannot be reached but the cache holds the repository, a warning is
    logged and the loader decides.

    Raises:
        ValueError: not in the cache (offline); no such repository or revision on the Hub; the Hub unreachable and
            nothing cached.
    """
    kind = "dataset" if repo_type == "dataset" else "model"
    if constants.is_offline_mode():
        if not in_cache(repo_id, files, revision, repo_type):
            raise _error(argument, repo_id, f"no such file or folder, and HF_HUB_OFFLINE=1 with no copy of the Hub "
                                            f"{kind} {repo_id} in the local cache", expected)
        return
    api = huggingface_hub.HfApi()
    info = api.dataset_info if repo_type == "dataset" else api.model_info
    try:
        info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return
    except RevisionNotFoundError:
        raise _error(argument, repo_id, f"the Hub {kind} has no revision {revision!r}", expected) from None
    except RepositoryNotFoundError:
        raise _error(argument, repo_id, f"no such file or folder, and no {kind} {repo_id} on the Hub (a private "
                                        "one needs `hf auth login`)", expected) from None
    except HfHubHTTPError as error:
        logger.warning("--%s %s: the Hub answered %s; the loader will retry", argument, repo_id, error)
    except Exception as error:  # huggingface_hub raises its HTTP client's own errors for a refused or slow connection
        if not in_cache(repo_id, files, revision, repo_type):
            raise _error(argument, repo_id, f"no such file or folder, and the Hub could not be reached within "
                                            f"{HUB_TIMEOUT_S:g} s to look it up ({type(error).__name__}; with "
                                            "HF_HUB_OFFLINE=1 only the local cache is searched)", expected) from None
        logger.warning("--%s %s: the Hub could not be reached (%s); the cached copy is used (HF_HUB_OFFLINE=1 skips "
                       "the network)", argument, repo_id, type(error).__name__)


def check_corpus(argument: str, spec: str) -> None:
    """Each comma-separated entry of a pretraining `--dataset` spec (`hfl3.data.sources.open_corpus`) exists:
    `stdlib`, an existing file or folder, a glob matching a file, or a Hub dataset (`check_hub_repo`). What the
    files hold is checked when the corpus is opened.

    Raises:
        ValueError: naming the entry (and the spec when it has several): no such file or folder, a glob matching
            nothing, or no such Hub dataset.
    """
    entries = [part.strip() for part in spec.split(",") if part.strip()]
    for entry in entries:
        value = entry if len(entries) == 1 else f"{spec} (entry {entry})"
        if entry == "stdlib" or Path(entry).expanduser().exists():
            continue
        if glob.has_magic(entry):
            if not any(Path(p).is_file() for p in glob.iglob(str(Path(entry).expanduser()), recursive=True)):
                raise _error(argument, value, "the pattern matches no file", CORPUS)
        elif is_hub_id(entry) and file_format(Path(entry))[0] not in LOCAL_SUFFIXES:
            check_hub_repo(argument, entry, CORPUS, repo_type="dataset")
        else:
            raise _error(argument, value, "no such file or folder", CORPUS)


def check_sft_dataset(name: str, config: str | None = None, splits: dict[str, str] | None = None) -> None:
    """`--dataset_name NAME` of the SFT recipe exists: a local data file (`hfl3.data.sft_sources.BUILDERS`
    suffixes), a local folder holding such files, or a Hub dataset (`check_hub_repo`); and has `splits` (argument →
    split name, e.g. `{"dataset_train_split": "train"}`) with `--dataset_config CONFIG`, as its `datasets` builder
    lists them before any data is read.

    Raises:
        ValueError: one line naming the argument, the value and what was expected (or the splits the dataset has).
    """
    path = Path(name)
    if path.is_file() and path.suffix not in BUILDERS:
        raise _error("dataset_name", name, f"not a {'/'.join(BUILDERS)} file", SFT_DATASET)
    if path.is_dir() and not any(p.suffix in BUILDERS for p in path.rglob("*") if p.is_file()):
        raise _error("dataset_name", name, f"the folder holds no {'/'.join(BUILDERS)} file", SFT_DATASET)
    if not path.exists():
        if not is_hub_id(name) or name.endswith(tuple(BUILDERS)):
            raise _error("dataset_name", name, "no such file or folder", SFT_DATASET)
        check_hub_repo("dataset_name", name, SFT_DATASET, repo_type="dataset")
    try:
        available = dataset_splits(name, config)
    except Exception as error:  # noqa: BLE001 (datasets' errors for a config it lacks, or files it cannot read)
        argument, value = ("dataset_config", config) if config and "config" in str(error).lower() else \
            ("dataset_name", name)
        raise ValueError(f"--{argument} {value}: datasets cannot open it: {str(error).splitlines()[0]}") from None
    for argument, split in (splits or {}).items():
        if available is not None and split not in available:
            raise ValueError(f"--{argument} {split}: --dataset_name {name} has no such split; it has "
                             f"{', '.join(sorted(available))}")


def check_vocabulary_fits(tokenizer, model, datasets=()) -> None:
    """Refuse token ids the model has no embedding row for (the forward would fail with an IndexError, or on a GPU a
    device-side assert, deep in the first step).

    Without `datasets`, every id of the tokenizer (`len(tokenizer)`, added tokens included) must have a row. With
    `datasets` (tokenized `datasets.Dataset`s with `input_ids`; None entries are skipped), the ids that will be fed
    must: the largest id in them and the pad id. A tokenizer larger than the embeddings whose extra ids never occur
    (a GGUF file's tokenizer can carry one more added token than the model has rows) then only warns.

    Raises:
        ValueError: an id that will be (or, without `datasets`, may be) fed is >= the rows of the model's input
            embeddings.
    """
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 (zero.Init) leaves an empty partition here
    if len(tokenizer) <= rows:
        return
    fix = ("Use the model's own tokenizer (drop --tokenizer_name_or_path), or resize the model's embeddings "
           "(model.resize_token_embeddings(len(tokenizer))) and save it first")
    name = model.config.name_or_path or type(model).__name__
    datasets = [dataset for dataset in datasets if dataset is not None]
    if not datasets:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens (with added ones) but the model {name} has {rows} "
                         f"embedding rows: token ids >= {rows} have no embedding. {fix}")
    used = max(_largest_id(dataset) for dataset in datasets)
    used = max(used, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1)
    if used >= rows:
        raise ValueError(f"the data hold token id {used} (tokenizer: {len(tokenizer)} tokens with added ones) but the "
                         f"model {name} has {rows} embedding rows: token ids >= {rows} have no embedding. {fix}")
    logger.warning("the tokenizer has %d tokens but the model %s has %d embedding rows; the data and the pad id "
                   "stay below %d, so training runs", len(tokenizer), name, rows, rows)


def _largest_id(dataset) -> int:
    """The largest token id in a dataset's `input_ids`, read in Arrow batches (memory flat in the data)."""
    largest = -1
    for batch in dataset.with_format("arrow").iter(batch_size=1024):
        value = pc.max(pc.list_flatten(batch["input_ids"])).as_py()
        largest = max(largest, -1 if value is None else value)
    return largest
