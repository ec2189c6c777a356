"""Chat JSONL files: read and validate them (`read_chat_jsonl`), with the reason and `file:line` of every bad record
(`InvalidChatRecord`) and counts of what was read, skipped and kept (`ChatDataStats`); and write them
(`write_chat_jsonl`).

Input: one JSON object per line, `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`
(other top-level keys such as `id` are ignored). Every line is validated; a bad line stops the run with
`file:line: reason` or, with `skip_invalid_records=True`, is skipped and counted (`ChatDataStats`). A UTF-8 byte
order mark at the start of a line is dropped (files concatenated from BOM-prefixed ones have one on several lines).
Records with the same messages as an earlier one are dropped and counted (`messages_sha256`,
`hfl3.data.masks.encode_records`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hfl3.atomic import atomic_path

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = frozenset({"role", "content"})
MAX_LOGGED_ERRORS = 10
BOM = b"\xef\xbb\xbf"


class InvalidChatRecord(ValueError):
    """A chat record that cannot be trained on. `str(error)` is `"{where}: {reason}"`; `kind` is `"malformed"`,
    `"no_assistant"` or `"duplicates"` (the `ChatDataStats` counter a skipped record goes to)."""

    def __init__(self, where: str, reason: str, kind: str = "malformed"):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.kind = where, reason, kind


@dataclass
class ChatDataStats:
    """Counts of one data file (or one list of records) through reading, masking and truncation.

    Fields:
        read: non-blank lines (records) seen.
        malformed: records skipped as invalid (bad JSON or UTF-8, bad structure, template refusal, ...).
        no_assistant: records skipped because no message has role `assistant`.
        duplicates: records dropped because their messages equal those of an earlier kept record (in the same file,
            or, for an evaluation file, in the training file; `hfl3.data.masks.encode_records`).
        dropped_after_truncation: records whose supervised tokens all fell beyond `max_length`.
        kept: records that became training rows;
            `read = malformed + no_assistant + duplicates + dropped_after_truncation + kept`.
        truncated: kept rows that were cut to `max_length`.
        tokens: tokens in the kept rows (after truncation).
        supervised_tokens: tokens with a label in the kept rows (`labels != -100`).
        first_errors: the first `MAX_LOGGED_ERRORS` skip reasons, as `file:line: reason`.
    """

    read: int = 0
    malformed: int = 0
    no_assistant: int = 0
    duplicates: int = 0
    dropped_after_truncation: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    first_errors: list[str] = field(default_factory=list)

    def count_skip(self, error: InvalidChatRecord) -> None:
        """Count a skipped record under `error.kind` and remember its reason (first few only)."""
        setattr(self, error.kind, getattr(self, error.kind) + 1)
        if len(self.first_errors) < MAX_LOGGED_ERRORS:
            self.first_errors.append(str(error))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ChatRecord:
    """A validated conversation: `messages` holds only `role` and `content`; `where` is `file:line`."""

    where: str
    messages: tuple[dict, ...]


def validate_messages(obj: object, where: str) -> tuple[dict, ...]:
    """Check one decoded JSON record and return its messages as `{"role", "content"}` dicts.

    Raises:
        InvalidChatRecord: naming `where` and the fix, for a record that is not an object, has no `messages` list,
            a message that is not an object, has unsupported keys, an unknown role, non-string or blank content;
            `kind="no_assistant"` when no message is from the assistant; when the first message after the optional
            system prompt is not the user's (chat templates and the masks expect a reply to follow a user turn);
            and when the conversation does not end with an assistant message (trailing turns would never be
            trained on).
    """
    if not isinstance(obj, dict):
        raise InvalidChatRecord(where, f"expected a JSON object with a 'messages' list, got {type(obj).__name__}")
    messages = obj.get("messages")
    if messages is None:
        raise InvalidChatRecord(where, f"no 'messages' field (keys: {sorted(obj)}); expected {{\"messages\": [...]}}")
    if not isinstance(messages, list) or not messages:
        raise InvalidChatRecord(where, "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    clean = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidChatRecord(where, f"message {index} is a {type(message).__name__}; expected an object")
        extra = set(message) - MESSAGE_KEYS
        if extra:
            raise InvalidChatRecord(
                where, f"message {index} has unsupported keys {sorted(extra)}; only 'role' and 'content' are used"
            )
        role = message.get("role")
        if role not in ROLES:
            raise InvalidChatRecord(where, f"message {index} has role {role!r}; expected one of {'/'.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidChatRecord(
                where, f"message {index} content is {type(content).__name__}; expected a string"
            )
        if not content.strip():
            raise InvalidChatRecord(where, f"message {index} ({role}) has empty content")
        clean.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in clean):
        raise InvalidChatRecord(where, "no assistant message; nothing to train on", kind="no_assistant")
    opening = next(i for i, m in enumerate(clean) if m["role"] != "system")
    if clean[opening]["role"] != "user":
        raise InvalidChatRecord(
            where,
            f"message {opening} is from the {clean[opening]['role']}, but a conversation starts with a user message "
            "(after an optional system message): add the user turn it answers, or fold it into the system prompt",
        )
    if clean[-1]["role"] != "assistant":
        raise InvalidChatRecord(
            where,
            f"conversation ends with a {clean[-1]['role']!r} message; the last message must be the assistant's "
            "reply (drop the trailing turns)",
        )
    return tuple(clean)


def read_chat_jsonl(
    path: str | os.PathLike, *, skip_invalid_records: bool = False, stats: ChatDataStats | None = None
) -> list[ChatRecord]:
    """Read and validate a chat JSONL file. Blank lines are ignored; a UTF-8 BOM starting a line is dropped.

    Args:
        path: the file.
        skip_invalid_records: skip and count bad lines instead of raising.
        stats: counters to update (`read`, `malformed`, `no_assistant`, `first_errors`).

    Raises:
        InvalidChatRecord: `file:line: reason` for the first bad line (non-UTF-8 bytes, malformed JSON, or any
            `validate_messages` failure), unless `skip_invalid_records`.
    """
    stats = stats if stats is not None else ChatDataStats()
    records = []
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw.strip():
                continue
            stats.read += 1
            where = f"{path}:{line_number}"
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise InvalidChatRecord(
                        where, f"not valid UTF-8 ({error.reason} at byte {error.start}); re-encode the file as UTF-8"
                    ) from None
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as error:
                    raise InvalidChatRecord(where, f"malformed JSON ({error.msg} at column {error.colno})") from None
                records.append(ChatRecord(where, validate_messages(obj, where)))
            except InvalidChatRecord as error:
                if not skip_invalid_records:
                    raise
                stats.count_skip(error)
    return records


def messages_sha256(messages) -> bytes:
    """32-byte digest of a conversation's messages (roles and contents, exactly): records with equal digests are
    duplicates (`ChatDataStats.duplicates`)."""
    return hashlib.sha256(json.dumps(list(messages), ensure_ascii=False).encode("utf-8")).digest()


def write_chat_jsonl(chats: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write chats as JSONL (UTF-8, one object per line) atomically; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
    return path
