"""Chat records in every format hfl3 trains on, each validated and normalized on its own (`normalize_record`), with the
reason and place (`file:line`, or a dataset's row) of every bad record (`InvalidChatRecord`) and counts of what was
read, skipped and kept (`ChatDataStats`); JSONL files (plain or gzip-compressed) read line by line (`iter_jsonl`,
`read_chat_jsonl`) and written (`write_chat_jsonl`); a conversation cut into one sample per reasoning turn
(`split_reasoning_turns`).

Formats, one record each, with TRL's field names:
- conversational: `{"messages": [...]}`; ShareGPT's `{"conversations": [{"from": ..., "value": ...}]}` is mapped to
  it with axolotl's default role names (`human` → `user`, `gpt` → `assistant`) and counted
  (`ChatDataStats.sharegpt`);
- prompt–completion with message lists, `{"prompt": [...], "completion": [...]}`: one conversation whose prompt is
  context only (`ChatRecord.context`), unless `completion_only_loss=False` (TRL's flag: then it is one conversation);
- prompt–completion with strings, `{"prompt": "...", "completion": "..."}`: plain text as TRL tokenizes it, without a
  chat template, the tokenizer's EOS token appended (`TextRecord`), the loss on the completion (on the whole text
  with `completion_only_loss=False`);
- language modeling, `{"text": "..."}` (TRL's `dataset_text_field` names the key): plain text, EOS appended unless it
  ends with it, the loss on every token (`TextRecord` with no prompt);
- any chat format with `tools`: a list of JSON-schema tool definitions, or a JSON string of one (as Hub datasets
  store it: Arrow holds one type per column), passed to the chat template.

Messages: `role` is `system`, `developer`, `user`, `assistant` or `tool`; `content` a string. An assistant message may
carry `tool_calls` (OpenAI's shape: `[{"type": "function", "id": ..., "function": {"name": ..., "arguments": ...}}]`,
`arguments` an object or a JSON string of one, which is parsed so that every template renders an object) with
`content` empty or null, `reasoning_content` (a string) and `training: false` (axolotl's name: the turn stays in the
context but out of the loss). A tool message answers the tool calls before it and may carry `tool_call_id` and `name`.
A key whose value is null counts as absent (Arrow gives every row of a struct column every key). A conversation opens
with a user message (after optional system/developer messages) and ends with an assistant message.

Other top-level keys (`id`, `source`, ...) are ignored. A UTF-8 byte order mark at the start of a line is dropped (files
concatenated from BOM-prefixed ones have one on several lines). A key given twice in one JSON object makes the line
invalid (`json` would keep the last value silently).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hfl3.atomic import atomic_path
from hfl3.errors import InputError

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "training")
# axolotl's default role names for ShareGPT data (its `roles` of the chat_template dataset type); TRL's
# `maybe_convert_to_chatml` renames the keys only
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
TOOL_CALL_KEYS = ("type", "id", "function")
MAX_LOGGED_ERRORS = 10
BOM = b"\xef\xbb\xbf"
GZIP_MAGIC = b"\x1f\x8b"


class InvalidChatRecord(InputError):
    """A chat record that cannot be trained on. `str(error)` is `"{where}: {reason}"`; `kind` is `"malformed"`,
    `"no_assistant"` or `"duplicates"` (the `ChatDataStats` counter a skipped record goes to). Picklable, so that
    worker processes can hand it back."""

    def __init__(self, where: str, reason: str, kind: str = "malformed"):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.kind = where, reason, kind

    def __reduce__(self):
        return type(self), (self.where, self.reason, self.kind)


class SFTDataError(InputError):
    """The data as a whole cannot be trained on (no usable record left): one line naming the source and its counts."""


@dataclass
class ChatDataStats:
    """Counts of one data source (a file or a dataset split) through reading, masking and truncation.

    Fields:
        read: records seen (non-blank lines of a file, rows of a dataset).
        malformed: records skipped as invalid (bad JSON or UTF-8, bad structure, what the chat template refuses or
            cannot render, ...).
        no_assistant: records skipped because no assistant message is left to train on.
        duplicates: records dropped because they equal an earlier kept record (in the same source, or, for
            evaluation data, in the training data).
        dropped_after_truncation: records whose supervised tokens all fell beyond `max_length`.
        kept: rows kept for training, one per record (or per sample, with `split_reasoning_turns`);
            `read + reasoning_samples - reasoning_expanded = malformed + no_assistant + duplicates +
            dropped_after_truncation + kept` (duplicates and truncation count samples).
        truncated: kept rows that were cut to `max_length`.
        tokens: tokens in the kept rows (after truncation).
        supervised_tokens: tokens with a label in the kept rows (`labels != -100`, position 0 aside).
        sharegpt: kept records mapped from ShareGPT's `conversations` / `from` / `value`.
        reasoning_not_rendered: trained assistant messages of kept rows whose `reasoning_content` the chat template
            did not render (its history rules, or no support): not trained on.
        reasoning_expanded: valid records cut into several samples, one per reasoning turn (`split_reasoning_turns`).
        reasoning_samples: the samples those records gave.
        first_errors: the first `MAX_LOGGED_ERRORS` skip reasons, as `where: reason`.
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
    sharegpt: int = 0
    reasoning_not_rendered: int = 0
    reasoning_expanded: int = 0
    reasoning_samples: int = 0
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
    """A validated conversation: `messages` (dicts with the keys of `MESSAGE_KEYS` that are set; `training` only where
    false), `tools` (JSON-schema dicts, or None), `where` (`file:line` or a dataset's row), `sharegpt` (mapped from
    ShareGPT), `context` (the first `context` messages are context only, never trained: a prompt–completion record's
    prompt, or the earlier turns of a `split_reasoning_turns` sample)."""

    where: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    sharegpt: bool = False
    context: int = 0

    def canonical(self) -> list | dict:
        """What provenance hashes and duplicates compare: the messages, with the context messages apart and the tools
        when there are some (a plain conversation without tools is its list of messages)."""
        if not self.context and not self.tools:
            return list(self.messages)
        canonical = {"messages": list(self.messages[self.context :])}
        if self.context:
            canonical["context"] = list(self.messages[: self.context])
        if self.tools:
            canonical["tools"] = list(self.tools)
        return canonical


@dataclass(frozen=True)
class TextRecord:
    """A plain-text record (no chat template): prompt–completion, the loss on `completion` and the EOS token; or
    language modeling (`prompt` None: `completion` is the whole text), the loss on every token."""

    where: str
    prompt: str | None
    completion: str

    def canonical(self) -> dict:
        if self.prompt is None:
            return {"text": self.completion}
        return {"prompt": self.prompt, "completion": self.completion}


def normalize_record(obj: object, where: str, *, completion_only_loss: bool | None = None,
                     dataset_text_field: str = "text") -> ChatRecord | TextRecord:
    """Validate one decoded record in any supported format (module docstring) and normalize it.

    Args:
        completion_only_loss: TRL's flag for prompt–completion records: None or True keeps the prompt out of the loss
            (`ChatRecord.context`, or the `TextRecord` prompt); False trains them as one conversation (a plain text).
        dataset_text_field: the key of a language-modeling record's text (TRL's `dataset_text_field`).

    Raises:
        InvalidChatRecord: naming `where`, the message and the fix, for a record that is not an object or has none of
            the formats' fields (or has them null); a message that is not an object, has unsupported keys, an unknown
            role, non-string or blank content, misplaced or malformed `tool_calls` / `reasoning_content` /
            `tool_call_id` / `name` / `training`; `tools` that are not a list of objects (or its JSON);
            `kind="no_assistant"` when no assistant message is trained on; a conversation that does not open with the
            user (after system/developer messages) or does not end with an assistant message, or a tool message that
            answers no tool call; a text that is not a string or is blank.
    """
    if not isinstance(obj, dict):
        raise InvalidChatRecord(where, f"expected a JSON object with a 'messages' list, got {type(obj).__name__}")
    tools = _tools(obj.get("tools"), where)
    if obj.get("messages") is not None:
        return ChatRecord(where, _conversation(obj["messages"], where), tools)
    if obj.get("conversations") is not None:
        return ChatRecord(where, _conversation(_from_sharegpt(obj["conversations"], where), where), tools, True)
    prompt, completion = obj.get("prompt"), obj.get("completion")
    if prompt is not None and completion is not None:
        if isinstance(prompt, str) and isinstance(completion, str):
            if tools:
                raise InvalidChatRecord(where, "'tools' need a conversation; plain-text prompt/completion has none")
            for name, text in (("prompt", prompt), ("completion", completion)):
                if not text.strip():
                    raise InvalidChatRecord(where, f"'{name}' is empty")
            return TextRecord(where, None, prompt + completion) if completion_only_loss is False else \
                TextRecord(where, prompt, completion)
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, list) or not value:
                raise InvalidChatRecord(where, f"'{name}' is a {type(value).__name__}; expected prompt and completion "
                                               "both strings, or both non-empty lists of messages")
        messages = _conversation(prompt + completion, where, completion_from=len(prompt))
        return ChatRecord(where, messages, tools, context=0 if completion_only_loss is False else len(prompt))
    text = obj.get(dataset_text_field)
    if text is not None:
        if not isinstance(text, str):
            raise InvalidChatRecord(where, f"'{dataset_text_field}' is a {type(text).__name__}; expected a string")
        if tools:
            raise InvalidChatRecord(where, f"'tools' need a conversation; plain '{dataset_text_field}' has none")
        if not text.strip():
            raise InvalidChatRecord(where, f"'{dataset_text_field}' is empty")
        return TextRecord(where, None, text)
    expected = ("expected {\"messages\": [...]}, ShareGPT's {\"conversations\": [...]}, {\"prompt\": ..., "
                f"\"completion\": ...}}, or {{\"{dataset_text_field}\": \"...\"}} (dataset_text_field)")
    nulls = [key for key in ("messages", "conversations", "prompt", "completion", dataset_text_field)
             if key in obj and obj[key] is None]
    if nulls:
        raise InvalidChatRecord(where, f"{', '.join(repr(key) for key in nulls)} {'is' if len(nulls) == 1 else 'are'} "
                                       f"null; {expected}")
    raise InvalidChatRecord(where, f"no 'messages' field (keys: {sorted(obj)}); {expected}")


def _tools(tools, where: str) -> tuple[dict, ...] | None:
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise InvalidChatRecord(where, f"'tools' is a string but not JSON ({error.msg} at column {error.colno})"
                                    ) from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidChatRecord(where, "'tools' must be a list of JSON-schema objects (or a JSON string of one)")
    return tuple(tools)


def _from_sharegpt(conversations, where: str) -> list:
    if not isinstance(conversations, list) or not conversations:
        raise InvalidChatRecord(where, "'conversations' must be a non-empty list of {\"from\", \"value\"} objects")
    messages = []
    for index, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            raise InvalidChatRecord(where, f"message {index} is a {type(turn).__name__}; expected an object")
        message = {key: value for key, value in turn.items() if key not in ("from", "value")}
        if turn.get("from") is not None:
            message["role"] = SHAREGPT_ROLES.get(turn["from"], turn["from"])
        if turn.get("value") is not None:
            message["content"] = turn["value"]
        messages.append(message)
    return messages


def _conversation(messages, where: str, completion_from: int = 0) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidChatRecord(where, "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    clean = [_message(message, index, where) for index, message in enumerate(messages)]
    roles = [m["role"] for m in clean]
    if not any(m["role"] == "assistant" and m.get("training", True) for m in clean[completion_from:]):
        reason = "no assistant message; nothing to train on" if "assistant" not in roles[completion_from:] else \
            "every assistant message has training: false; nothing to train on"
        raise InvalidChatRecord(where, reason, kind="no_assistant")
    opening = next(i for i, role in enumerate(roles) if role not in ("system", "developer"))
    if roles[opening] != "user":
        raise InvalidChatRecord(
            where,
            f"message {opening} is from the {roles[opening]}, but a conversation starts with a user message "
            "(after optional system messages): add the user turn it answers, or fold it into the system prompt",
        )
    if roles[-1] != "assistant":
        raise InvalidChatRecord(
            where,
            f"conversation ends with a {roles[-1]!r} message; the last message must be the assistant's "
            "reply (drop the trailing turns)",
        )
    for index, role in enumerate(roles):
        if role == "tool" and not (roles[index - 1] == "tool" or clean[index - 1].get("tool_calls")):
            raise InvalidChatRecord(where, f"message {index} is a tool result, but message {index - 1} is neither an "
                                           "assistant message with tool_calls nor another tool result")
    return tuple(clean)


def _message(message, index: int, where: str) -> dict:
    if not isinstance(message, dict):
        raise InvalidChatRecord(where, f"message {index} is a {type(message).__name__}; expected an object")
    message = {key: value for key, value in message.items() if value is not None}
    extra = set(message) - set(MESSAGE_KEYS)
    if extra:
        raise InvalidChatRecord(where, f"message {index} has unsupported keys {sorted(extra)}; expected "
                                       f"{', '.join(MESSAGE_KEYS)}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidChatRecord(where, f"message {index} has role {role!r}; expected one of {'/'.join(ROLES)}")
    for key, roles in (("reasoning_content", ("assistant",)), ("tool_calls", ("assistant",)),
                       ("training", ("assistant",)), ("tool_call_id", ("tool",)), ("name", ("tool",))):
        if key in message and role not in roles:
            raise InvalidChatRecord(where, f"message {index} ({role}) has '{key}', which only {roles[0]} messages "
                                           "carry")
    if "tool_calls" in message:
        message["tool_calls"] = _tool_calls(message["tool_calls"], index, where)
        message.setdefault("content", "")
    content = message.get("content")
    if not isinstance(content, str):
        raise InvalidChatRecord(where, f"message {index} content is {type(content).__name__}; expected a string")
    if not content.strip() and "tool_calls" not in message:
        raise InvalidChatRecord(where, f"message {index} ({role}) has empty content")
    for key in ("reasoning_content", "tool_call_id", "name"):
        if key in message and not isinstance(message[key], str):
            raise InvalidChatRecord(where, f"message {index} {key} is {type(message[key]).__name__}; expected a "
                                           "string")
    if "training" in message:
        if not isinstance(message["training"], bool):
            raise InvalidChatRecord(where, f"message {index} training is {message['training']!r}; expected true or "
                                           "false")
        if message["training"]:
            del message["training"]  # the default: only `false` is kept
    return {key: message[key] for key in MESSAGE_KEYS if key in message}


def _tool_calls(calls, index: int, where: str) -> list[dict]:
    if not isinstance(calls, list) or not calls:
        raise InvalidChatRecord(where, f"message {index} tool_calls must be a non-empty list")
    clean = []
    for number, call in enumerate(calls):
        place = f"message {index} tool_calls[{number}]"
        if not isinstance(call, dict):
            raise InvalidChatRecord(where, f"{place} is a {type(call).__name__}; expected an object")
        call = {key: value for key, value in call.items() if value is not None}
        function = call.get("function")
        if set(call) - set(TOOL_CALL_KEYS) or not isinstance(function, dict) or call.get("type", "function") != \
                "function":
            raise InvalidChatRecord(where, f"{place} has keys {sorted(call)}; expected OpenAI's shape "
                                           "{\"type\": \"function\", \"id\": ..., \"function\": {\"name\", "
                                           "\"arguments\"}}")
        name, arguments = function.get("name"), function.get("arguments", {})
        if not isinstance(name, str) or not name.strip():
            raise InvalidChatRecord(where, f"{place} has no function name")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                raise InvalidChatRecord(where, f"{place} arguments are not JSON ({error.msg} at column "
                                               f"{error.colno})") from None
        if not isinstance(arguments, dict):
            raise InvalidChatRecord(where, f"{place} arguments are a {type(arguments).__name__}; expected an object")
        clean.append({**call, "function": {**function, "arguments": arguments}})
    return clean


def split_reasoning_turns(record: ChatRecord) -> tuple[ChatRecord, ...]:
    """One sample per assistant turn that carries reasoning, each ending at that turn, so that a template which renders
    reasoning on the last turn only (Qwen3's history rule) renders and trains every turn's reasoning.

    The trained assistant turns (after `record.context`, not `training: false`) are cut after each one with a
    non-blank `reasoning_content` and after the last one; each sample is `messages` up to a cut, its turns before the
    previous cut context only (`ChatRecord.context`), so every trained turn is trained once, in the first sample that
    ends at or after it. A record with no reasoning turn before its last trained turn is returned alone, unchanged.
    Samples share the record's `where`; their `canonical()` differ, so a sample equal to another record (a shorter
    conversation with the same start) counts as a duplicate.
    """
    trained = [index for index, message in enumerate(record.messages) if index >= record.context and
               message["role"] == "assistant" and message.get("training", True)]
    cuts = [index for index in trained if record.messages[index].get("reasoning_content", "").strip()]
    if not cuts or cuts[-1] != trained[-1]:
        cuts.append(trained[-1])
    if len(cuts) == 1:
        return (record,)
    samples, context = [], record.context
    for cut in cuts:
        samples.append(dataclasses.replace(record, messages=record.messages[: cut + 1], context=context))
        context = cut + 1
    return tuple(samples)


class _DuplicateKey(ValueError):
    """A key given twice in one JSON object (`object_pairs_hook` of `json.loads`)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return obj


def open_jsonl_bytes(path: str | os.PathLike):
    """A JSONL file opened for reading its bytes: gzip-compressed ones (by their magic bytes, as `datasets` reads
    `.jsonl.gz`) decompressed while read (`seek` works forward, decompressing)."""
    f = open(path, "rb")
    if f.read(len(GZIP_MAGIC)) == GZIP_MAGIC:
        f.close()
        return gzip.open(path, "rb")
    f.seek(0)
    return f


def iter_jsonl(path: str | os.PathLike, start: int = 0, stop: int | None = None, first_line: int = 1,
               name: str | None = None) -> Iterator[tuple[str, object]]:
    """`(where, decoded object or InvalidChatRecord)` for each non-blank line of a JSONL file (gzip-compressed or not:
    `open_jsonl_bytes`, offsets then count decompressed bytes), read in order from byte `start` (a line start,
    numbered `first_line`) up to the line that starts at or after byte `stop`. Blank lines are skipped; a UTF-8 BOM
    starting a line is dropped; a key given twice in one object makes the line invalid. `where` is `NAME:LINE` (`name`
    defaults to the path)."""
    name = str(path) if name is None else name
    with open_jsonl_bytes(path) as f:
        f.seek(start)
        position, line_number = start, first_line
        for raw in f:
            if stop is not None and position >= stop:
                return
            position += len(raw)
            where, line_number = f"{name}:{line_number}", line_number + 1
            if raw.startswith(BOM):
                raw = raw[len(BOM) :]
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield where, InvalidChatRecord(
                    where, f"not valid UTF-8 ({error.reason} at byte {error.start}); re-encode the file as UTF-8")
                continue
            try:
                yield where, json.loads(line, object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as error:
                yield where, InvalidChatRecord(where, f"malformed JSON ({error.msg} at column {error.colno})")
            except _DuplicateKey as error:
                yield where, InvalidChatRecord(where, f"the key {error.args[0]!r} appears twice in one object (JSON "
                                                      "keeps only the last value): keep one")


def read_chat_jsonl(
    path: str | os.PathLike, *, skip_invalid_records: bool = False, stats: ChatDataStats | None = None
) -> list[ChatRecord | TextRecord]:
    """Read and validate a (small) chat JSONL file into a list; `hfl3.data.sft.load_sft_data` streams large ones.

    Args:
        path: the file.
        skip_invalid_records: skip and count bad lines instead of raising.
        stats: counters to update (`read`, `malformed`, `no_assistant`, `first_errors`).

    Raises:
        InvalidChatRecord: `file:line: reason` for the first bad line (non-UTF-8 bytes, malformed JSON, or any
            `normalize_record` failure), unless `skip_invalid_records`.
    """
    stats = stats if stats is not None else ChatDataStats()
    records = []
    for where, obj in iter_jsonl(path):
        stats.read += 1
        try:
            if isinstance(obj, InvalidChatRecord):
                raise obj
            records.append(normalize_record(obj, where))
        except InvalidChatRecord as error:
            if not skip_invalid_records:
                raise
            stats.count_skip(error)
    return records


def write_chat_jsonl(chats: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write chats as JSONL (UTF-8, one object per line) atomically; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
    return path
