"""Pretraining corpora as lists of shards that are read in batches of documents and can resume at any batch.

`--dataset` is a comma-separated mix of:
- `stdlib`: the `.py` files of the running interpreter's standard library (real text on every machine), one
  document per file;
- local `.txt` files, folders (their `.txt`, `.jsonl`, `.json` and `.parquet` files) and globs. A `.txt` file is one
  document, except that an entry naming a single `.txt` file is split at blank lines; `document_separator` splits
  every `.txt` file at that string instead ("" keeps every file whole);
- local `.jsonl` / `.json` / `.parquet` files (one document per record, field `text_column`), read with `datasets`
  streaming;
- any other name or path: a `datasets` dataset on the Hub or on disk (`load_dataset(name, config, split=...,
  streaming=True)`).
A `datasets` source has one shard per data file, and per row group of a parquet file (`IterableDataset.reshard`).

A UTF-8 byte order mark at the start of a text file is dropped. A local file whose bytes equal an earlier file's (same
sha256; or a file of the held-out `exclude` corpus) is left out and listed under `duplicate_files`; documents that
repeat within a shard are dropped by the stream (`hfl3.data.streaming.DocumentSource`).

Nothing is loaded whole: text files are read in 1 MiB blocks (a document is in memory only while it is cut into
pieces), the `datasets` shards stream record batches. Each local file is inspected once when the corpus is opened
(size, sha256, and for text: UTF-8 and not empty), streaming its bytes.
"""

import codecs
import functools
import glob
import logging
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from hfl3.provenance import sha256_file

from .stdlib import stdlib_files

logger = logging.getLogger(__name__)

DATASETS_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
LOCAL_SUFFIXES = (".txt", ".py", *DATASETS_BUILDERS)
BLANK_LINES = "blank lines"  # the separator of a single .txt file: one or more empty or whitespace-only lines
READ_BYTES = 1 << 20
_BLANK_LINES = re.compile(rb"\n\s*\n")
_NOT_SPACE = re.compile(rb"\S")


class Shard:
    """A part of a corpus read in order: `read(position, batch_size, stride)` yields `(texts, position)` per batch
    of documents, `position` being what `read` needs to continue right after that batch (JSON-safe)."""

    name: str

    def read(self, position: dict | None, batch_size: int, stride: tuple[int, int] = (1, 0)) -> Iterator[tuple]:
        """Batches of documents after `position` (None: from the start). `stride = (step, offset)` keeps the
        documents whose index in the shard is `offset` modulo `step` (the other documents are read and dropped), so
        `step` readers of one shard see disjoint documents."""
        documents = position["documents"] if position else 0
        step, offset = stride
        for texts, inner in self._batches(position["inner"] if position else None, batch_size):
            first = (offset - documents) % step
            documents += len(texts)
            yield texts[first::step], {"inner": inner, "documents": documents}

    def _batches(self, inner, batch_size: int) -> Iterator[tuple[list[str], object]]:
        raise NotImplementedError


@dataclass
class TextShard(Shard):
    """A text file: one document (`separator` None), or documents between separators (`BLANK_LINES` or a string).
    The position is the byte offset where the next document starts, so reading resumes with a seek."""

    path: str
    name: str
    separator: str | None = None

    def _batches(self, inner, batch_size):
        texts, offset = [], inner or 0
        for text, offset in self._documents(offset):
            if text.strip():
                texts.append(text)
            if len(texts) == batch_size:
                yield texts, offset
                texts = []
        if texts:
            yield texts, offset

    def _documents(self, start: int) -> Iterator[tuple[str, int]]:
        with open(self.path, "rb") as f:
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
                    yield self._decode(window[begin : match.start()], offset + begin), offset + match.end()
                    begin = match.end()
                if not block:
                    if begin < len(window):
                        yield self._decode(window[begin:], offset + begin), offset + len(window)
                    return
                carry, offset = window[begin:], offset + begin

    def _decode(self, data: bytes, offset: int) -> str:
        if offset == 0 and data.startswith(codecs.BOM_UTF8):  # a byte order mark, not text
            data = data[len(codecs.BOM_UTF8) :]
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.name}: byte {offset + error.start} is not UTF-8 (the file changed after it was "
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
            raise ValueError(f"{self.source.name}: {dataset.num_shards} shards now, {self.source.num_shards} when the "
                             "corpus was opened")
        dataset = dataset.shard(num_shards=self.source.num_shards, index=self.index)  # a copy: state stays local
        if inner is not None:
            dataset.load_state_dict(inner)
        for batch in dataset.iter(batch_size=batch_size):
            if self.source.text_column not in batch:
                raise ValueError(f"{self.name}: no column {self.source.text_column!r} (columns: {sorted(batch)}); "
                                 "set --text_column")
            yield [text for text in batch[self.source.text_column] if text and text.strip()], dataset.state_dict()


@dataclass
class DatasetsSource:
    """`load_dataset(path, config, data_files=..., split=..., streaming=True)`: a local file with a packaged builder
    (`path` "json" or "parquet") or a dataset name / folder."""

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
        """Its shards; raises `ValueError` when the dataset's features are known and lack `text_column`."""
        dataset = self.open()
        if dataset.features is not None and self.text_column not in dataset.features:
            raise ValueError(f"{self.name}: no column {self.text_column!r} (columns: {sorted(dataset.features)}); "
                             "set --text_column")
        self.num_shards = dataset.num_shards
        return [DatasetsShard(self, i, f"{self.name}#{i}" if self.num_shards > 1 else self.name)
                for i in range(self.num_shards)]


@functools.lru_cache(maxsize=64)
def _load_streaming(path, config, split, data_files) -> datasets.IterableDataset:
    dataset = datasets.load_dataset(path, config, data_files=list(data_files) if data_files else None, split=split,
                                    streaming=True)
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
        text_column: field holding the text in `.jsonl`/`.json`/`.parquet` files and `datasets` sources.
        split, dataset_config: split and configuration name of a `datasets` source.
        document_separator: split every `.txt` file at this string; "" keeps every `.txt` file whole (default: see
            the module docstring).
        skip_invalid: skip (and report) non-UTF-8 or empty text files instead of raising (always on for `stdlib`,
            whose empty `__init__.py` files and deliberately mis-encoded test files are expected).
        exclude: a corpus whose local files are left out (the held-out validation source).

    Raises:
        FileNotFoundError: a local entry that matches no file (the message lists the suffixes that are read, and
            those found in the folder).
        ValueError: a text file that is not UTF-8 or empty (unless `skip_invalid`), or an empty corpus.
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
            separator = (BLANK_LINES if len(files) == 1 else None) if document_separator is None \
                else document_separator or None
            _add_files(corpus, files, separator, skip_invalid, text_column, excluded, excluded_sha256)
        elif Path(entry).expanduser().is_dir():
            try:
                _add_datasets(corpus, DatasetsSource(entry, entry, text_column, dataset_config, split))
            except datasets.exceptions.DataFilesNotFoundError:
                raise FileNotFoundError(_no_file_message(entry)) from None
        else:
            _add_datasets(corpus, DatasetsSource(entry, entry, text_column, dataset_config, split))
    if corpus.skipped:
        logger.warning("corpus %s: skipped %d file(s) (listed in the metadata)", spec, len(corpus.skipped))
        logger.debug("skipped: %s", corpus.skipped)
    if corpus.duplicates:
        logger.warning("corpus %s: left out %d file(s) identical to another one (listed in the metadata)", spec,
                       len(corpus.duplicates))
    if not corpus.shards:
        raise ValueError(f"corpus {spec!r} has no readable file (skipped: {corpus.skipped or 'none'})")
    return corpus


def _is_local(entry: str) -> bool:
    path = Path(entry).expanduser()
    if path.is_dir():
        return any(p.suffix in LOCAL_SUFFIXES for p in path.iterdir())
    return path.exists() or glob.has_magic(entry) or entry.endswith(LOCAL_SUFFIXES)


def _expand(entry: str) -> list[tuple[Path, str]]:
    """Files of a local entry, sorted, with their names relative to the entry's folder (a glob: its leading part
    without wildcards)."""
    path = Path(entry).expanduser()
    if path.is_dir():
        matches, root = sorted(p for p in path.iterdir() if p.suffix in LOCAL_SUFFIXES and p.is_file()), path
    elif path.is_file():
        matches, root = [path], path.parent
    else:
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        parts = path.parts
        root = Path(*parts[: next(i for i, part in enumerate(parts) if glob.has_magic(part))] or ["."])
    if not matches:
        raise FileNotFoundError(_no_file_message(entry))
    return [(p, p.relative_to(root).as_posix() if p.is_relative_to(root) else p.name) for p in matches]


def _no_file_message(entry: str) -> str:
    """`entry` matches no file: which suffixes are read, and which the folder (or the glob's folder) holds."""
    path = Path(entry).expanduser()
    folder = path if path.is_dir() else Path(*path.parts[: next((i for i, part in enumerate(path.parts)
                                                                  if glob.has_magic(part)), len(path.parts) - 1)])
    found = sorted({p.suffix or p.name for p in folder.iterdir() if p.is_file()}) if folder.is_dir() else []
    return (f"{entry!r} matches no file: a --dataset entry reads {', '.join(LOCAL_SUFFIXES)} files (suffixes are "
            f"case-sensitive), a folder's own such files, or a `datasets` folder; {folder} holds "
            f"{', '.join(found) or 'no file'}: rename or convert the files")


def _add_files(corpus: Corpus, files: list[tuple[Path, str]], separator: str | None, skip_invalid: bool,
               text_column: str, excluded: set[Path], excluded_sha256: dict[str, str]) -> None:
    first_with = dict(excluded_sha256)  # sha256 -> the name of the first file with those bytes
    for path, name in files:
        resolved = path.resolve()
        if resolved in excluded:
            continue
        builder = DATASETS_BUILDERS.get(path.suffix)
        size, sha256, problem = inspect_file(path, check_text=builder is None)
        if problem:
            if not skip_invalid:
                raise ValueError(f"{path}: {problem}; fix or remove it, or pass --skip_invalid_files")
            corpus.skipped[name] = problem
            continue
        if sha256 in first_with:
            corpus.duplicates[name] = first_with[sha256]
            continue
        first_with[sha256] = name
        corpus.files.append(SourceFile(name, size, sha256))
        corpus.local_paths.add(resolved)
        if builder:
            corpus.shards += DatasetsSource(builder, name, text_column, data_files=(str(path),)).shards()
        else:
            corpus.shards.append(TextShard(str(path), name, separator if path.suffix == ".txt" else None))


def _add_datasets(corpus: Corpus, source: "DatasetsSource") -> None:
    """A `datasets` name or folder: its shards; its data files (a folder's with size and sha256, the Hub's as URLs
    that name the revision) into the report."""
    corpus.shards += source.shards()
    data_files = datasets.load_dataset_builder(source.path, source.config).config.data_files or {}
    names, folder = [str(f) for f in data_files.get(source.split, [])], Path(source.path)
    if folder.is_dir():
        files, names = names, []
        for file in map(Path, files):
            size, sha256, _ = inspect_file(file, check_text=False)
            names.append(file.relative_to(folder).as_posix())
            corpus.files.append(SourceFile(names[-1], size, sha256))
            corpus.local_paths.add(file.resolve())
    corpus.datasets.append({"name": source.name, "config": source.config, "split": source.split,
                            "shards": source.num_shards, "data_files": names})


def inspect_file(path: Path, check_text: bool) -> tuple[int, str, str | None]:
    """`(bytes, sha256, problem)` of a file read once (`sha256_file` in 1 MiB blocks, the checks seeing each block as it
    is hashed); `problem` ("not UTF-8 (byte N)", "empty") is checked for text files only, else None."""
    check = _FileCheck(check_text)
    sha256 = sha256_file(path, READ_BYTES, on_chunk=check)
    return check.size, sha256, check.finish()


class _FileCheck:
    """Fed a file's blocks in order: counts its bytes and, for a text file, checks that they are UTF-8 holding more
    than whitespace."""

    def __init__(self, text: bool):
        self.text, self.size, self.seen_text, self.problem = text, 0, False, None
        self.decoder = codecs.getincrementaldecoder("utf-8")()

    def __call__(self, block: bytes) -> None:
        if self.text and self.problem is None:
            try:
                text = self.decoder.decode(block)
                text = text.removeprefix("\ufeff") if self.size == 0 else text  # a byte order mark is not text
                self.seen_text = self.seen_text or bool(text.strip())
            except UnicodeDecodeError as error:
                self.problem = f"not UTF-8 (byte {self.size + error.start})"
        self.size += len(block)

    def finish(self) -> str | None:
        if not self.text or self.problem is not None:
            return self.problem
        try:
            self.decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return f"not UTF-8 (truncated at byte {self.size})"
        return None if self.seen_text else "empty"
