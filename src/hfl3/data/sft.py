"""SFT records → train/eval `datasets.Dataset`s of `input_ids` and `labels` (-100 off the loss), with counts and
provenance (`load_sft_data`). TRL's `SFTTrainer` uses such rows as they are.

The way through, for each source (`hfl3.data.sft_sources`: a JSONL file or a `datasets` split):

1. Encode: `datasets.Dataset.from_generator` over the source's shards, `dataset_num_proc` worker processes each
   reading its shards in order. Every record is normalized (`hfl3.data.chat.normalize_record`), cut into one sample
   per reasoning turn with `split_reasoning_turns` (`hfl3.data.chat.split_reasoning_turns`), rendered and masked
   (`hfl3.data.masks`) and cut to `max_length` as TRL's `truncation_mode` says: one Arrow row per sample, an invalid
   record as one row with its reason. The result is cached by a fingerprint of the source's content (a file's sha256,
   a split's `datasets` fingerprint), the tokenizer and template, every option that shapes the rows
   (`RowOptions`, `AssistantMasker.options`) and this code, so a second run with the same inputs reads the cached
   Arrow files instead of encoding.
2. Report: invalid records stop the run (the first named, all counted) or, with `skip_invalid_records`, are counted
   and the first few logged; rows whose supervised tokens all fell beyond `max_length` are dropped and counted; a
   record equal to an earlier kept one (`ChatRecord.canonical`: in the same source or, for evaluation data, in the
   training data; compared by a 128-bit prefix of its sha256) is dropped and counted. Nothing usable left:
   `SFTDataError`.
3. Split, hash, shuffle: `val_split` holds out a seeded set of the kept training records (`split_indices`; the samples
   of one record stay on one side); the kept rows' `sha256_records` (over their canonical JSON, in dataset order) is
   computed by streaming the Arrow files; with `shuffle_dataset` both sides are shuffled as TRL shuffles them
   (`Dataset.shuffle(seed)`: an index mapping, the rows stay where they are).

`sft_data_options` maps the recipe's arguments (TRL's data flags among them) to `load_sft_data`'s options, in one
place.

Memory stays flat in the data: rows are written as they are encoded, then read back memory-mapped; only per-row
scalars (lengths, counts, digests) are read whole, and the records' text is streamed through the hash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hfl3.data import chat, masks, sft_sources
from hfl3.data.chat import ChatDataStats, ChatRecord, InvalidChatRecord, SFTDataError, normalize_record, \
    split_reasoning_turns
from hfl3.data.masks import AssistantMasker
from hfl3.data.sft_sources import SFTSource, iter_arrow_batches, iter_shard, open_dataset, open_jsonl
from hfl3.provenance import canonical_json, sha256_records

logger = logging.getLogger(__name__)

FEATURES = datasets.Features({
    "where": datasets.Value("string"),
    "error": datasets.Value("string"),
    "kind": datasets.Value("string"),
    "record": datasets.Value("string"),
    "digest_high": datasets.Value("int64"),
    "digest_low": datasets.Value("int64"),
    "input_ids": datasets.List(datasets.Value("int32")),
    "labels": datasets.List(datasets.Value("int32")),
    "supervised": datasets.Value("int32"),
    "truncated": datasets.Value("bool"),
    "sharegpt": datasets.Value("bool"),
    "reasoning_not_rendered": datasets.Value("int32"),
    "sample": datasets.Value("int32"),
})
_INVALID = {"record": None, "digest_high": 0, "digest_low": 0, "input_ids": [], "labels": [], "supervised": 0,
            "truncated": False, "sharegpt": False, "reasoning_not_rendered": 0, "sample": 0}
SHARDS_PER_PROCESS = 4
TRUNCATION_MODES = ("keep_start", "keep_end")
SKIPS_PREPARATION = "skip_prepare_dataset"


@dataclass(frozen=True)
class RowOptions:
    """What turns a record into rows besides the masker's options: `max_length` (None: rows are not cut),
    `truncation_mode` (TRL's: "keep_start" or "keep_end"), `completion_only_loss` and `dataset_text_field`
    (`normalize_record`), `split_reasoning_turns` (`hfl3.data.chat.split_reasoning_turns`)."""

    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    completion_only_loss: bool | None = None
    dataset_text_field: str = "text"
    split_reasoning_turns: bool = False


@dataclass
class SFTData:
    """Datasets and provenance for one SFT run (see `load_sft_data`).

    `train` / `eval` have columns `input_ids` and `labels`; `stats` maps each source's argument (`train_file`,
    `eval_file`, `dataset_train_split`, `dataset_test_split`) to its `ChatDataStats`; `provenance` holds the record
    hashes, file hashes, datasets, split seed, sizes and counts; `train_supervised_tokens` counts the tokens with a
    label in `train` (position 0 aside, which no loss reads)."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict[str, ChatDataStats]
    provenance: dict
    train_supervised_tokens: int = 0


def split_indices(n: int, val_split: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint seeded split of `range(n)`: `round(n * val_split)` (at least 1) indices go to validation, chosen by
    `random.Random(seed).sample`; both arrays are returned sorted (original order).

    Raises:
        ValueError: if `val_split` is not in (0, 1) or leaves no training example.
    """
    if not 0.0 < val_split < 1.0:
        raise ValueError(f"val_split={val_split}; expected a fraction in (0, 1)")
    n_val = max(1, round(n * val_split))
    if n_val >= n:
        raise ValueError(f"val_split={val_split} of {n} examples leaves nothing to train on")
    val = np.sort(np.fromiter(random.Random(seed).sample(range(n), n_val), dtype=np.int64, count=n_val))
    held_out = np.zeros(n, dtype=bool)
    held_out[val] = True
    return np.flatnonzero(~held_out), val


def encode_row(where: str, obj: object, masker: AssistantMasker, options: RowOptions) -> list[dict]:
    """One record (a decoded object, or the `InvalidChatRecord` its line gave) as rows of `FEATURES`: normalized, cut
    into samples (`options.split_reasoning_turns`), masked and truncated, one row per sample numbered by `sample`; or
    one invalid row with `error` (the reason) and `kind` (its `ChatDataStats` counter)."""
    try:
        if isinstance(obj, InvalidChatRecord):
            raise obj
        record = normalize_record(obj, where, completion_only_loss=options.completion_only_loss,
                                  dataset_text_field=options.dataset_text_field)
        samples = split_reasoning_turns(record) if options.split_reasoning_turns and isinstance(record, ChatRecord) \
            else (record,)
        encoded = [masker.encode(sample) for sample in samples]
    except InvalidChatRecord as error:
        return [{**_INVALID, "where": where, "error": error.reason, "kind": error.kind}]
    return [_row(where, sample, chat, number, options) for number, (sample, chat) in enumerate(zip(samples, encoded))]


def _row(where: str, record, encoded, number: int, options: RowOptions) -> dict:
    ids, labels, max_length = encoded.input_ids, encoded.labels, options.max_length
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        kept = slice(-max_length, None) if options.truncation_mode == "keep_end" else slice(None, max_length)
        ids, labels = ids[kept], labels[kept]
    text = canonical_json(record.canonical())
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return {"where": where, "error": None, "kind": None, "record": text,
            "digest_high": int.from_bytes(digest[:8], "big", signed=True),
            "digest_low": int.from_bytes(digest[8:16], "big", signed=True),
            "input_ids": ids, "labels": labels, "supervised": sum(label != -100 for label in labels[1:]),
            "truncated": truncated, "sharegpt": getattr(record, "sharegpt", False),
            "reasoning_not_rendered": encoded.reasoning_not_rendered, "sample": number}


def _encode_shards(shards, masker: AssistantMasker, options: RowOptions):
    for shard in shards:
        for where, obj in iter_shard(shard):
            yield from encode_row(where, obj, masker, options)


def _code_sha256() -> str:
    """The source of what turns records into rows: a change to it makes the cached rows stale."""
    return sha256_records([Path(module.__file__).read_bytes() for module in (chat, masks, sft_sources,
                                                                              sys.modules[__name__])])


def encode_source(source: SFTSource, masker: AssistantMasker, options: RowOptions, num_proc: int = 1,
                  cache_dir: str | None = None) -> datasets.Dataset:
    """Every record of `source` as rows of `FEATURES`, in order, by `num_proc` processes; cached (module docstring)."""
    fingerprint = sha256_records([[source.name, source.key, masker.fingerprint(), asdict(options),
                                   _code_sha256()]])[:40]
    shards = source.shards(max(1, num_proc) * SHARDS_PER_PROCESS)
    return datasets.Dataset.from_generator(
        _encode_shards, features=FEATURES, cache_dir=cache_dir, fingerprint=fingerprint,
        num_proc=num_proc if num_proc > 1 and len(shards) > 1 else None,
        gen_kwargs={"shards": shards, "masker": masker, "options": options})


def _numpy(table: pa.Table, column: str) -> np.ndarray:
    return table.column(column).to_numpy()


@dataclass
class _Kept:
    """The kept rows of one encoded source: row indices (sorted), their digests (for later duplicate checks) and the
    record each came from (`records`: its number in the source, non-decreasing)."""

    rows: np.ndarray
    keys: np.ndarray
    where: pa.ChunkedArray
    records: np.ndarray


def _first_equal(before: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each row of `keys` (shape `(n, 2)`), the index in `before + keys` of the first row equal to it (itself when
    none comes earlier). `np.unique(return_index=True)` gives first occurrences (its sort is stable)."""
    _, first, inverse = np.unique(np.concatenate([before, keys]), axis=0, return_index=True, return_inverse=True)
    return first[inverse.reshape(-1)][len(before) :]


def _report(encoded: datasets.Dataset, name: str, skip_invalid_records: bool, earlier: _Kept | None
            ) -> tuple[_Kept, ChatDataStats]:
    """Count, check and deduplicate the rows of one encoded source (module docstring, step 2).

    Raises:
        InvalidChatRecord: the first invalid record (with the count of all), unless `skip_invalid_records`.
        SFTDataError: no usable record left.
    """
    table = encoded.data
    first_sample = _numpy(table, "sample") == 0
    record_of_row = np.cumsum(first_sample) - 1  # every record's rows are consecutive, numbered from 0
    samples_per_record = np.bincount(record_of_row)
    stats = ChatDataStats(read=int(first_sample.sum()), reasoning_expanded=int((samples_per_record > 1).sum()),
                          reasoning_samples=int(samples_per_record[samples_per_record > 1].sum()))
    where = table.column("where")
    invalid = table.column("error").is_valid().to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(invalid)
    for counted in pc.value_counts(table.column("kind").drop_null()).to_pylist():
        setattr(stats, counted["values"], counted["counts"])
    errors = table.column("error")
    stats.first_errors = [f"{where[int(i)].as_py()}: {errors[int(i)].as_py()}" for i in bad[: chat.MAX_LOGGED_ERRORS]]
    if len(bad) and not skip_invalid_records:
        for line in stats.first_errors:
            logger.error("invalid record %s", line)
        first = int(bad[0])
        more = f" ({len(bad) - 1} more invalid record(s), the first logged above; --skip_invalid_records skips and " \
               "counts them)" if len(bad) > 1 else ""
        raise InvalidChatRecord(where[first].as_py(), errors[first].as_py() + more, table.column("kind")[first].as_py())
    supervised = _numpy(table, "supervised")
    candidates = np.flatnonzero(~invalid & (supervised > 0))
    stats.dropped_after_truncation = int((~invalid & (supervised == 0)).sum())
    keys = np.stack([_numpy(table, "digest_high")[candidates], _numpy(table, "digest_low")[candidates]], axis=1)
    before = earlier.keys if earlier is not None else np.empty((0, 2), dtype=np.int64)
    origin = _first_equal(before, keys)
    own = origin == np.arange(len(before), len(before) + len(candidates))
    stats.duplicates = int((~own).sum())
    for index in np.flatnonzero(~own)[: max(0, chat.MAX_LOGGED_ERRORS - len(stats.first_errors))]:
        source = origin[index]
        original = earlier.where[int(earlier.rows[source])] if source < len(before) else \
            where[int(candidates[source - len(before)])]
        stats.first_errors.append(f"{where[int(candidates[index])].as_py()}: same messages as {original.as_py()}")
    rows = candidates[own]
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy()
    stats.kept, stats.tokens = len(rows), int(lengths[rows].sum())
    stats.supervised_tokens = int(supervised[rows].sum())
    for counter in ("truncated", "sharegpt", "reasoning_not_rendered"):
        setattr(stats, counter, int(_numpy(table, counter)[rows].sum()))
    if stats.duplicates:
        logger.warning("%s: dropped %d record(s) equal to an earlier one (counted as duplicates)", name,
                       stats.duplicates)
    logger.info("%s: %s", name, {k: v for k, v in stats.as_dict().items() if k != "first_errors"})
    for error in stats.first_errors:
        logger.warning("skipped %s", error)
    if stats.reasoning_not_rendered:
        logger.warning("%s: the chat template does not render the reasoning_content of %d assistant message(s) "
                       "(its history rules, or no support): not trained on", name, stats.reasoning_not_rendered)
    if stats.reasoning_expanded:
        logger.info("%s: %d conversation(s) cut into %d samples, one per reasoning turn (split_reasoning_turns)", name,
                    stats.reasoning_expanded, stats.reasoning_samples)
    if not len(rows):
        counts = {k: v for k, v in stats.as_dict().items() if k != "first_errors"}
        raise SFTDataError(f"{name}: no usable conversation left ({counts})")
    return _Kept(rows, keys[own], where, record_of_row[rows]), stats


def _stream_records(encoded: datasets.Dataset, rows: np.ndarray):
    """The `record` strings of `rows` (sorted), read from the Arrow files without memory-mapping them."""
    start = 0
    for batch in iter_arrow_batches(encoded):
        stop = start + batch.num_rows
        texts = batch.column("record")
        for row in rows[np.searchsorted(rows, start) : np.searchsorted(rows, stop)]:
            yield texts[int(row) - start].as_py()
        start = stop


def _rows(encoded: datasets.Dataset, rows: np.ndarray) -> datasets.Dataset:
    contiguous = len(rows) and rows[-1] - rows[0] + 1 == len(rows)
    selected = encoded.select(range(int(rows[0]), int(rows[-1]) + 1) if contiguous else rows)
    return selected.select_columns(["input_ids", "labels"])


def load_sft_data(
    tokenizer,
    train_file: str | os.PathLike | None = None,
    *,
    eval_file: str | os.PathLike | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    dataset_train_split: str | None = None,
    dataset_test_split: str | None = None,
    val_split: float = 0.0,
    seed: int = 42,
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    assistant_only_loss: bool = True,
    completion_only_loss: bool | None = None,
    eos_token: str | None = None,
    dataset_text_field: str = "text",
    shuffle_dataset: bool = False,
    split_reasoning_turns: bool = False,
    ignore_empty_reasoning: bool = False,
    skip_invalid_records: bool = False,
    chat_template: str | None = None,
    dataset_num_proc: int | None = None,
    cache_dir: str | None = None,
) -> SFTData:
    """Read, validate, mask and truncate SFT records into train/eval datasets with their provenance (module
    docstring). `sft_data_options` gives the keyword arguments from a recipe's arguments.

    Training records come from `train_file` (JSONL, or gzip-compressed JSONL) or the `dataset_train_split` (default
    "train") of `dataset_name` (with `dataset_config`). Evaluation records from the `dataset_test_split` of
    `dataset_name`, or a disjoint seeded `val_split` of the kept training records (`split_indices`), or `eval_file`;
    with none, `eval` is None. Records equal to an earlier one are dropped and counted before the split, so no
    conversation is in both train and eval. `provenance` holds `train_records_sha256` / `eval_records_sha256`
    (`sha256_records` of the kept rows' canonical form in dataset order, before shuffling), the local files' sha256,
    the `datasets` sources, the split seed, the sizes, the end-of-turn text, the `options` that shaped the rows and
    the counts (`ChatDataStats` per source).

    Args:
        max_length: rows are cut to this many tokens (None: not cut, for TRL's `bfd_split` / `wrapped` packing,
            which keeps the overflow); `truncation_mode` "keep_start" keeps the first tokens, "keep_end" the last.
        assistant_only_loss: hfl3's default True trains the assistant replies the template renders; False the whole
            text, as TRL (`hfl3.data.masks`).
        completion_only_loss: prompt–completion records: None or True trains the completion only, False the whole
            record (TRL's).
        eos_token: instead of the tokenizer's EOS token (TRL's `eos_token`), appended to plain text.
        dataset_text_field: the key of a language-modeling record's text (TRL's).
        shuffle_dataset: shuffle the train and eval rows with `seed`, as TRL's preparation does (which hfl3 skips when
            not packing; `sft_data_options` sets this only then).
        split_reasoning_turns: one sample per assistant turn with reasoning (`hfl3.data.chat.split_reasoning_turns`).
        ignore_empty_reasoning: leave the empty reasoning block a template inserts out of the loss.
        dataset_num_proc: processes that encode (TRL's `SFTConfig.dataset_num_proc`; None: 1).
        cache_dir: where the encoded rows, and a `datasets` source's prepared Arrow files, are cached (default: the
            `datasets` cache, `HF_DATASETS_CACHE`).

    Raises:
        InvalidChatRecord: the first bad record (all are counted in its message), unless `skip_invalid_records`.
        SFTDataError: a file that is not JSONL (Parquet, Arrow, another compression) or holds no record, a split
            without rows, or a source with no usable record left; each before any record is encoded but the last.
        ValueError: not exactly one training source, more than one evaluation source, an unknown `truncation_mode`,
            or an `eos_token` not in the tokenizer's vocabulary.
    """
    if (train_file is None) == (dataset_name is None):
        raise ValueError("give exactly one of train_file and dataset_name")
    given = [name for name, value in (("dataset_test_split", dataset_test_split), ("eval_file", eval_file),
                                      ("val_split", val_split)) if value]
    if len(given) > 1:
        raise ValueError(f"give either {given[0]} or {given[1]}, not both")
    if dataset_test_split and dataset_name is None:
        raise ValueError("dataset_test_split needs dataset_name")
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode={truncation_mode!r}; expected one of {', '.join(TRUNCATION_MODES)}")
    masker = AssistantMasker(tokenizer, chat_template, assistant_only_loss=assistant_only_loss, eos_token=eos_token,
                             ignore_empty_reasoning=ignore_empty_reasoning)
    options = RowOptions(max_length, truncation_mode, completion_only_loss, dataset_text_field, split_reasoning_turns)
    num_proc = dataset_num_proc or 1
    if train_file is not None:
        sources = {"train_file": open_jsonl(str(train_file), argument="train_file")}
    else:
        sources = {"dataset_train_split": open_dataset(dataset_name, dataset_config, dataset_train_split or "train",
                                                       cache_dir, dataset_text_field)}
    if eval_file is not None:
        sources["eval_file"] = open_jsonl(str(eval_file), argument="eval_file")
    if dataset_test_split:
        sources["dataset_test_split"] = open_dataset(dataset_name, dataset_config, dataset_test_split, cache_dir,
                                                     dataset_text_field)
    encoded, kept, stats, earlier = {}, {}, {}, None
    for argument, source in sources.items():
        encoded[argument] = encode_source(source, masker, options, num_proc, cache_dir)
        kept[argument], stats[argument] = _report(encoded[argument], source.name, skip_invalid_records, earlier)
        earlier = earlier or kept[argument]
    train_argument, *eval_arguments = sources
    train_encoded, train_rows = encoded[train_argument], kept[train_argument].rows
    if val_split:  # by record: the samples of one record stay on one side
        records, record_of_row = np.unique(kept[train_argument].records, return_inverse=True)
        _, eval_records = split_indices(len(records), val_split, seed)
        held_out = np.isin(record_of_row, eval_records)
        eval_encoded, eval_rows = train_encoded, train_rows[held_out]
        train_rows = train_rows[~held_out]
    elif eval_arguments:
        eval_encoded, eval_rows = encoded[eval_arguments[0]], kept[eval_arguments[0]].rows
    else:
        eval_encoded, eval_rows = None, np.empty(0, dtype=np.int64)
    files = {path: digest for source in sources.values() for path, digest in
             source.provenance.get("files_sha256", {}).items()}
    provenance = {
        "train_records_sha256": sha256_records(_stream_records(train_encoded, train_rows)),
        "eval_records_sha256": sha256_records(_stream_records(eval_encoded, eval_rows)) if len(eval_rows) else None,
        "files_sha256": files,
        "datasets": [source.provenance["dataset"] for source in sources.values() if "dataset" in source.provenance],
        "val_split": val_split,
        "split_seed": seed if val_split else None,
        "train_examples": len(train_rows),
        "eval_examples": len(eval_rows),
        "max_length": max_length,
        "end_of_turn": masker.end_of_turn,
        "options": {**{k: v for k, v in asdict(options).items() if k != "max_length"}, **masker.options(),
                    "shuffle_dataset": shuffle_dataset, "shuffle_seed": seed if shuffle_dataset else None},
        "counts": {argument: s.as_dict() for argument, s in stats.items()},
    }
    supervised = int(_numpy(train_encoded.data, "supervised")[train_rows].sum())
    train = _rows(train_encoded, train_rows)
    evaluation = _rows(eval_encoded, eval_rows) if len(eval_rows) else None
    if shuffle_dataset:  # TRL's `_prepare_dataset`: `dataset.shuffle(seed=args.seed)`, train and eval alike
        train = train.shuffle(seed=seed)
        evaluation = evaluation.shuffle(seed=seed) if evaluation is not None else None
    return SFTData(train, evaluation, stats, provenance, supervised)


def sft_data_options(script_args, training_args, model_args) -> dict:
    """`load_sft_data`'s keyword arguments (all but the tokenizer and `train_file`) from a chat SFT recipe's
    arguments: the data sources and split of `script_args`, TRL's data flags of `training_args` (an `SFTConfig`) as
    TRL 1.16 acts on them, and hfl3's reasoning flags. `model_args` is taken for the recipe's argument order; no data
    option comes from it (the tokenizer carries `--chat_template_path`).

    Where TRL acts on a flag itself the rows are left for it: with `packing_strategy` "bfd_split" or "wrapped" the rows
    reach TRL's packer uncut (`max_length` None), as TRL's own preparation hands them over (it truncates only when not
    packing, and those strategies keep the overflow); `shuffle_dataset` is applied here only when TRL's preparation is
    skipped (`dataset_kwargs={"skip_prepare_dataset": True}`, hfl3's default when not packing), since TRL's
    preparation shuffles itself. "bfd" packing cuts each row to `max_length` as `truncation_mode` says (TRL's "bfd"
    keeps the start whatever the mode). The reasoning flags are read with `getattr` and default off.
    """
    packing_keeps_overflow = training_args.packing and training_args.packing_strategy in ("bfd_split", "wrapped")
    trl_prepares = not (training_args.dataset_kwargs or {}).get(SKIPS_PREPARATION, False)
    return {
        "eval_file": script_args.eval_file or None,
        "dataset_name": script_args.dataset_name,
        "dataset_config": script_args.dataset_config,
        "dataset_train_split": script_args.dataset_train_split,
        "dataset_test_split": script_args.dataset_test_split,
        "val_split": script_args.val_split,
        "seed": training_args.seed,
        "max_length": None if packing_keeps_overflow else training_args.max_length,
        "truncation_mode": training_args.truncation_mode,
        "assistant_only_loss": training_args.assistant_only_loss,
        "completion_only_loss": training_args.completion_only_loss,
        "eos_token": training_args.eos_token,
        "dataset_text_field": training_args.dataset_text_field,
        "shuffle_dataset": training_args.shuffle_dataset and not trl_prepares,
        "split_reasoning_turns": getattr(script_args, "split_reasoning_turns", False),
        "ignore_empty_reasoning": getattr(script_args, "ignore_empty_reasoning", False),
        "skip_invalid_records": script_args.skip_invalid_records,
        "dataset_num_proc": training_args.dataset_num_proc,
    }
