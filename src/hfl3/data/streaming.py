"""The pretraining data stream: documents of a `Corpus` split into training / validation by a seeded hash, tokenized
on the fly, shuffled through a bounded buffer and packed BOS-aligned best-fit into rows, in as many disjoint streams
as there are (process, DataLoader worker) pairs, each stream's state small enough to travel with every batch.

- `DocumentSplit`: a document is held out for validation when a keyed hash of its text falls below `val_fraction`;
  no list of documents is kept, duplicates land on the same side, and the split is the same for every stream.
- `DocumentSource`: the documents of one side in stream `i` of `n`: stream `i` owns the shards `i, i + n, ...` (every
  `n`-th document of each shard when there are fewer shards than streams, like `datasets.distributed.
  split_dataset_by_node`), reads them in a seeded order that changes every epoch, and loops forever (training) or
  stops after `epochs`. A document that repeats an earlier one of the same shard (exactly) is dropped and counted
  (`ShardDuplicates`), as are records without text (`hfl3.data.sources.TEXT_DROPS`); every count is part of the
  stream's state, so it survives a resume, and `StreamProgress.summary` sums it over the worker streams.
- `PackedStream`: a `torch` `IterableDataset` of rows `(max_seq_len,)`; `reader(i, n, snapshot)` is stream `i` of `n`
  as a `StreamReader`, which holds that stream's buffers and whose `snapshot()` is its exact state (position in the
  corpus, buffered pieces, shuffle RNG, counters).
- `StreamBatches` / `stream_dataloader`: the DataLoader for the Trainer. DataLoader worker `w` of process `r` is stream
  `r * W + w` of `world_size * W` (`W = max(1, num_workers)`); every batch carries its stream's `update()` taken right
  after its last row (the buffers by key, plus the pieces new since the previous batch: about a batch of tokens), so
  the main process always holds the state that resumes exactly after what it consumed.
- `StreamProgress`: what the main process consumed: each worker's snapshot rebuilt from its updates, the number of
  batches and the chained sha256 of the consumed token rows; saved with every checkpoint and loaded to resume.

Memory: the shuffle buffer and the packing buffer (documents), one read batch and one row batch per stream, and the
duplicate filter's digests of the current shard (at most `MAX_SHARD_DIGESTS`, about 70 bytes each).
"""

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from hfl3.data.packing import BestFitPacker, PackingReport, chunk_text, concatenate_documents, split_concatenated
from hfl3.data.sources import TEXT_DROPS, Corpus
from hfl3.atomic import atomic_path
from hfl3.errors import InputError

DATA_STATE_KEY = "data_state"
STATE_FILE = "data_state_rank{rank}.safetensors"
SHUFFLE_RNG_TAG = 2**32 - 1  # the shuffle buffer's seed `[seed, stream, TAG]`; shard orders use `[seed, stream, epoch]`
_EMPTY_SHA256 = hashlib.sha256().hexdigest()
logger = logging.getLogger(__name__)
MAX_SHARD_DIGESTS = 1 << 18  # per stream: ~18 MB of Python ints at most
SKIP_REASONS = ("held_out", "duplicates", *TEXT_DROPS)  # why a stream leaves a document out, as `batches` counts it


class DocumentSplit:
    """Seeded, disjoint train / validation split of documents by content: a document is held out when the first 8
    bytes of `blake2b(text, key=seed)` (UTF-8, little-endian) read as a fraction of 2^64 are below `val_fraction`.

    Raises:
        ValueError: if `val_fraction` is not in (0, 1).
    """

    def __init__(self, val_fraction: float, seed: int):
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
        self.val_fraction, self.seed = val_fraction, seed
        self._key = seed.to_bytes(8, "little", signed=True)
        self._threshold = int(val_fraction * 2**64)

    def is_validation(self, text: str) -> bool:
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=self._key).digest()
        return int.from_bytes(digest, "little") < self._threshold

    def describe(self) -> dict:
        return {"method": "hash", "hash": "blake2b-64 of the document's UTF-8 text, keyed by the seed",
                "seed": self.seed, "val_fraction": self.val_fraction}


class ShardDuplicates:
    """Exact-duplicate documents within one shard, as one stream reads it: a document is dropped when the 64-bit
    blake2b digest of its UTF-8 text equals that of an earlier document of the shard (a false match needs a 64-bit
    collision: about n² / 2^65 for n documents).

    Scope and memory bound: one shard at a time (a file, or a parquet row group / data file of a `datasets`
    source), the first `MAX_SHARD_DIGESTS` distinct documents of it (later ones are kept unchecked); identical
    local files are left out when the corpus is opened (`hfl3.data.sources`). Repeats across shards are not
    detected: deduplicate a web-scale corpus beforehand. Nothing of it is saved: resuming in the middle of a shard
    re-reads the shard up to the saved position to rebuild the digests (`replay`), so the decisions, and the rows,
    are those of an uninterrupted run, in every epoch."""

    def __init__(self):
        self.digests: set[int] = set()

    @staticmethod
    def digest(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")

    def drop(self, texts: list[str]) -> tuple[list[str], int]:
        """`(texts that are new, number dropped)`; the new ones are remembered."""
        unique = []
        for text in texts:
            digest = self.digest(text)
            if digest in self.digests:
                continue
            if len(self.digests) < MAX_SHARD_DIGESTS:
                self.digests.add(digest)
            unique.append(text)
        return unique, len(texts) - len(unique)

    @classmethod
    def replay(cls, shard, position: dict | None, batch_size: int, stride: tuple[int, int]) -> "ShardDuplicates":
        """The filter's state after reading `shard` up to `position` (a `Shard.read` position; None: the start)."""
        duplicates = cls()
        if position is not None:
            for texts, read in shard.read(None, batch_size, stride):
                if read["documents"] > position["documents"]:
                    break
                duplicates.drop(texts)
        return duplicates


@dataclass
class DocumentSource:
    """The documents of one side (`validation` or training) of a corpus, for stream `i` of `n` (module docstring).

    `shuffle_shards`: read the owned shards in a seeded order drawn anew for every epoch (else in corpus order).
    `epochs`: stop after this many epochs, full reads of the owned shards (None: loop forever).
    `deduplicate`: drop documents that repeat an earlier one of their shard (`ShardDuplicates`).
    """

    corpus: Corpus
    split: DocumentSplit | None = None
    validation: bool = False
    seed: int = 0
    read_batch: int = 64
    shuffle_shards: bool = True
    epochs: int | None = None
    deduplicate: bool = True

    def keep(self, text: str) -> bool:
        return self.split is None or self.split.is_validation(text) == self.validation

    def batches(self, stream: int = 0, num_streams: int = 1, position: dict | None = None) -> Iterator[tuple]:
        """`(kept_texts, skipped, position)` per batch read: `skipped` counts the documents left out by reason
        (`SKIP_REASONS`): `held_out` (of the other side), `duplicates` (repeats within the shard), `missing_text` and
        `empty_text` (records without text, `Shard.read_counted`); `position` resumes right after the batch.

        Raises:
            InputError: a whole epoch over the owned shards yields no document of this side.
        """
        shards = self.corpus.shards
        if len(shards) >= num_streams:
            owned, stride = list(range(stream, len(shards), num_streams)), (1, 0)
        else:  # every stream reads every shard and keeps every num_streams-th document
            owned, stride = list(range(len(shards))), (num_streams, stream)
        position = position or {"epoch": 0, "shard": 0, "read": None}
        epoch = position["epoch"]
        while self.epochs is None or epoch < self.epochs:
            order = owned
            if self.shuffle_shards:
                order = [owned[i] for i in np.random.default_rng([self.seed, stream, epoch]).permutation(len(owned))]
            start, read, kept_in_epoch = position["shard"], position["read"], 0
            skipped_in_epoch = dict.fromkeys(SKIP_REASONS, 0)
            for index in range(start, len(order)):
                shard = shards[order[index]]
                duplicates = ShardDuplicates.replay(shard, read, self.read_batch, stride) if self.deduplicate else None
                for texts, read, dropped in shard.read_counted(read, self.read_batch, stride):
                    repeated = 0
                    if duplicates is not None:
                        texts, repeated = duplicates.drop(texts)
                    kept = [text for text in texts if self.keep(text)]
                    kept_in_epoch += len(kept)
                    skipped = {"held_out": len(texts) - len(kept), "duplicates": repeated, **dropped}
                    for reason, count in skipped.items():
                        skipped_in_epoch[reason] += count
                    yield kept, skipped, {"epoch": epoch, "shard": index, "read": read}
                read = None
            if any(skipped_in_epoch[reason] for reason in ("duplicates", *TEXT_DROPS)):
                logger.info("stream %d of %d, epoch %d: dropped %d document(s) repeating an earlier one of their "
                            "shard, %d without text (missing or null), %d empty", stream, num_streams, epoch,
                            *(skipped_in_epoch[reason] for reason in ("duplicates", *TEXT_DROPS)))
            if start == 0 and not kept_in_epoch:
                raise InputError(self._no_document_message(stream, num_streams, len(owned), skipped_in_epoch))
            epoch += 1
            position = {"epoch": epoch, "shard": 0, "read": None}

    def _no_document_message(self, stream: int, num_streams: int, shards: int, skipped: dict[str, int]) -> str:
        side, other = ("validation", "training") if self.validation else ("training", "validation")
        words = {"held_out": f"on the {other} side", "duplicates": "repeated", "missing_text": "without text",
                 "empty_text": "empty"}
        left = ", ".join(f"{count} {words[reason]}" for reason, count in skipped.items() if count) or "none"
        fix = "raise --val_fraction or pass --eval_dataset" if self.validation else \
            "add data" + (", lower --val_fraction" if self.split else "") + \
            (", or use fewer processes/DataLoader workers" if num_streams > 1 else "")
        return (f"stream {stream} of {num_streams} found no {side} document in {shards} shard(s) of "
                f"{self.corpus.spec!r} (read: {left}); {fix}")

    def require_document(self) -> str:
        """The first document of this side (stream 0 of 1, the first epoch, in reading order): about
        `1 / val_fraction` documents are read on the validation side of a hash split, the whole corpus only when it
        holds none. Call it before the work the documents are for (training a tokenizer), so that a corpus too small
        for its split stops the run at once.

        Raises:
            InputError: no document of this side in the whole corpus (the line names --val_fraction /
                --eval_dataset).
        """
        return next(text for texts, _, _ in DocumentSource(**{**vars(self), "epochs": 1}).batches() for text in texts)

    def sample_texts(self, max_chars: int) -> Iterator[str]:
        """Documents from the start of stream 0 of 1 (the first epoch), the last one cut, until `max_chars`
        characters: the tokenizer's training sample."""
        budget = max_chars
        for texts, _, _ in DocumentSource(**{**vars(self), "epochs": 1}).batches():
            for text in texts:
                yield text[:budget]
                budget -= len(text)
                if budget <= 0:
                    return


class PackedStream(torch.utils.data.IterableDataset):
    """Rows `(max_seq_len,)` of BOS-aligned best-fit packed documents of a `DocumentSource` (stream 0 of 1 when
    iterated directly; see `reader` for stream `i` of `n`).

    Each document is cut into pieces of at most `document_max_chars` characters (`chunk_text`; 0: whole), each piece
    tokenized without special tokens and prefixed with BOS (batched `encode_batch_fast` of the `tokenizers` backend),
    then shuffled through a buffer of `shuffle_buffer` pieces (seeded; 0: in order) and packed over a buffer of
    `packing_buffer` pieces (`BestFitPacker`). Token ids are kept as uint16 when the vocabulary fits, else int32.
    """

    def __init__(self, source: DocumentSource, tokenizer, max_seq_len: int, document_max_chars: int = 0,
                 packing_buffer: int = 1000, shuffle_buffer: int = 1000):
        self.source, self.tokenizer, self.max_seq_len = source, tokenizer, max_seq_len
        self.document_max_chars, self.packing_buffer, self.shuffle_buffer = document_max_chars, packing_buffer, \
            shuffle_buffer
        self.dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.int32
        if tokenizer.bos_token_id is None:
            raise ValueError("the tokenizer has no bos_token; every packed row starts with BOS")

    def __iter__(self) -> Iterator[np.ndarray]:
        reader = self.reader()
        while (row := reader.next_row()) is not None:
            yield row

    def reader(self, stream: int = 0, num_streams: int = 1, snapshot: dict | None = None) -> "StreamReader":
        return StreamReader(self, stream, num_streams, snapshot)

    def tokenize(self, texts: list[str]) -> list[np.ndarray]:
        """[BOS] + token ids of every piece of every text (`document_max_chars`)."""
        pieces = [piece for text in texts for piece in chunk_text(text, self.document_max_chars)]
        if not pieces:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            encoded = [e.ids for e in backend.encode_batch_fast(pieces, add_special_tokens=False)]
        else:
            encoded = self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        documents = []
        for ids in encoded:
            document = np.empty(len(ids) + 1, dtype=self.dtype)
            document[0] = self.tokenizer.bos_token_id
            document[1:] = ids
            documents.append(document)
        return documents

    def sample_documents(self, max_tokens: int) -> list[np.ndarray]:
        """Tokenized pieces from the start of stream 0 of 1 (first epoch, in order) holding `max_tokens` tokens: the
        L3 allocation's sample."""
        sample, budget = [], max_tokens
        for texts, _, _ in DocumentSource(**{**vars(self.source), "epochs": 1}).batches():
            for document in self.tokenize(texts):
                sample.append(document)
                budget -= len(document)
                if budget <= 0:
                    return sample
        return sample

    def materialize(self, max_rows: int) -> tuple[np.ndarray, PackingReport, dict]:
        """The first `max_rows` rows of stream 0 of 1 `(rows, max_seq_len)` int64, the packing report and the
        document counts: the validation set, built once."""
        reader, rows = self.reader(), []
        while len(rows) < max_rows and (row := reader.next_row()) is not None:
            rows.append(row)
        array = np.stack(rows).astype(np.int64) if rows else np.zeros((0, self.max_seq_len), dtype=np.int64)
        return array, reader.packer.report, dict(reader.counts)

    def fingerprint(self) -> dict:
        """What decides the rows: resuming refuses a checkpoint whose stream had another fingerprint."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        vocabulary = backend.to_str() if backend is not None else json.dumps(self.tokenizer.get_vocab(), sort_keys=True)
        corpus = self.source.corpus  # its shards, and the files' content (sha256) and the Hub revisions behind them
        data = json.dumps([[shard.name for shard in corpus.shards], [f.sha256 for f in corpus.files], corpus.datasets])
        return {"corpus": corpus.spec, "data_sha256": hashlib.sha256(data.encode()).hexdigest(),
                "split": self.source.split.describe() if self.source.split else None,
                "tokenizer_sha256": hashlib.sha256(vocabulary.encode()).hexdigest(),
                "max_seq_len": self.max_seq_len, "document_max_chars": self.document_max_chars,
                "packing_buffer": self.packing_buffer, "shuffle_buffer": self.shuffle_buffer,
                "read_batch": self.source.read_batch, "seed": self.source.seed,
                "deduplicate": "within shards" if self.source.deduplicate else None}


class StreamReader:
    """Stream `stream` of `num_streams` of a `PackedStream`, resumable from one of its `snapshot()`s.

    Every tokenized piece gets a key (its arrival number), so that `update()` can describe the state after a batch
    by the keys in each buffer and only the pieces that arrived since the previous update: what a DataLoader worker
    sends along with a batch, about one batch of tokens however large the buffers (`StreamProgress` rebuilds the
    full snapshot in the main process)."""

    def __init__(self, packed: PackedStream, stream: int, num_streams: int, snapshot: dict | None = None):
        self.packed, self.stream, self.num_streams = packed, stream, num_streams
        self.packer = BestFitPacker(packed.max_seq_len, packed.packing_buffer)
        self.rng = np.random.default_rng([packed.source.seed, stream, SHUFFLE_RNG_TAG])
        self.documents: list[tuple[int, np.ndarray]] = []  # (key, tokens) pieces waiting in the shuffle buffer
        self.position, self.counts, self.keys = None, dict.fromkeys(("documents", *SKIP_REASONS), 0), 0
        self._arrived: dict[int, np.ndarray] = {}  # pieces tokenized since the last update()
        if snapshot is not None:
            self._restore(snapshot)
        self._batches = packed.source.batches(stream, num_streams, self.position)

    def _pull(self) -> tuple[int, np.ndarray] | None:
        shuffle = self.packed.shuffle_buffer > 0
        while len(self.documents) < max(1, self.packed.shuffle_buffer):
            batch = next(self._batches, None)
            if batch is None:
                break
            texts, skipped, self.position = batch
            self.counts["documents"] += len(texts)
            for reason, count in skipped.items():
                self.counts[reason] += count
            pieces = list(enumerate(self.packed.tokenize(texts), start=self.keys))
            self.keys += len(pieces)
            self._arrived.update(pieces)
            if len(self._arrived) > 2 * (self.packed.shuffle_buffer + self.packed.packing_buffer) + len(pieces):
                self._arrived = self._buffered(self._arrived)  # no update() for a while: forget what left
            if shuffle:
                self.documents += pieces
            else:  # in order: the next piece is the last one of the list
                self.documents[:0] = reversed(pieces)
        if not self.documents:
            return None
        if shuffle:  # swap the drawn piece with the last one
            index = int(self.rng.integers(len(self.documents)))
            self.documents[index], self.documents[-1] = self.documents[-1], self.documents[index]
        return self.documents.pop()

    def next_row(self) -> np.ndarray | None:
        """The next row `(max_seq_len,)`, or None once a finite source is exhausted."""
        return self.packer.next_row(self._pull)

    def _meta(self) -> dict:
        return {"stream": [self.stream, self.num_streams], "position": self.position, "counts": dict(self.counts),
                "keys": self.keys, "rng": self.rng.bit_generator.state, "report": asdict(self.packer.report)}

    def snapshot(self) -> dict:
        """The exact state after the last row returned: `{"meta": JSON-safe dict, "buffers": {"documents": [(key,
        tokens), ...], "packer": [...]}}` (the arrays are shared with the reader, which never changes them)."""
        return {"meta": self._meta(), "buffers": {"documents": list(self.documents), "packer": self.packer.state()}}

    def _buffered(self, pieces: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        live = {key for key, _ in self.documents} | {key for key, _ in self.packer.state()}
        return {key: tokens for key, tokens in pieces.items() if key in live}

    def update(self) -> dict:
        """What changed since the previous `update()` (or the start): `{"meta": ..., "order": {buffer: keys},
        "new": {key: tokens}}`: the keys of each buffer in `snapshot()` order and the buffered pieces that arrived
        since. Applied in turn by `StreamProgress.consume`, it rebuilds `snapshot()`."""
        order = {"documents": [key for key, _ in self.documents], "packer": [key for key, _ in self.packer.state()]}
        new = {key: self._arrived[key] for keys in order.values() for key in keys if key in self._arrived}
        self._arrived = {}
        return {"meta": self._meta(), "order": {name: np.array(keys, dtype=np.int64) for name, keys in order.items()},
                "new": new}

    def _restore(self, snapshot: dict) -> None:
        meta, buffers = snapshot["meta"], snapshot["buffers"]
        if meta["stream"] != [self.stream, self.num_streams]:
            raise ValueError(f"snapshot of stream {meta['stream']} given to stream {[self.stream, self.num_streams]}")
        self.position, self.counts, self.keys = meta["position"], {**self.counts, **meta["counts"]}, meta["keys"]
        self.rng.bit_generator.state = meta["rng"]
        self.documents = list(buffers["documents"])
        self.packer.load_state(buffers["packer"], PackingReport.from_dict(meta["report"]))


class WorkerState:
    """DataLoader worker `role`'s `StreamReader.update()` after a batch. A plain object, so that `pin_memory` leaves
    it alone."""

    def __init__(self, role: int, update: dict):
        self.role, self.update = role, update


@dataclass
class StreamBatch:
    """One batch from a stream: `input_ids` `(batch_size, max_seq_len)` and the worker's state after it."""

    input_ids: np.ndarray
    state: WorkerState


class StreamBatches(torch.utils.data.IterableDataset):
    """Batches of `batch_size` rows for process `rank` of `world_size`; in DataLoader worker `w` of `W`, the stream
    of worker role `(w + offset) % W`, resumed from `snapshots[role]` (the DataLoader starts every new iterator at
    worker 0, so after `B` consumed batches the role that is due next, `B % W`, must run in worker 0)."""

    def __init__(self, packed: PackedStream, batch_size: int, rank: int, world_size: int,
                 snapshots: dict[int, dict] | None = None, offset: int = 0):
        self.packed, self.batch_size, self.rank, self.world_size = packed, batch_size, rank, world_size
        self.snapshots, self.offset = snapshots or {}, offset

    def __iter__(self) -> Iterator[StreamBatch]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        role = (worker + self.offset) % workers
        reader = self.packed.reader(self.rank * workers + role, self.world_size * workers, self.snapshots.get(role))
        while True:
            rows = [reader.next_row() for _ in range(self.batch_size)]
            if any(row is None for row in rows):
                return
            yield StreamBatch(np.stack(rows), WorkerState(role, reader.update()))


def stream_dataloader(packed: PackedStream, batch_size: int, collate_fn, progress: "StreamProgress",
                      num_workers: int = 0, **dataloader_kwargs) -> torch.utils.data.DataLoader:
    """A plain `DataLoader` over `StreamBatches` (`batch_size=None`: the stream batches itself), resumed where
    `progress` stands; `dataloader_kwargs` go to the DataLoader (pin_memory, prefetch_factor, ...). Batches come
    from the workers in turn (`in_order`), which is what the resume offset relies on."""
    batches = StreamBatches(packed, batch_size, progress.rank, progress.world_size, progress.worker_snapshots(),
                            progress.batches % progress.workers)
    return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=collate_fn, num_workers=num_workers,
                                       in_order=True, **dataloader_kwargs)


class StreamProgress:
    """What process `rank` consumed from its stream: for each of its `workers` roles the snapshot after the last
    consumed batch (rebuilt from the workers' updates), the number of batches, and `sha256`, the chained digest of
    the consumed rows: `c_0 = sha256(b"")`, `c_b = sha256(c_{b-1} ‖ batch_b)` with `c` as 32 raw bytes and
    `batch_b` the batch's `input_ids` as int64 little-endian, rows in order. Chaining (a `hashlib` object cannot be
    saved) makes the digest of a resumed run equal that of an uninterrupted one."""

    def __init__(self, fingerprint: dict, rank: int, world_size: int, workers: int):
        self.fingerprint, self.rank, self.world_size, self.workers = fingerprint, rank, world_size, max(1, workers)
        self.batches, self.sha256 = 0, _EMPTY_SHA256
        self.latest: dict[int, dict] = {}  # role -> {"meta", "order"} of its last consumed batch
        self.pieces: dict[int, dict[int, np.ndarray]] = {}  # role -> key -> tokens of the pieces in its buffers

    def consume(self, state: WorkerState, input_ids: torch.Tensor) -> None:
        pieces = {**self.pieces.get(state.role, {}), **state.update["new"]}
        order = state.update["order"]
        self.pieces[state.role] = {int(key): pieces[int(key)] for keys in order.values() for key in keys}
        self.latest[state.role] = {"meta": state.update["meta"], "order": order}
        self.batches += 1
        rows = input_ids.detach().cpu().numpy().astype("<i8", copy=False)
        self.sha256 = hashlib.sha256(bytes.fromhex(self.sha256) + np.ascontiguousarray(rows).tobytes()).hexdigest()

    def worker_snapshots(self) -> dict[int, dict]:
        """Per role, the `StreamReader.snapshot()` after its last consumed batch."""
        return {role: {"meta": latest["meta"],
                       "buffers": {name: [(int(key), self.pieces[role][int(key)]) for key in keys]
                                   for name, keys in latest["order"].items()}}
                for role, latest in self.latest.items()}

    def summary(self) -> dict:
        """JSON-safe: batches, digest, the packing report and the document counts summed over the worker streams:
        `documents` (kept), and those left out by reason, `held_out_documents`, `duplicate_documents`,
        `missing_text_documents` (text field missing or null), `empty_text_documents` (blank text)."""
        report, counts = PackingReport(), dict.fromkeys(("documents", *SKIP_REASONS), 0)
        for latest in self.latest.values():
            report += PackingReport.from_dict(latest["meta"]["report"])
            for key in counts:
                counts[key] += latest["meta"]["counts"].get(key, 0)
        epochs = [latest["meta"]["position"]["epoch"] for latest in self.latest.values()]
        return {"rank": self.rank, "batches": self.batches, "sha256": self.sha256, "packing": report.as_dict(),
                "documents": counts["documents"], "held_out_documents": counts["held_out"],
                "duplicate_documents": counts["duplicates"], "missing_text_documents": counts["missing_text"],
                "empty_text_documents": counts["empty_text"], "completed_epochs": max(epochs, default=0)}

    def save(self, folder: str | os.PathLike) -> Path:
        """`folder/data_state_rank{rank}.safetensors` (written to a temporary file, then renamed): per role and
        buffer the pieces' keys, lengths and tokens end to end as arrays, everything else as JSON in the header."""
        arrays, snapshots = {}, {}
        for role, snapshot in self.worker_snapshots().items():
            snapshots[role] = snapshot["meta"]
            for name, documents in snapshot["buffers"].items():
                tokens, lengths = concatenate_documents([tokens for _, tokens in documents])
                arrays |= {f"role{role}.{name}.tokens": tokens, f"role{role}.{name}.lengths": lengths,
                           f"role{role}.{name}.keys": np.array([key for key, _ in documents], dtype=np.int64)}
        meta = {"fingerprint": self.fingerprint, "world_size": self.world_size, "workers": self.workers,
                "batches": self.batches, "sha256": self.sha256, "snapshots": snapshots}
        path = Path(folder) / STATE_FILE.format(rank=self.rank)
        with atomic_path(path) as temporary:
            save_file(arrays, temporary, metadata={"hfl3_stream_progress": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike, fingerprint: dict, rank: int, world_size: int,
             workers: int) -> "StreamProgress":
        """The progress saved in checkpoint `folder` for process `rank`.

        Raises:
            FileNotFoundError: the checkpoint has no data state for this rank.
            ValueError: it was written by another stream (fingerprint), world size or number of DataLoader workers.
        """
        path = Path(folder) / STATE_FILE.format(rank=rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {folder} has no data stream state for rank {rank} (saved "
                                    "by another version, or interrupted while saving); resume from another checkpoint")
        progress = cls(fingerprint, rank, world_size, workers)
        with safe_open(path, "np") as f:
            meta = json.loads(f.metadata()["hfl3_stream_progress"])
        if meta["fingerprint"] != fingerprint:
            changed = sorted(k for k in fingerprint if meta["fingerprint"].get(k) != fingerprint[k])
            raise ValueError(f"{folder} was trained on another data stream (differs in: {', '.join(changed)}); "
                             "resume with the data, tokenizer and packing arguments it was started with")
        if (meta["world_size"], meta["workers"]) != (world_size, progress.workers):
            raise ValueError(f"{folder} was written by {meta['world_size']} process(es) with "
                             f"{meta['workers']} stream(s) each (--dataloader_num_workers, at least 1); now "
                             f"{world_size} and {progress.workers}: resume with the same numbers")
        arrays = load_file(path)
        progress.batches, progress.sha256 = meta["batches"], meta["sha256"]
        for role, snapshot_meta in meta["snapshots"].items():
            order, pieces = {}, {}
            for name in ("documents", "packer"):
                keys = arrays[f"role{role}.{name}.keys"]
                tokens = split_concatenated(arrays[f"role{role}.{name}.tokens"], arrays[f"role{role}.{name}.lengths"])
                order[name] = keys
                pieces |= dict(zip(keys.tolist(), tokens))
            progress.latest[int(role)] = {"meta": snapshot_meta, "order": order}
            progress.pieces[int(role)] = pieces
        return progress
