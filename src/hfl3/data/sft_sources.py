"""Where SFT records come from: chat JSONL files that hfl3 reads itself (`--train_file`, `--eval_file`: every line
checked, errors at `file:line`, each record kept in its own shape) and `datasets` sources (`--dataset_name`: a Hub id, a
local folder, or a json/jsonl/parquet/arrow file, with `--dataset_config` and a split), cut into shards that
`datasets` worker processes read in order (`SFTSource.shards`, `iter_shard`).

A JSONL file is read once when opened, in 1 MiB blocks: its sha256 (provenance and the cache key) and the byte offsets
of the line starts where shards begin. A `datasets` source is `datasets.load_dataset(...)` (Arrow, memory-mapped,
cached by `datasets`); its shards are row ranges. `iter_source` reads the first records of either without opening
it whole (`python -m hfl3.data.inspect`; `datasets` sources stream).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow as pa

from hfl3.data.chat import iter_jsonl
from hfl3.provenance import sha256_file

logger = logging.getLogger(__name__)

READ_BYTES = 1 << 20
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMAT_COLUMNS = "a 'messages' or 'conversations' column, or 'prompt' and 'completion'"
ROWS_PER_READ = 256


@dataclass(frozen=True)
class JsonlShard:
    """Lines of `path` from byte `start` (line `first_line`) to the line starting at or after `stop` (None: the end)."""

    path: str
    name: str
    start: int
    stop: int | None
    first_line: int


@dataclass(frozen=True)
class DatasetShard:
    """Rows `start` to `stop` of a `datasets.Dataset` (pickled by its cache files' paths, not its rows)."""

    dataset: datasets.Dataset
    name: str
    start: int
    stop: int


@dataclass
class SFTSource:
    """One source of records: a JSONL file (`path`) or a `datasets` split (`dataset`). `key` identifies its content
    for the cache (the file's sha256, or the split's `datasets` fingerprint); `provenance` is what the metadata
    records of it."""

    name: str
    path: str | None = None
    dataset: datasets.Dataset | None = None
    key: str = ""
    provenance: dict = field(default_factory=dict)
    line_starts: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (byte offset, line number)

    def shards(self, count: int) -> list[JsonlShard | DatasetShard]:
        """At most `count` shards of about equal size, in order."""
        if self.dataset is not None:
            n = len(self.dataset)
            bounds = sorted({n * i // count for i in range(count + 1)})
            return [DatasetShard(self.dataset, self.name, a, b) for a, b in itertools.pairwise(bounds)]
        starts = self.line_starts[:: max(1, len(self.line_starts) // count)] if self.line_starts else [(0, 1)]
        stops = [offset for offset, _ in starts[1:]] + [None]
        return [JsonlShard(self.path, self.name, start, stop, line) for (start, line), stop in zip(starts, stops)]


def open_jsonl(path: str, shards: int = 64) -> SFTSource:
    """A JSONL file as a source, read once (`sha256_file`): its sha256 and the offsets of about `shards` evenly spaced
    line starts."""
    starts = _LineStarts(Path(path).stat().st_size, shards)
    sha256 = sha256_file(path, READ_BYTES, on_chunk=starts)
    return SFTSource(path, path=path, key=sha256, provenance={"files_sha256": {path: sha256}},
                     line_starts=starts.found)


class _LineStarts:
    """Fed a file's blocks in order: `found` holds `(byte offset, line number)` of the first line starting at or after
    every `size / count` bytes (and of the first line)."""

    def __init__(self, size: int, count: int):
        self.size, self.every = size, max(1, size // max(1, count))
        self.found, self.offset, self.line, self.next_cut = [(0, 1)], 0, 1, self.every

    def __call__(self, block: bytes) -> None:
        position = 0
        while self.offset + len(block) > self.next_cut:
            newline = block.find(b"\n", max(position, self.next_cut - self.offset - 1))
            if newline < 0:
                break
            self.line += block.count(b"\n", position, newline + 1)
            position = newline + 1
            if self.offset + position < self.size:
                self.found.append((self.offset + position, self.line))
            self.next_cut = self.offset + position + self.every
        self.line += block.count(b"\n", position)
        self.offset += len(block)


def load_split(name: str, config: str | None, split: str, streaming: bool = False, cache_dir: str | None = None):
    """`datasets.load_dataset` of a Hub id, a local folder, or one local data file (json/jsonl/parquet/arrow: its one
    split is "train", as `datasets` names it).

    Raises:
        ValueError: the dataset has no such split (naming the splits it has), or none of the formats' columns.
    """
    path, data_files = (BUILDERS[Path(name).suffix], name) if Path(name).is_file() else (name, None)
    try:
        dataset = datasets.load_dataset(path, config, data_files=data_files, split=split, streaming=streaming,
                                        cache_dir=cache_dir)
    except ValueError as error:
        if "split" not in str(error):
            raise
        raise ValueError(f"--dataset_name {name}: {error}") from None
    columns = dataset.column_names or list(dataset.features or {})
    if columns and not ({"messages", "conversations"} & set(columns) or {"prompt", "completion"} <= set(columns)):
        raise ValueError(f"--dataset_name {name} ({split} split): no chat column (columns: {sorted(columns)}); "
                         f"expected {FORMAT_COLUMNS}")
    return dataset


def dataset_splits(name: str, config: str | None) -> list[str] | None:
    """The split names of a `datasets` source as its builder knows them before any data is read (None: unknown)."""
    if Path(name).is_file():
        return ["train"]
    builder = datasets.load_dataset_builder(name, config)
    splits = builder.info.splits or builder.config.data_files
    return [str(split) for split in splits] if splits else None


def open_dataset(name: str, config: str | None, split: str, cache_dir: str | None = None) -> SFTSource:
    """A `datasets` split as a source (prepared by `datasets` into `cache_dir`, default its own cache); its local data
    files, if any, are hashed for the provenance."""
    dataset = load_split(name, config, split, cache_dir=cache_dir)
    provenance = {"dataset": {"name": name, "config": config, "split": split, "fingerprint": dataset._fingerprint}}
    if Path(name).is_file():
        provenance["files_sha256"] = {name: sha256_file(name)}
    elif Path(name).is_dir():
        files = datasets.load_dataset_builder(name, config).config.data_files or {}
        provenance["files_sha256"] = {str(f): sha256_file(f) for f in files.get(split, [])}
    for column in _struct_columns(dataset.features):
        logger.warning("%s (%s split): %s is an Arrow struct: a key that other rows have reads as null in a row that "
                       "lacks it, and the template renders that null; store it as a JSON string (or `datasets.Json`) "
                       "to keep each row's own keys", name, split, column)
    return SFTSource(f"{name} ({split} split)", dataset=dataset, key=dataset._fingerprint, provenance=provenance)


def _struct_columns(features) -> list[str]:
    """`tools` and tool-call `arguments` stored as Arrow structs (not `Json` or strings): rows lose their own keys."""
    def inner(feature, *keys):
        for key in keys:
            feature = getattr(feature, "feature", feature)  # through a List
            feature = feature.get(key) if isinstance(feature, dict) else None
        return feature

    candidates = [("'tools'", getattr(inner(features, "tools"), "feature", None)),
                  ("tool-call 'arguments'", inner(features, "messages", "tool_calls", "function", "arguments"))]
    return [name for name, feature in candidates if isinstance(feature, dict)]


def iter_arrow_batches(dataset: datasets.Dataset) -> Iterator[pa.RecordBatch]:
    """The record batches of a dataset's Arrow files, in order, read without memory-mapping them: the pages read do
    not stay in the process's resident memory, which then stays flat in the data (a memory-mapped read keeps every
    page it touched resident). Only for a dataset of whole Arrow files (`streams_from_files`)."""
    for cache_file in dataset.cache_files:
        with pa.OSFile(cache_file["filename"]) as file:
            yield from pa.ipc.open_stream(file)


def streams_from_files(dataset: datasets.Dataset) -> bool:
    """Whether `dataset` is its Arrow files, whole and in order (no selection of rows or columns, nothing in memory)."""
    if not dataset.cache_files or dataset._indices is not None:
        return False
    rows = 0
    for cache_file in dataset.cache_files:  # memory-mapped: only the batch headers are read
        table = pa.ipc.open_stream(pa.memory_map(cache_file["filename"])).read_all()
        if table.column_names != dataset.column_names:
            return False
        rows += table.num_rows
    return rows == len(dataset)


def iter_shard(shard: JsonlShard | DatasetShard) -> Iterator[tuple[str, object]]:
    """`(where, record object or InvalidChatRecord)` of every record of the shard, in order. Dataset rows are read
    from its Arrow files without memory-mapping them when it is whole files (`iter_arrow_batches`)."""
    if isinstance(shard, JsonlShard):
        yield from iter_jsonl(shard.path, shard.start, shard.stop, shard.first_line, shard.name)
        return
    dataset = shard.dataset
    if streams_from_files(dataset):
        batches, row = _row_range(iter_arrow_batches(dataset), shard.start, shard.stop), shard.start
        decoded = (dataset.features.decode_batch(batch.to_pydict()) for batch in batches)
    else:
        batches, row = None, shard.start
        decoded = dataset.select(range(shard.start, shard.stop)).iter(batch_size=ROWS_PER_READ)
    for batch in decoded:
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns)):
            yield f"{shard.name} row {row}", dict(zip(columns, values))
            row += 1


def _row_range(batches: Iterator[pa.RecordBatch], start: int, stop: int) -> Iterator[pa.RecordBatch]:
    """The rows `start` to `stop` of a stream of record batches, as slices of them."""
    first = 0
    for batch in batches:
        last = first + batch.num_rows
        if last > start and first < stop:
            yield batch.slice(max(0, start - first), min(stop, last) - max(start, first))
        if last >= stop:
            return
        first = last


def iter_source(train_file: str | None = None, dataset_name: str | None = None, dataset_config: str | None = None,
                dataset_train_split: str | None = None) -> Iterator[tuple[str, object]]:
    """`(where, record object or InvalidChatRecord)` from the start of a JSONL file or a (streamed) dataset split."""
    if train_file is not None:
        yield from iter_jsonl(train_file)
        return
    split = dataset_train_split or "train"
    for index, row in enumerate(load_split(dataset_name, dataset_config, split, streaming=True)):
        yield f"{dataset_name} ({split} split) row {index}", row
