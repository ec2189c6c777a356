"""Where SFT records come from: chat JSONL files that hfl3 reads itself (`--train_file`, `--eval_file`: every line
checked, errors at `file:line`, each record kept in its own shape) and `datasets` sources (`--dataset_name`: a Hub id, a
local folder, or a json/jsonl/parquet/arrow file, with `--dataset_config` and a split), cut into shards that
`datasets` worker processes read in order (`SFTSource.shards`, `iter_shard`).

A JSONL file is checked before anything else (`check_jsonl_file`: a Parquet or Arrow file, another compression, an
empty or blank file are named in one line), then read once, in 1 MiB blocks: its sha256 (provenance and the cache key)
and the byte offsets of the line starts where shards begin. A gzip-compressed file (found by its magic bytes, as
`datasets` reads `.jsonl.gz`) is read decompressing: its sha256 is the compressed file's, its offsets count
decompressed bytes. A `datasets` source is `datasets.load_dataset(...)` (Arrow, memory-mapped,
cached by `datasets`); its shards are row ranges. `iter_source` reads the first records of either without opening
it whole (`python -m hfl3.data.inspect`; `datasets` sources stream).
"""

from __future__ import annotations

import itertools
import logging
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow as pa
from datasets.exceptions import DatasetGenerationError

from hfl3.data.chat import BOM, GZIP_MAGIC, SFTDataError, iter_jsonl, open_jsonl_bytes
from hfl3.provenance import sha256_file

logger = logging.getLogger(__name__)

READ_BYTES = 1 << 20
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMAT_COLUMNS = "a 'messages' or 'conversations' column, 'prompt' and 'completion', or the dataset_text_field"
ROWS_PER_READ = 256
# What a --train_file may be instead of JSONL, by the bytes it starts with: (magic, what it is, what to do)
NOT_JSONL = [(b"PAR1", "a Parquet file", "pass it as --dataset_name {path}, which reads it"),
             (b"ARROW1", "an Arrow file", "pass it as --dataset_name {path}, which reads it"),
             (b"BZh", "a bzip2-compressed file", "decompress it to JSONL (gzip is read as it is)"),
             (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it to JSONL (gzip is read as it is)"),
             (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it to JSONL (gzip is read as it is)"),
             (b"PK\x03\x04", "a zip archive", "extract the JSONL file from it")]


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


def check_jsonl_file(path: str, argument: str = "train_file") -> bool:
    """Whether `path` (given as `--ARGUMENT`) is gzip-compressed, after checking that it is JSONL with a record: its
    first bytes and its first non-blank line, read at once (the whole file only when it is blank).

    Raises:
        SFTDataError: one line naming the argument and the file: a Parquet or Arrow file (pass it as
            `--dataset_name`), another compression or a zip archive, an unreadable gzip file, or no record at all
            (empty, or only blank lines).
    """
    with open(path, "rb") as f:
        head = f.read(8)
    for magic, what, fix in NOT_JSONL:
        if head.startswith(magic):
            raise SFTDataError(f"--{argument} {path}: {what}, not JSONL; {fix.format(path=path)}")
    try:
        with open_jsonl_bytes(path) as f:
            while block := f.read(READ_BYTES):
                if block.replace(BOM, b"").strip():
                    return head.startswith(GZIP_MAGIC)
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise SFTDataError(f"--{argument} {path}: not a readable gzip file ({error})") from None
    what = "is empty" if not head else "holds only blank lines"
    raise SFTDataError(f"--{argument} {path}: the file {what}; expected one JSON record per line")


def open_jsonl(path: str, shards: int = 64, argument: str = "train_file") -> SFTSource:
    """A JSONL file (given as `--ARGUMENT`) as a source, checked (`check_jsonl_file`) and read once (`sha256_file`):
    its sha256 and the offsets of about `shards` evenly spaced line starts (in decompressed bytes for gzip).

    Raises:
        SFTDataError: as `check_jsonl_file`; a gzip file that is corrupt or cut short.
    """
    size = Path(path).stat().st_size
    if check_jsonl_file(path, argument):
        with open(path, "rb") as f:  # gzip's last 4 bytes: the last member's size, modulo 2**32
            f.seek(-4, 2)
            decompressed = int.from_bytes(f.read(4), "little")
        starts = _LineStarts(max(size, decompressed) // max(1, shards))
        gunzip = _Gunzip(starts)
        try:
            sha256 = sha256_file(path, READ_BYTES, on_chunk=gunzip)
        except zlib.error as error:
            raise SFTDataError(f"--{argument} {path}: not a readable gzip file ({error})") from None
        if gunzip.inside_member:
            raise SFTDataError(f"--{argument} {path}: not a readable gzip file (it ends inside a compressed stream)")
    else:
        starts = _LineStarts(size // max(1, shards))
        sha256 = sha256_file(path, READ_BYTES, on_chunk=starts)
    return SFTSource(path, path=path, key=sha256, provenance={"files_sha256": {path: sha256}},
                     line_starts=[(offset, line) for offset, line in starts.found if offset < starts.offset])


class _LineStarts:
    """Fed a file's blocks in order: `found` holds `(byte offset, line number)` of the first line starting at or after
    every `every` bytes (and of the first line); `offset` counts the bytes fed."""

    def __init__(self, every: int):
        self.every = max(1, every)
        self.found, self.offset, self.line, self.next_cut = [(0, 1)], 0, 1, self.every

    def __call__(self, block: bytes) -> None:
        position = 0
        while self.offset + len(block) > self.next_cut:
            newline = block.find(b"\n", max(position, self.next_cut - self.offset - 1))
            if newline < 0:
                break
            self.line += block.count(b"\n", position, newline + 1)
            position = newline + 1
            self.found.append((self.offset + position, self.line))
            self.next_cut = self.offset + position + self.every
        self.line += block.count(b"\n", position)
        self.offset += len(block)


class _Gunzip:
    """Fed a gzip file's blocks in order, feeds `sink` the decompressed bytes (every member of a concatenated file),
    at most `READ_BYTES` at a time."""

    def __init__(self, sink):
        self.sink, self.decompressor = sink, zlib.decompressobj(wbits=31)
        self.inside_member = False  # bytes of a member fed, its end not reached: a truncated file when it ends so

    def __call__(self, block: bytes) -> None:
        while True:
            self.inside_member = True
            out = self.decompressor.decompress(block, READ_BYTES)
            if out:
                self.sink(out)
            if self.decompressor.eof:
                block, self.decompressor = self.decompressor.unused_data, zlib.decompressobj(wbits=31)
                self.inside_member = False
                if not block:
                    return
            else:
                block = self.decompressor.unconsumed_tail
                if not block and len(out) < READ_BYTES:
                    return


def load_split(name: str, config: str | None, split: str, streaming: bool = False, cache_dir: str | None = None,
               dataset_text_field: str = "text"):
    """`datasets.load_dataset` of a Hub id, a local folder, or one local data file (json/jsonl/parquet/arrow: its one
    split is "train", as `datasets` names it).

    Raises:
        ValueError: the dataset has no such split (naming the splits it has), or none of the formats' columns (a
            language-modeling dataset's column is `dataset_text_field`).
        SFTDataError: `datasets` fails to prepare it (its reason, e.g. a JSON key given twice in one object), or the
            split has no rows.
    """
    path, data_files = (BUILDERS[Path(name).suffix], name) if Path(name).is_file() else (name, None)
    try:
        dataset = datasets.load_dataset(path, config, data_files=data_files, split=split, streaming=streaming,
                                        cache_dir=cache_dir)
    except DatasetGenerationError as error:  # e.g. pyarrow's "Column(/messages/[]/content) was specified twice"
        raise SFTDataError(f"--dataset_name {name} ({split} split): datasets cannot read it: "
                           f"{str(error.__cause__ or error).splitlines()[0]}") from None
    except ValueError as error:
        if "corresponds to no data" in str(error):  # datasets' words for a split without rows
            raise SFTDataError(f"--dataset_name {name} ({split} split): no rows") from None
        if "split" not in str(error):
            raise
        raise ValueError(f"--dataset_name {name}: {error}") from None
    columns = dataset.column_names or list(dataset.features or {})
    if columns and not ({"messages", "conversations", dataset_text_field} & set(columns) or
                        {"prompt", "completion"} <= set(columns)):
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


def open_dataset(name: str, config: str | None, split: str, cache_dir: str | None = None,
                 dataset_text_field: str = "text") -> SFTSource:
    """A `datasets` split as a source (prepared by `datasets` into `cache_dir`, default its own cache); its local data
    files, if any, are hashed for the provenance.

    Raises:
        ValueError, SFTDataError: as `load_split`.
    """
    dataset = load_split(name, config, split, cache_dir=cache_dir, dataset_text_field=dataset_text_field)
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
                dataset_train_split: str | None = None, dataset_text_field: str = "text"
                ) -> Iterator[tuple[str, object]]:
    """`(where, record object or InvalidChatRecord)` from the start of a JSONL file or a (streamed) dataset split.

    Raises:
        SFTDataError: a `train_file` that is not JSONL or holds no record (`check_jsonl_file`).
        ValueError: as `load_split`.
    """
    if train_file is not None:
        check_jsonl_file(train_file)
        yield from iter_jsonl(train_file)
        return
    split = dataset_train_split or "train"
    for index, row in enumerate(load_split(dataset_name, dataset_config, split, streaming=True,
                                           dataset_text_field=dataset_text_field)):
        yield f"{dataset_name} ({split} split) row {index}", row
