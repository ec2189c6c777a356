"""What an output holds of this machine: nothing. `portable` removes credentials and absolute local paths from anything
written into an output folder (docs/design.md, decision 10)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Keys whose values are credentials: dropped from everything written
SECRET_KEYS = frozenset({"hub_token", "token", "push_to_hub_token", "api_key", "password", "secret"})
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;:()\[\]{}<>|*]+")


def _local_path_free(text: str) -> str:
    def relative(match: re.Match) -> str:
        path = match.group(0)
        top = path.split("/")[1]
        if not top or not os.path.isdir("/" + top):
            return path  # not a path of this machine (e.g. a Hub URL fragment or prose)
        try:
            inside = Path(path).resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            return Path(path.rstrip("/")).name or path
        return str(inside)

    return _HF_TOKEN.sub("<redacted>", _ABSOLUTE_PATH.sub(relative, text))


def portable(obj: Any) -> Any:
    """`obj` (JSON-like: dicts, lists, strings, numbers) with nothing of this machine in it, for anything written
    into an output folder:

    - keys in `SECRET_KEYS` (`hub_token`, ...) are dropped, and `hf_...` token strings become `<redacted>`;
    - absolute paths whose top folder exists here (`/home/...`, `/tmp/...`) become relative to the working
      directory when inside it (`outputs/demo`), else their last component (`pytest-3/out` → `out`), in keys,
      values and inside longer strings.
    """
    if isinstance(obj, Mapping):
        return {_local_path_free(str(k)): portable(v) for k, v in obj.items() if str(k) not in SECRET_KEYS}
    if isinstance(obj, (list, tuple)):
        return [portable(v) for v in obj]
    if isinstance(obj, str):
        return _local_path_free(obj)
    return obj
