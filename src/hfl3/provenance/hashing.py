"""Hashes of what a run was trained on: ordered records (`sha256_records`), files (`sha256_file`, one pass that other
checks can ride along) and model configs (`config_sha256`)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence


def canonical_json(record: Mapping | Sequence) -> str:
    """The JSON text `sha256_records` hashes for a dict or list: sorted keys, separators `(",", ":")`, no ASCII
    escaping. Hashing this string gives the same digest as hashing `record`."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _record_bytes(record: str | bytes | Mapping | Sequence) -> bytes:
    if isinstance(record, bytes):
        return record
    if isinstance(record, str):
        return record.encode("utf-8")
    if isinstance(record, (Mapping, list, tuple)):
        return canonical_json(record).encode("utf-8")
    raise TypeError(f"cannot hash a record of type {type(record).__name__}; expected str, bytes, dict or list")


def sha256_records(records: Iterable[str | bytes | Mapping | Sequence]) -> str:
    """SHA-256 over an ordered stream of records, as a hex string.

    Each record becomes bytes (str: UTF-8; bytes: as is; dict/list: canonical JSON with sorted keys, separators
    `(",", ":")` and `ensure_ascii=False`, UTF-8) and is fed to the hash as an 8-byte little-endian length followed by
    those bytes, so record boundaries count: `["ab", "c"]` and `["a", "bc"]` hash differently, and so does a
    reordering. The empty stream hashes to the SHA-256 of nothing.

    Raises:
        TypeError: for a record of any other type.
    """
    digest = hashlib.sha256()
    for record in records:
        data = _record_bytes(record)
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20,
                on_chunk: Callable[[bytes], None] | None = None) -> str:
    """SHA-256 of a file's bytes as a hex string (the value `sha256sum FILE` prints), read once in blocks of
    `chunk_bytes`. `on_chunk`, when given, sees every block in order as it is hashed, so a check that needs the
    bytes too (`hfl3.data.sft_sources.open_jsonl`: the line starts of its shards) costs no second read.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
    return digest.hexdigest()


def config_sha256(config) -> str:
    """SHA-256 of a model config's canonical JSON (`sha256_records([config.to_dict()])`), without the fields that
    name where or with what it was saved (`_name_or_path`, `transformers_version`)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return sha256_records([values])
