"""What an output holds of this machine: nothing. `portable` removes credentials and absolute local paths from anything
written into an output folder (docs/design.md, decision 10); `is_secret` says which fields hold credentials, and
`redact` takes them out of a message (every line hfl3 prints that quotes a flag's value goes through it)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REDACTED = "<redacted>"
_SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
                           "apikey"})
# Fields named like a token that hold a vocabulary token's text, not a credential
VOCABULARY_TOKEN_FIELDS = frozenset({"bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token",
                                     "mask_token"})
_SHORTEST_SECRET = 6  # a shorter value is not searched for in free text (it would blank out common words)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;:()\[\]{}<>|*]+")


def is_secret(name: str) -> bool:
    """Whether the field or key `name` holds a credential: its last word is `token` (`hub_token`, `token`,
    `push_to_hub_token`, `use_auth_token`), or a word of it is `secret`, `password`, `credentials`, `apikey` ... or
    it holds `api_key`; not a field of `VOCABULARY_TOKEN_FIELDS` (`eos_token`: a vocabulary token's text), and not a
    count or name of tokens (`max_new_tokens`, `tokenizer_name_or_path`, `bos_token_id`)."""
    lowered = str(name).lower()
    words = re.split(r"[^a-z0-9]+", lowered)
    if lowered in VOCABULARY_TOKEN_FIELDS:
        return False
    return words[-1] == "token" or "api_key" in lowered or any(word in _SECRET_WORDS for word in words)


def redact(text: str, secrets=()) -> str:
    """`text` with every value of `secrets` (the values of secret fields, `is_secret`; those of 6 characters or more)
    and every Hugging Face token (`hf_...`) replaced by `<redacted>`."""
    for secret in sorted({str(s) for s in secrets if s and len(str(s)) >= _SHORTEST_SECRET}, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return _HF_TOKEN.sub(REDACTED, text)


def _local_path_free(text: str) -> str:
    def relative(match: re.Match) -> str:
        path = match.group(0)
        top = path.split("/")[1]
        if not top or not os.path.isdir("/" + top):
            return path  # not a path of this machine (e.g. a Hub URL fragment or prose)
        cwd = Path.cwd().resolve()
        try:
            if cwd == Path(cwd.anchor):  # every path is inside the root: its relative form is the whole path
                raise ValueError
            inside = Path(path).resolve().relative_to(cwd)
        except ValueError:
            return Path(path.rstrip("/")).name or path
        return str(inside)

    return redact(_ABSOLUTE_PATH.sub(relative, text))


def portable(obj: Any) -> Any:
    """`obj` (JSON-like: dicts, lists, strings, numbers) with nothing of this machine in it, for anything written
    into an output folder:

    - keys that hold credentials (`is_secret`: `hub_token`, ...) are dropped, and `hf_...` token strings become
      `<redacted>`;
    - absolute paths whose top folder exists here (`/home/...`, `/tmp/...`) become relative to the working
      directory when inside it (`outputs/demo`; not when it is `/`, where that would be the whole path without its
      `/`), else their last component (`pytest-3/out` → `out`), in keys, values and inside longer strings.
    """
    if isinstance(obj, Mapping):
        return {_local_path_free(str(k)): portable(v) for k, v in obj.items() if not is_secret(k)}
    if isinstance(obj, (list, tuple)):
        return [portable(v) for v in obj]
    if isinstance(obj, str):
        return _local_path_free(obj)
    return obj
