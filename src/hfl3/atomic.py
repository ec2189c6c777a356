"""Atomic writes: a reader sees the old file or the complete new one, never part of one (docs/design.md, decision 13).

- `atomic_path`: the one atomic-write helper of hfl3 (a temporary file in the same folder, then `os.replace`), used by
  every writer: JSON, model cards, plots, chat JSONL, data-stream states, safetensors headers that cannot be grown in
  place.
- `write_json_atomic`: indented JSON through it, any value made JSON-safe first (`to_json_safe`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_path(path) as tmp:` write the file `tmp` (a fresh name in `path`'s folder, which is created);
    when the block ends without an exception `tmp` replaces `path` in one `os.replace`, so a reader sees the old
    file or the complete new one, never part of it (a kill leaves at most a `.NAME.*.tmp` file behind). On an
    exception `tmp` is deleted. The result gets the mode a plain `open()` would give (mkstemp's files are 0o600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    # Paths, torch.dtype, devices and other values whose str() is their identity
    return str(value)


def to_json_safe(obj: Any) -> Any:
    """`obj` with dataclasses turned into dicts, enums into their values, sets into sorted lists and any other
    non-JSON value (Path, torch.dtype, ...) into its `str`; the result survives `json.dumps` unchanged."""
    return json.loads(json.dumps(obj, default=_json_default))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON (UTF-8, `ensure_ascii=False`) to `path` through `atomic_path`. Values that JSON
    cannot hold are converted as in `to_json_safe`.

    Returns:
        The path written.
    """
    path = Path(path)
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path
