"""Pretraining corpora as lists of shards that are read in batches of documents and can resume at any batch.

`--dataset` is a comma-separated mix of:
- `stdlib`: the `.py` files of the running interpreter's standard library (real text on every machine), one
  document per file;
- local `.txt` files, folders (their `.txt`, `.jsonl`, `.json`, `.parquet` and `.arrow` files) and globs. A `.txt`
  file is one document, except that an entry naming a single `.txt` file is split at blank lines;
  `document_separator` splits every `.txt` file at that string instead ("" keeps every file whole);
- local `.jsonl` / `.json` / `.parquet` / `.arrow` files (one document per record, field `text_column`), read with
  `datasets` streaming; text and JSON files may be compressed with gzip, bzip2 or xz (`a.jsonl.gz`), decompressed
  as they are read (a resumed text file again up to its position); zstd, LZ4 and zip files are refused;
- any other name or path: a `datasets` dataset on the Hub or on disk (`load_dataset(name, config, split=...,
  streaming=True)`).
A `datasets` source has one shard per data file, and per row group of a parquet file (`IterableDataset.reshard`).

Each local file (and each data file of a local `datasets` folder) is inspected once when the corpus is opened,
streaming its bytes (`inspect_file`): size and sha256 as stored, and what would stop its reader later (text not UTF-8
or blank; a JSON line that does not parse or whose text field is not a string; no record with text; a parquet /
arrow file that does not open, lacks the text column or a row; data that does not decompress). Such a file raises
`InputError` naming it, the problem and `--skip_invalid_files`, or with `skip_invalid` is left out and listed with
the reason under `skipped_files`, as is every file of a folder entry whose suffix is not read (`unread_files`). A
UTF-8 byte order mark at the start of a file is dropped. A local file whose bytes equal an earlier file's (same
sha256; or a file of the held-out `exclude` corpus) is left out and listed under `duplicate_files`.

No document is dropped silently: a record whose text is missing or null (`missing_text`) or blank, and a blank piece
between two separators (`empty_text`), are counted by `Shard.read_counted`; repeats within a shard by the stream
(`hfl3.data.streaming.DocumentSource`). Nothing is loaded whole but a JSON array file (as `datasets` reads it): text
files are read in 1 MiB blocks, `datasets` shards stream record batches.
"""

import bz2
import codecs
import functools
import glob
import gzip
import hashlib
import itertools
import json
import logging
import lzma
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from hfl3.errors import InputError

from .stdlib import stdlib_files

logger = logging.getLogger(__name__)

DATASETS_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
TEXT_SUFFIXES = (".txt", ".py")
LOCAL_SUFFIXES = (*TEXT_SUFFIXES, *DATASETS_BUILDERS)
COMPRESSIONS = {".gz": ("gzip", gzip.open), ".bz2": ("bzip2", bz2.open), ".xz": ("xz", lzma.open)}  # path or file
UNREAD_COMPRESSIONS = {".zst": "zstd", ".zstd": "zstd", ".lz4": "LZ4", ".zip": "zip"}  # refused, with the way out
TEXT_DROPS = ("missing_text", "empty_text")  # why a reader drops a record: text missing or null; empty or whitespace
BLANK_LINES = "blank lines"  # the separator of a single .txt file: one or more empty or whitespace-only lines
READ_BYTES = 1 << 20
_BLANK_LINES = re.compile(rb"\n\s*\n")
_NOT_SPACE = re.compile(rb"\S")
_TEXT_DTYPES = ("string", "large_string", "string_view", "null")


def is_blank(text: str) -> bool:
    """Empty or whitespace only."""
    return not text or text.isspace()


def file_format(path: Path) -> tuple[str, str | None]:
    """`(format suffix, compression suffix or None)` of a file name: `a.jsonl.gz` -> `(".jsonl", ".gz")`."""
    if path.suffix in COMPRESSIONS or path.suffix in UNREAD_COMPRESSIONS:
        return Path(path.stem).suffix, path.suffix
    return path.suffix, None


def file_kind(path: Path) -> str | None:
    """How a file is read and checked: "text", "json", "parquet", "arrow" (by its format suffix), else None."""
    return DATASETS_BUILDERS.get(file_format(path)[0]) or ("text" if file_format(path)[0] in TEXT_SUFFIXES else None)


class Shard:
    """A part of a corpus read in order: `read(position, batch_size, stride)` yields `(texts, position)` per batch
    of documents, `position` being what `read` needs to continue right after that batch (JSON-safe)."""

    name: str

    def read(self, position: dict | None, batch_size: int, stride: tuple[int, int] = (1, 0)) -> Iterator[tuple]:
        """Batches of documents after `position` (None: from the start). `stride = (step, offset)` keeps the
        records whose index in the shard is `offset` modulo `step` (the other records are read and dropped), so
        `step` readers of one shard see disjoint documents. Records without text are left out (`read_counted`)."""
        for texts, position, _ in self.read_counted(position, batch_size, stride):
            yield texts, position

    def read_counted(self, position: dict | None, batch_size: int,
                     stride: tuple[int, int] = (1, 0)) -> Iterator[tuple[list[str], dict, dict[str, int]]]:
        """As `read`, with the records of this stride left out for their text, by reason (`TEXT_DROPS`):
        `missing_text` (no text field, or null) and `empty_text` (empty or whitespace only). A batch holds up to
        `batch_size` records, so up to that many documents.

        Raises:
            InputError: a record whose text is neither a string nor null (a `datasets` source whose features were
                not known when the corpus was opened).
        """
        documents = position["documents"] if position else 0
        step, offset = stride
        for records, inner in self._batches(position["inner"] if position else None, batch_size):
            first = (offset - documents) % step
            mine = records[first::step]
            texts = [text for text in mine if isinstance(text, str) and text and not text.isspace()]
            dropped = dict.fromkeys(TEXT_DROPS, 0)
            for index, text in enumerate(mine if len(texts) < len(mine) else ()):
                if text is None:
                    dropped["missing_text"] += 1
                elif isinstance(text, str):
                    dropped["empty_text"] += is_blank(text)
                else:
                    raise InputError(f"{self.name}: record {documents + first + index * step + 1}: its text is "
                                     f"{type(text).__name__} {text!r:.40}, not a string; set --text_column to a "
                                     "text field")
            documents += len(records)
            yield texts, {"inner": inner, "documents": documents}, dropped

    def _batches(self, inner, batch_size: int) -> Iterator[tuple[list, object]]:
        """Up to `batch_size` records (a text, or None) per batch, with the inner position after them."""
        raise NotImplementedError


@dataclass
class TextShard(Shard):
    """A text file, compressed or not: one document (`separator` None), or documents between separators
    (`BLANK_LINES` or a string). The position is the byte offset (of the decompressed text) where the next document
    starts, so reading resumes with a seek."""

    path: str
    name: str
    separator: str | None = None

    def _batches(self, inner, batch_size):
        documents = self._documents(inner or 0)
        while batch := list(itertools.islice(documents, batch_size)):
            yield [text for text, _ in batch], batch[-1][1]

    def _open(self):
        compression = file_format(Path(self.path))[1]
        return COMPRESSIONS[compression][1](self.path) if compression else open(self.path, "rb")

    def _documents(self, start: int) -> Iterator[tuple[str, int]]:
        """`(text, offset after it)` from byte `start` on: the whole file, or the pieces between separators. A blank
        piece before the first separator or after the last one delimits nothing and is left out; one between two
        separators is an empty document (counted by `read_counted`)."""
        with self._open() as f:
            f.seek(start)
            if self.separator is None:
                data = f.read()
                yield self._decode(data, start), start + len(data)
                return
            pattern = _BLANK_LINES if self.separator == BLANK_LINES else re.compile(re.escape(self.separator.encode()))
            carry, offset = b"", start  # carry starts at a document start, at file offset `offset`
            while True:
                block = f.read(READ_BYTES)
                window, begin = carry + block, 0
                for match in pattern.finditer(window):
                    # a run of blank lines ending the window may go on in the next block
                    if block and pattern is _BLANK_LINES and not _NOT_SPACE.search(window, match.end()):
                        break
                    text = self._decode(window[begin : match.start()], offset + begin)
                    if offset + begin or not is_blank(text):
                        yield text, offset + match.end()
                    begin = match.end()
                if not block:
                    if begin < len(window) and not is_blank(text := self._decode(window[begin:], offset + begin)):
                        yield text, offset + len(window)
                    return
                carry, offset = window[begin:], offset + begin

    def _decode(self, data: bytes, offset: int) -> str:
        if offset == 0 and data.startswith(codecs.BOM_UTF8):  # a byte order mark, not text
            data = data[len(codecs.BOM_UTF8) :]
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InputError(f"{self.name}: byte {offset + error.start} is not UTF-8 (the file changed after it was "
                             "inspected?)") from None


@dataclass
class DatasetsShard(Shard):
    """Shard `index` of a `datasets` streaming dataset; the position is the dataset's own `state_dict()`."""

    source: "DatasetsSource"
    index: int
    name: str

    def _batches(self, inner, batch_size):
        dataset = self.source.open()
        if dataset.num_shards != self.source.num_shards:
            raise InputError(f"{self.source.name}: {dataset.num_shards} shards now, {self.source.num_shards} when "
                             "the corpus was opened")
        dataset = dataset.shard(num_shards=self.source.num_shards, index=self.index)  # a copy: state stays local
        if inner is not None:
            dataset.load_state_dict(inner)
        for batch in dataset.iter(batch_size=batch_size):
            if self.source.text_column not in batch:
                raise InputError(f"{self.name}: no column {self.source.text_column!r} (columns: {sorted(batch)}); "
                                 "set --text_column")
            yield batch[self.source.text_column], dataset.state_dict()


@dataclass
class DatasetsSource:
    """`load_dataset(path, config, data_files=..., split=..., streaming=True)`: a local file with a packaged builder
    (`path` "json", "parquet" or "arrow") or a dataset name / folder (`data_files`: only these files of it)."""

    path: str
    name: str
    text_column: str
    config: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] | None = None
    num_shards: int = 0

    def open(self) -> datasets.IterableDataset:
        return _load_streaming(self.path, self.config, self.split, self.data_files)

    def shards(self) -> list[DatasetsShard]:
        """Its shards; raises `InputError` when the dataset's features are known and give no text (`text_column`)."""
        dataset = self.open()
        if problem := _column_problem(dataset.features, self.text_column):
            raise InputError(f"{self.name}: {problem}")
        self.num_shards = dataset.num_shards
        return [DatasetsShard(self, i, f"{self.name}#{i}" if self.num_shards > 1 else self.name)
                for i in range(self.num_shards)]


def _column_problem(features: datasets.Features | None, text_column: str) -> str | None:
    """Why known `features` cannot give text from `text_column` (a mixed-type `Json` column is checked per record)."""
    if features is None:
        return None
    if text_column not in features:
        return f"no column {text_column!r} (columns: {', '.join(features)}); set --text_column"
    feature = features[text_column]
    if isinstance(feature, datasets.Json) or isinstance(feature, datasets.Value) and feature.dtype in _TEXT_DTYPES:
        return None
    return f"column {text_column!r} holds {feature}, not strings; set --text_column"


@functools.lru_cache(maxsize=64)
def _load_streaming(path, config, split, data_files) -> datasets.IterableDataset:
    dataset = datasets.load_dataset(path, config, data_files={split: list(data_files)} if data_files else None,
                                    split=split, streaming=True)
    return dataset.reshard()  # parquet: one shard per row group, so that many streams share few files


@dataclass
class SourceFile:
    """A local file of the corpus: `name` relative to its `--dataset` entry (no absolute path), size, sha256."""

    name: str
    bytes: int
    sha256: str


@dataclass
class Corpus:
    """The shards of a `--dataset` spec (in the spec's order) and what opening it found."""

    spec: str
    shards: list[Shard] = field(default_factory=list)
    files: list[SourceFile] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    duplicates: dict[str, str] = field(default_factory=dict)
    datasets: list[dict] = field(default_factory=list)
    local_paths: set[Path] = field(default_factory=set, repr=False)

    def report(self) -> dict:
        """JSON-safe: the spec, every local file (name, bytes, sha256), skipped and duplicate files (name → reason,
        name → the file it repeats) and `datasets` sources."""
        return {"source": self.spec, "shards": len(self.shards), "files": [vars(f) for f in self.files],
                "skipped_files": self.skipped, "duplicate_files": self.duplicates, "datasets": self.datasets}


def open_corpus(spec: str, text_column: str = "text", split: str = "train", dataset_config: str | None = None,
                document_separator: str | None = None, skip_invalid: bool = False,
                exclude: Corpus | None = None) -> Corpus:
    """The `Corpus` of a `--dataset` spec (see the module docstring), every local file inspected once.

    Args:
        spec: comma-separated entries: `stdlib`, local files/folders/globs, `datasets` names or paths.
        text_column: field holding the text in `.jsonl`/`.json`/`.parquet`/`.arrow` files and `datasets` sources.
        split, dataset_config: split and configuration name of a `datasets` source.
        document_separator: split every `.txt` file at this string; "" keeps every `.txt` file whole (default: see
            the module docstring).
        skip_invalid: skip (and report with the reason) a local file its reader would stop on, instead of raising
            (always on for `stdlib`: its empty `__init__.py` files and mis-encoded test files are expected).
        exclude: a corpus whose local files are left out (the held-out validation source).

    Raises:
        FileNotFoundError: a local entry that matches no file (the message lists the suffixes that are read, and
            those found in the folder).
        InputError: a local file its reader would stop on (unless `skip_invalid`), a source without the text
            column, or an empty corpus.
    """
    corpus = Corpus(spec)
    excluded = exclude.local_paths if exclude else set()
    excluded_sha256 = {f.sha256: f"{f.name} (held out)" for f in exclude.files} if exclude else {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        if entry == "stdlib":
            root = Path(sysconfig.get_paths()["stdlib"])
            files = [(path, path.relative_to(root).as_posix()) for path in stdlib_files()]
            _add_files(corpus, files, None, True, text_column, excluded, excluded_sha256)
        elif _is_local(entry):
            files = _expand(entry)
            corpus.skipped.update(unread_files(entry))
            separator = (BLANK_LINES if len(files) == 1 else None) if document_separator is None \
                else document_separator or None
            _add_files(corpus, files, separator, skip_invalid, text_column, excluded, excluded_sha256)
        elif Path(entry).expanduser().is_dir():
            try:
                _add_datasets(corpus, DatasetsSource(entry, entry, text_column, dataset_config, split), skip_invalid)
            except datasets.exceptions.DataFilesNotFoundError:
                raise FileNotFoundError(_no_file_message(entry)) from None
        else:
            _add_datasets(corpus, DatasetsSource(entry, entry, text_column, dataset_config, split), skip_invalid)
    if corpus.skipped:
        shown = "; ".join(f"{name}: {reason}" for name, reason in list(corpus.skipped.items())[:3])
        logger.warning("corpus %s: skipped %d file(s), all listed with the reason in the metadata: %s%s", spec,
                       len(corpus.skipped), shown, "; ..." if len(corpus.skipped) > 3 else "")
    if corpus.duplicates:
        logger.warning("corpus %s: left out %d file(s) identical to another one (listed in the metadata)", spec,
                       len(corpus.duplicates))
    if not corpus.shards:
        raise InputError(f"corpus {spec!r} has no readable file (skipped: {corpus.skipped or 'none'})")
    return corpus


def _is_local(entry: str) -> bool:
    path = Path(entry).expanduser()
    if path.is_dir():
        return any(_is_listed(p) for p in path.iterdir())
    return path.exists() or glob.has_magic(entry) or _is_listed(path)


def _is_listed(path: Path) -> bool:
    return file_format(path)[0] in LOCAL_SUFFIXES


def _expand(entry: str) -> list[tuple[Path, str]]:
    """Files of a local entry, sorted, with their names relative to the entry's folder (a glob: its leading part
    without wildcards)."""
    path = Path(entry).expanduser()
    if path.is_dir():
        matches, root = sorted(p for p in path.iterdir() if _is_listed(p) and p.is_file()), path
    elif path.is_file():
        matches, root = [path], path.parent
    else:
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        parts = path.parts
        root = Path(*parts[: next(i for i, part in enumerate(parts) if glob.has_magic(part))] or ["."])
    if not matches:
        raise FileNotFoundError(_no_file_message(entry))
    return [(p, p.relative_to(root).as_posix() if p.is_relative_to(root) else p.name) for p in matches]


def unread_files(entry: str) -> dict[str, str]:
    """The files of a folder entry that are not read for their suffix (`blob.bin`, `README.md`), `{name: reason}`,
    so that they are counted and listed (`Corpus.skipped`) rather than left out without a word; {} for a file or a
    glob (every file they name is read)."""
    path = Path(entry).expanduser()
    if not path.is_dir():
        return {}
    read = ", ".join(LOCAL_SUFFIXES)
    return {p.name: f"not read: a folder's {read} files are read (also compressed), and its suffix is "
                    f"{p.suffix or 'none'}" for p in sorted(path.iterdir()) if p.is_file() and not _is_listed(p)}


def _no_file_message(entry: str) -> str:
    """`entry` matches no file: which suffixes are read, and which the folder (or the glob's folder) holds."""
    path = Path(entry).expanduser()
    folder = path if path.is_dir() else Path(*path.parts[: next((i for i, part in enumerate(path.parts)
                                                                  if glob.has_magic(part)), len(path.parts) - 1)])
    found = sorted({p.suffix or p.name for p in folder.iterdir() if p.is_file()}) if folder.is_dir() else []
    return (f"{entry!r} matches no file: a --dataset entry reads {', '.join(LOCAL_SUFFIXES)} files (suffixes are "
            f"case-sensitive), also compressed ({', '.join(COMPRESSIONS)}), a folder's own such files, or a "
            f"`datasets` folder; {folder} holds {', '.join(found) or 'no file'}: rename or convert the files")


def _skip(corpus: Corpus, path: Path, name: str, problem: str, skip_invalid: bool) -> None:
    if not skip_invalid:
        raise InputError(f"{path}: {problem}; fix or remove it, or pass --skip_invalid_files")
    corpus.skipped[name] = problem


def _add_files(corpus: Corpus, files: list[tuple[Path, str]], separator: str | None, skip_invalid: bool,
               text_column: str, excluded: set[Path], excluded_sha256: dict[str, str]) -> None:
    first_with = dict(excluded_sha256)  # sha256 -> the name of the first file with those bytes
    for path, name in files:
        resolved = path.resolve()
        if resolved in excluded:
            continue
        kind = file_kind(path) or "text"  # a file named outright is text whatever its suffix
        size, sha256, problem = inspect_file(path, kind, text_column)
        if problem:
            _skip(corpus, path, name, problem, skip_invalid)
            continue
        if sha256 in first_with:
            corpus.duplicates[name] = first_with[sha256]
            continue
        first_with[sha256] = name
        if kind == "text":
            shards = [TextShard(str(path), name, separator if file_format(path)[0] == ".txt" else None)]
        else:  # the features `datasets` infers from the first records can still lack the column
            source = DatasetsSource(kind, name, text_column, data_files=(str(path),))
            if problem := _column_problem(source.open().features, text_column):
                _skip(corpus, path, name, problem, skip_invalid)
                continue
            shards = source.shards()
        corpus.files.append(SourceFile(name, size, sha256))
        corpus.local_paths.add(resolved)
        corpus.shards += shards


def _add_datasets(corpus: Corpus, source: DatasetsSource, skip_invalid: bool) -> None:
    """A `datasets` name or folder: its shards; its data files (a folder's inspected as local files are, with size
    and sha256; the Hub's as URLs that name the revision) into the report."""
    data_files = datasets.load_dataset_builder(source.path, source.config).config.data_files or {}
    names, folder = [str(f) for f in data_files.get(source.split, [])], Path(source.path).expanduser()
    if folder.is_dir():
        files, names = list(map(Path, names)), []
        for file in files:
            name = file.relative_to(folder).as_posix()
            size, sha256, problem = inspect_file(file, file_kind(file), source.text_column)
            if problem:
                _skip(corpus, file, name, problem, skip_invalid)
                continue
            names.append(name)
            corpus.files.append(SourceFile(name, size, sha256))
            corpus.local_paths.add(file.resolve())
        if not names:
            return
        if len(names) < len(files):  # read only the files that passed
            source.data_files = tuple(str(folder / name) for name in names)
    corpus.shards += source.shards()
    corpus.datasets.append({"name": source.name, "config": source.config, "split": source.split,
                            "shards": source.num_shards, "data_files": names})


def inspect_file(path: Path, kind: str | None, text_column: str = "text") -> tuple[int, str, str | None]:
    """`(bytes, sha256, problem)` of a file read once in 1 MiB blocks: its size and sha256 as stored, and the first
    problem its reader would stop on, or None (module docstring). `kind` (`file_kind`) says what is checked: "text",
    "json" (`text_column` in every record), "parquet" / "arrow" (schema and rows), None (nothing). A compressed file
    (`COMPRESSIONS`) is checked as it decompresses, in blocks of at most 1 MiB.

    Raises:
        OSError: the file cannot be read.
    """
    suffix, compression = file_format(path)
    check = _FileCheck(kind if kind in ("text", "json") else None, text_column)
    if compression in UNREAD_COMPRESSIONS:
        check.problem = (f"{UNREAD_COMPRESSIONS[compression]} data ({compression}), which hfl3 does not read: "
                         "decompress it, or compress it with gzip, bzip2 or xz")
    elif compression and kind in ("parquet", "arrow"):
        check.problem = f"a compressed {suffix} file, which is not read: decompress it ({kind} compresses its columns)"
    with open(path, "rb") as raw:
        hashed = _HashingReader(raw)
        if check.problem is None and compression:
            name, opener = COMPRESSIONS[compression]
            try:
                with opener(hashed, "rb") as decompressed:
                    while block := decompressed.read(READ_BYTES):
                        check(block)
            except (OSError, EOFError, zlib.error, lzma.LZMAError) as error:
                check.problem = f"not valid {name} data ({error})"
        elif check.problem is None:
            while block := hashed.read(READ_BYTES):
                check(block)
        while hashed.read(READ_BYTES):  # the rest of the file, for its size and sha256
            pass
    problem = check.finish()
    if problem is None and kind in ("parquet", "arrow"):
        problem = _table_problem(path, kind, text_column)
    return hashed.size, hashed.sha256.hexdigest(), problem


class _HashingReader:
    """A binary file as its reader sees it, every byte read also hashed and counted."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.sha256.update(data)
        self.size += len(data)
        return data


class _FileCheck:
    """Fed a file's (decompressed) blocks in order: for text, that they are UTF-8 holding more than whitespace; for
    JSON, that they are UTF-8, that every line (or the array, kept to be parsed whole) is an object whose
    `text_column` is a string or null, and that some record holds text."""

    def __init__(self, kind: str | None, text_column: str):
        self.kind, self.text_column, self.size, self.problem, self.seen_text = kind, text_column, 0, None, False
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.lines, self.carry, self.array = 0, "", None  # JSON lines done, the unfinished one; an array's text
        self.records, self.has_field, self.fields = 0, False, {}  # JSON records; field names seen (the first 20)

    def __call__(self, block: bytes) -> None:
        if self.kind is not None and self.problem is None:
            try:
                text = self.decoder.decode(block)
            except UnicodeDecodeError as error:
                self.problem = f"not UTF-8 (byte {self.size + error.start})"
            else:
                text = text.removeprefix("\ufeff") if self.size == 0 else text  # a byte order mark is not text
                if self.kind == "text":
                    self.seen_text = self.seen_text or not is_blank(text)
                else:
                    self._json(text)
        self.size += len(block)

    def _json(self, text: str) -> None:
        if self.size == 0 and text.lstrip().startswith("["):
            self.array = []
        if self.array is not None:
            self.array.append(text)
            return
        lines = (self.carry + text).split("\n")
        self.carry = lines.pop()
        for line in lines:
            self.lines += 1
            if self.problem is None and not is_blank(line):
                try:
                    self._check(json.loads(line), f"line {self.lines}")
                except json.JSONDecodeError as error:
                    self.problem = f"line {self.lines}: not valid JSON ({error.msg}: column {error.colno})"

    def _check(self, record, where: str) -> None:
        if not isinstance(record, dict):
            self.problem = f"{where}: a JSON {_json_type(record)} where a record (object) is expected"
            return
        self.records += 1
        text = record.get(self.text_column)
        if isinstance(text, str):
            self.has_field, self.seen_text = True, self.seen_text or not is_blank(text)
        elif text is not None:
            self.problem = f"{where}: {self.text_column!r} is a JSON {_json_type(text)}, not a string"
        else:
            self.has_field = self.has_field or self.text_column in record
            if len(self.fields) < 20:
                self.fields.update(dict.fromkeys(record))

    def finish(self) -> str | None:
        if self.kind is None or self.problem is not None:
            return self.problem
        try:
            self.decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f"not UTF-8 (truncated at byte {self.size})"
        if self.kind == "text":
            return None if self.seen_text else "empty"
        if self.array is not None:
            try:
                records = json.loads("".join(self.array))
            except json.JSONDecodeError as error:
                return f"not valid JSON ({error.msg}: line {error.lineno} column {error.colno})"
            for number, record in enumerate(records, start=1):
                self._check(record, f"record {number}")
                if self.problem:
                    return self.problem
        else:
            self._json("\n")  # ends the last line
        if self.problem or not self.records:
            return self.problem or "empty (no JSON record)"
        if not self.has_field:
            return f"no record has a field {self.text_column!r} (fields: {', '.join(self.fields)}); set --text_column"
        return None if self.seen_text else f"no record has text in {self.text_column!r} (all null, empty or blank)"


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value),
                                                                                                  "number")


def _table_problem(path: Path, kind: str, text_column: str) -> str | None:
    """Why `datasets` could not read text from a parquet or arrow file: it does not open, lacks `text_column`, holds
    no strings there, or has no row. Reads the parquet footer, or the arrow file's batches memory-mapped (flat
    memory), as `datasets` opens them."""
    try:
        if kind == "parquet":
            parquet = pq.ParquetFile(path)
            schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
        else:
            with pa.memory_map(str(path)) as source:
                try:
                    reader = pa.ipc.open_stream(source)
                    batches = iter(reader)
                except pa.ArrowInvalid:
                    reader = pa.ipc.open_file(source)
                    batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                schema, rows = reader.schema, sum(batch.num_rows for batch in batches)
    except (pa.ArrowException, OSError) as error:
        return f"not a readable {kind} file ({error})"
    return _column_problem(datasets.Features.from_arrow_schema(schema), text_column) or \
        (None if rows else "empty (no row)")
