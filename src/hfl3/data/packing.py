"""Cutting documents into pieces and BOS-aligned best-fit packing (nanochat's dataloader rule) over a bounded buffer.

`BestFitPacker` holds at most `buffer_size` tokenized documents; it pulls more from a callable as it takes them, so
the same packer serves a finite read (the validation rows, `hfl3.data.streaming.PackedStream.materialize`) and an
endless stream (`hfl3.data.streaming`). Its buffer can be written out and read back exactly (`state` / `load_state`).
"""

from bisect import bisect_right, insort
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np


def chunk_text(text: str, max_chars: int) -> Iterator[str]:
    """Pieces of at most `max_chars` characters, cut at blank lines, else at line ends, else (a single longer line)
    every `max_chars` characters; consecutive small paragraphs are regrouped up to `max_chars`. A novel or a long
    module so becomes many packable documents instead of one that packing would crop. `max_chars <= 0` yields the
    text whole. Pieces that are only whitespace are dropped."""
    if max_chars <= 0:
        if text.strip():
            yield text
        return
    piece = ""
    for unit in _units(text, max_chars):
        if piece and len(piece) + len(unit) + 1 > max_chars:
            yield piece
            piece = ""
        piece = f"{piece}\n{unit}" if piece else unit
    if piece.strip():
        yield piece


def _units(text: str, max_chars: int) -> Iterator[str]:
    for paragraph in text.split("\n\n"):
        if len(paragraph) <= max_chars:
            yield paragraph
            continue
        for line in paragraph.split("\n"):
            for start in range(0, max(len(line), 1), max_chars):
                yield line[start : start + max_chars]


@dataclass
class PackingReport:
    """Token accounting of the documents a packer has taken: `input_tokens = packed_tokens + cropped_tokens`
    (documents still waiting in a buffer are not counted yet)."""

    documents: int = 0
    rows: int = 0
    packed_tokens: int = 0
    cropped_tokens: int = 0

    @property
    def input_tokens(self) -> int:
        return self.packed_tokens + self.cropped_tokens

    @property
    def cropped_share(self) -> float:
        return self.cropped_tokens / max(1, self.input_tokens)

    def __add__(self, other: "PackingReport") -> "PackingReport":
        return PackingReport(*(getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__))

    def as_dict(self) -> dict:
        return {**vars(self), "input_tokens": self.input_tokens, "cropped_share": self.cropped_share}

    @classmethod
    def from_dict(cls, values: dict) -> "PackingReport":
        """The report of an `as_dict()` (or `vars()`) result."""
        return cls(**{name: values[name] for name in cls.__dataclass_fields__})


class BestFitPacker:
    """BOS-aligned best-fit packing (nanochat's dataloader): rows of exactly `max_seq_len` tokens, no padding.

    Documents enter a buffer of `buffer_size` in the order they are pulled, as `(key, tokens)` pairs: `tokens` a 1-D
    integer array starting with BOS, `key` an int naming the document (`state()` lists the buffer by keys, so that a
    copy of it elsewhere can follow with only the new documents). A row takes the buffered document of the largest
    length that still fits the space left; only when none fits is the shortest document cropped to fill the row (its
    tail is dropped and counted). After every document taken the buffer is refilled, so the rows depend only on the
    order of the documents. Every row starts with BOS, documents mostly stay whole, and when the source runs out the
    last, partial row is dropped and counted as cropped.
    """

    def __init__(self, max_seq_len: int, buffer_size: int = 1000):
        if max_seq_len < 1 or buffer_size < 1:
            raise ValueError(f"max_seq_len={max_seq_len} and buffer_size={buffer_size} must be >= 1")
        self.max_seq_len, self.buffer_size = max_seq_len, buffer_size
        self.report = PackingReport()
        self._lengths: list[int] = []  # sorted lengths of the buffered documents
        self._by_length: dict[int, list[tuple[int, np.ndarray]]] = {}

    def __len__(self) -> int:
        return len(self._lengths)

    def _add(self, document: tuple[int, np.ndarray]) -> None:
        insort(self._lengths, len(document[1]))
        self._by_length.setdefault(len(document[1]), []).append(document)

    def _take(self, length: int) -> np.ndarray:
        self._lengths.pop(bisect_right(self._lengths, length) - 1)
        documents = self._by_length[length]
        _, tokens = documents.pop()
        if not documents:
            del self._by_length[length]
        return tokens

    def _fill(self, pull: Callable[[], tuple[int, np.ndarray] | None]) -> None:
        while len(self._lengths) < self.buffer_size:
            document = pull()
            if document is None:
                return
            self._add(document)

    def next_row(self, pull: Callable[[], tuple[int, np.ndarray] | None]) -> np.ndarray | None:
        """The next row `(max_seq_len,)`, pulling `(key, tokens)` documents with `pull()` (None: the source is
        exhausted); None when the source and the buffer are exhausted."""
        self._fill(pull)
        pieces, space = [], self.max_seq_len
        while space and self._lengths:
            fit = bisect_right(self._lengths, space)
            tokens = self._take(self._lengths[fit - 1] if fit else self._lengths[0])
            self.report.documents += 1
            if len(tokens) > space:
                self.report.cropped_tokens += len(tokens) - space
                tokens = tokens[:space]
            pieces.append(tokens)
            space -= len(tokens)
            self._fill(pull)
        if space:  # the source ran out: the partial row is dropped
            self.report.cropped_tokens += self.max_seq_len - space
            return None
        self.report.rows += 1
        self.report.packed_tokens += self.max_seq_len
        return np.concatenate(pieces)

    def state(self) -> list[tuple[int, np.ndarray]]:
        """The buffered `(key, tokens)` documents in an order that `load_state` turns back into the same buffer (so
        the same rows follow)."""
        return [document for length in sorted(self._by_length) for document in self._by_length[length]]

    def load_state(self, documents: list[tuple[int, np.ndarray]], report: PackingReport) -> None:
        """Replace the buffer and the counters with a saved `state()` and report."""
        self._lengths, self._by_length = [], {}
        for document in documents:
            self._add(document)
        self.report = report


def concatenate_documents(documents: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, lengths)`: the documents end to end and their lengths (int64); `split_concatenated` inverts it."""
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int64)
    return tokens, lengths


def split_concatenated(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """The documents of a `concatenate_documents` result (views into `tokens`)."""
    return np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
