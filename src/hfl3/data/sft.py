"""Chat JSONL → SFT datasets with provenance (`load_sft_data`): read and validate (`hfl3.data.chat`), drop exact
duplicates, mask and truncate (`hfl3.data.masks`), split, hash.

The rows are a `datasets.Dataset` with `input_ids` and `labels` (-100 off the loss), which TRL's `SFTTrainer` uses
as is.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass

from hfl3.data.chat import ChatDataStats, read_chat_jsonl
from hfl3.data.masks import AssistantMasker, encode_records
from hfl3.provenance import sha256_file, sha256_records

logger = logging.getLogger(__name__)


@dataclass
class SFTData:
    """Datasets and provenance for one SFT run (see `load_sft_data`).

    `train` / `eval` have columns `input_ids` and `labels`; `stats` maps `"train_file"` (and `"eval_file"` when
    separate) to `ChatDataStats`; `provenance` holds the record hashes, file hashes, split seed and sizes."""

    train: object
    eval: object | None
    stats: dict[str, ChatDataStats]
    provenance: dict


def split_indices(n: int, val_split: float, seed: int) -> tuple[list[int], list[int]]:
    """Disjoint seeded split of `range(n)`: `round(n * val_split)` (at least 1) indices go to validation, chosen by
    `random.Random(seed).sample`; both lists are returned sorted (original order).

    Raises:
        ValueError: if `val_split` is not in (0, 1) or leaves no training example.
    """
    if not 0.0 < val_split < 1.0:
        raise ValueError(f"val_split={val_split}; expected a fraction in (0, 1)")
    n_val = max(1, round(n * val_split))
    if n_val >= n:
        raise ValueError(f"val_split={val_split} of {n} examples leaves nothing to train on")
    val = sorted(random.Random(seed).sample(range(n), n_val))
    val_set = set(val)
    return [i for i in range(n) if i not in val_set], val


def _encode_file(path, masker, max_length, skip_invalid_records, seen) -> tuple[list, list, list, ChatDataStats]:
    stats = ChatDataStats()
    records = read_chat_jsonl(path, skip_invalid_records=skip_invalid_records, stats=stats)
    kept, ids, labels = encode_records(
        records, masker, max_length, skip_invalid_records=skip_invalid_records, stats=stats, seen=seen
    )
    if stats.duplicates:
        logger.warning("%s: dropped %d record(s) whose messages repeat an earlier record's (counted as duplicates)",
                       path, stats.duplicates)
    logger.info("%s: %s", path, {k: v for k, v in stats.as_dict().items() if k != "first_errors"})
    for error in stats.first_errors:
        logger.warning("skipped %s", error)
    if not kept:
        raise ValueError(f"{path}: no usable conversation left ({stats.as_dict()})")
    return kept, ids, labels, stats


def _rows(ids: list, labels: list, indices: Iterable[int]):
    from datasets import Dataset

    indices = list(indices)
    return Dataset.from_dict({"input_ids": [ids[i] for i in indices], "labels": [labels[i] for i in indices]})


def load_sft_data(
    tokenizer,
    train_file: str | os.PathLike,
    *,
    eval_file: str | os.PathLike | None = None,
    val_split: float = 0.0,
    seed: int = 42,
    max_length: int | None = 1024,
    skip_invalid_records: bool = False,
    chat_template: str | None = None,
) -> SFTData:
    """Read, validate, mask and truncate chat JSONL into train/eval datasets with their provenance.

    Records whose messages repeat an earlier record's are dropped and counted (`ChatDataStats.duplicates`) before
    the split, so no conversation is in both train and eval; an `eval_file` record that repeats a training record is
    dropped the same way. The evaluation rows come from `eval_file` or, with `val_split > 0`, from a disjoint seeded
    split of the kept training rows (`split_indices`); with neither, `eval` is None. `provenance` holds
    `train_records_sha256` / `eval_records_sha256` (`sha256_records` of the kept messages in dataset order), the
    files' sha256, the split seed, the sizes and the counts (`ChatDataStats` per file).

    Raises:
        InvalidChatRecord: for the first bad record, unless `skip_invalid_records`.
        ValueError: if a file has no usable record left, or both `eval_file` and `val_split` are given.
    """
    if eval_file is not None and val_split:
        raise ValueError("give either eval_file or val_split, not both")
    masker = AssistantMasker(tokenizer, chat_template)
    seen = {}  # sha256 of the kept training records' messages -> file:line
    records, ids, labels, train_stats = _encode_file(train_file, masker, max_length, skip_invalid_records, seen)
    stats = {"train_file": train_stats}
    files = {str(train_file): sha256_file(train_file)}
    if val_split:
        train_idx, eval_idx = split_indices(len(records), val_split, seed)
        eval_records, train_records = [records[i] for i in eval_idx], [records[i] for i in train_idx]
        train, evaluation = _rows(ids, labels, train_idx), _rows(ids, labels, eval_idx)
    else:
        train_records, train = records, _rows(ids, labels, range(len(records)))
        eval_records, evaluation = [], None
    if eval_file is not None:
        eval_records, eval_ids, eval_labels, stats["eval_file"] = _encode_file(
            eval_file, masker, max_length, skip_invalid_records, seen
        )
        evaluation = _rows(eval_ids, eval_labels, range(len(eval_records)))
        files[str(eval_file)] = sha256_file(eval_file)
    provenance = {
        "train_records_sha256": sha256_records([list(r.messages) for r in train_records]),
        "eval_records_sha256": sha256_records([list(r.messages) for r in eval_records]) if eval_records else None,
        "files_sha256": files,
        "val_split": val_split,
        "split_seed": seed if val_split else None,
        "train_examples": len(train_records),
        "eval_examples": len(eval_records),
        "max_length": max_length,
        "end_of_turn": masker.end_of_turn,
        "counts": {name: s.as_dict() for name, s in stats.items()},
    }
    return SFTData(train, evaluation, stats, provenance)
