"""Provenance in the `__metadata__` header of `.safetensors` files, so the weights carry it even when copied alone.

transformers 5.23's `save_pretrained` and PEFT 0.21's write every weight file with the fixed header `{"format": "pt"}`
and take no metadata, so the header is completed right after the save, while the folder is still staged
(`add_safetensors_metadata`). Growing a header in place would move every tensor byte; on Linux file systems with
`FALLOC_FL_INSERT_RANGE` (ext4, XFS) whole blocks are inserted before the tensors instead, which remaps them without
reading or writing them. Elsewhere (tmpfs, NFS, Lustre, btrfs, macOS) the file is rewritten once beside the old one,
as before (dev/LOG.md 2026-11-24: 1 GB checkpoint, copy against insert).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hfl3.atomic import atomic_path

logger = logging.getLogger(__name__)

_FALLOC_FL_INSERT_RANGE = 0x20  # <linux/falloc.h>; ext4 and XFS, Linux >= 3.15
_MAX_HEADER_BYTES = 100_000_000  # the safetensors reader's own limit
_ARGUMENT_SECTIONS = ("training_args", "script_args", "model_args")


def find_hashes(obj: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    """`(dotted.key, value)` for every string value under a key containing `sha256` in the nested dict `obj`."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if "sha256" in str(key) and isinstance(value, str):
                yield name, value
            else:
                yield from find_hashes(value, name)


def provenance_header(metadata: Mapping[str, Any], max_section_bytes: int = 16384) -> dict[str, str]:
    """The `.safetensors` header entries: every top-level section of `metadata` as a JSON string under
    `hfl3.<section>`, except the argument sections (in `metadata.json` only); a section longer than
    `max_section_bytes` as JSON (a corpus of thousands of files, a long `lineage`) keeps only its `*sha256*` entries
    (a list's under its items' positions: `0.metadata_sha256`)."""
    header = {}
    for key, value in metadata.items():
        if key in _ARGUMENT_SECTIONS:
            continue
        text = json.dumps(value, sort_keys=True)
        if len(text) > max_section_bytes:
            items = {str(i): item for i, item in enumerate(value)} if isinstance(value, list) else value
            text = json.dumps(dict(find_hashes(items)), sort_keys=True)
        header[f"hfl3.{key}"] = text
    return header


def add_safetensors_metadata(file: str | os.PathLike, metadata: Mapping[str, str], in_place: bool = True) -> Path:
    """Merge `metadata` into the `__metadata__` header of a `.safetensors` file without rewriting its tensors.

    The format (https://github.com/huggingface/safetensors#format) is an 8-byte little-endian header length N, N
    bytes of JSON header (padded with spaces), then the tensor data, whose offsets are relative to the end of the
    header. Existing keys (e.g. `format: pt`) stay unless `metadata` sets them. With `in_place` the new header goes
    where the old one was when it fits, else whole file-system blocks are inserted before the tensors (module
    docstring); a kill in between leaves the file damaged, so use it on folders that are not published yet (hfl3
    stamps only staged folders, which a kill leaves uncommitted). Otherwise, or where the file system cannot insert,
    a new file with the header padded to a multiple of 8 bytes (as the safetensors writer pads it) replaces the old
    one atomically, copying the tensor bytes once.

    Raises:
        TypeError: if a key or value of `metadata` is not a `str` (the format allows only strings).
        ValueError: if `file` is not a valid safetensors file.
    """
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"safetensors metadata must map str to str; got {key!r}: {type(value).__name__} "
                            "(json.dumps non-string values first)")
    file = Path(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file}: too short to be a safetensors file")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > _MAX_HEADER_BYTES:
            raise ValueError(f"{file}: header size {header_size} is implausible; not a safetensors file")
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{file}: header is not JSON ({error}); not a safetensors file") from error
    header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
    new_header = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if in_place and _write_header_in_place(file, new_header, header_size):
        return file
    new_header += b" " * (-len(new_header) % 8)
    with open(file, "rb") as f, atomic_path(file) as tmp, open(tmp, "wb") as out:
        f.seek(8 + header_size)
        out.write(struct.pack("<Q", len(new_header)))
        out.write(new_header)
        while chunk := f.read(1 << 24):
            out.write(chunk)
    logger.debug("%s: header rewritten with a copy of the tensor bytes", file)
    return file


def _write_header_in_place(file: Path, new_header: bytes, header_size: int) -> bool:
    """Write `new_header` as the header of `file` without moving its tensor bytes: over the old one when it fits,
    after inserting whole blocks at the start of the file when the file system can. False when it cannot (nothing
    written)."""
    fd = os.open(file, os.O_RDWR)
    try:
        if len(new_header) > header_size:
            grow = _insert_blocks_at_start(fd, len(new_header) - header_size)
            if not grow:
                return False
            header_size += grow
        os.pwrite(fd, struct.pack("<Q", header_size) + new_header.ljust(header_size, b" "), 0)
        return True
    finally:
        os.close(fd)


def _insert_blocks_at_start(fd: int, at_least: int) -> int:
    """Insert the fewest whole file-system blocks holding `at_least` bytes at offset 0 of `fd` (`fallocate` with
    `FALLOC_FL_INSERT_RANGE`: the existing bytes are remapped, not copied). Returns the bytes inserted, 0 where the
    platform or file system cannot."""
    if not sys.platform.startswith("linux"):
        return 0
    fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate64", None)
    if fallocate is None:
        return 0
    fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    block = os.fstatvfs(fd).f_frsize or 4096
    grow = -(-at_least // block) * block
    return grow if fallocate(fd, _FALLOC_FL_INSERT_RANGE, 0, grow) == 0 else 0
