"""Chat JSONL → tokenized SFT rows with assistant-only labels (DESIGN decisions 9 and 11).

Input: one JSON object per line, `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`
(other top-level keys such as `id` are ignored). Every line is validated; a bad line stops the run with
`file:line: reason` or, with `skip_invalid_records=True`, is skipped and counted (`ChatDataStats`).

Masks come from the model's own chat template, without `{% generation %}` markers (`AssistantMasker`):

1. Render the whole conversation once: `text`. This is what the model trains on, with the template's own
   history rules (Qwen3 keeps the empty `<think>` block only on assistant turns after the last user message; Gemma
   folds the system prompt into the first user turn).
2. For each assistant message i, render `messages[:i]` with `add_generation_prompt=True`: its length is where the
   reply starts, because it ends with the role header (`<|im_start|>assistant\\n`, `<start_of_turn>model\\n`). A
   template that does not render that prefix identically inside `text` is reported, never guessed around.
3. The reply ends with the template's end-of-turn text (`<|im_end|>`, `<end_of_turn>`), found once by rendering a
   probe conversation; it is inside the mask, the newline the template writes after it is not (generation stops at
   the end-of-turn token, so the model never produces that newline). Contents may not contain special-token text,
   so the first end-of-turn after the header closes the reply.
4. Tokenize `text` with offsets (`add_special_tokens=False`: templates write their own BOS); a token is
   supervised when its characters overlap a reply span.

Then each row is truncated to `max_length` (keep the start, like TRL) and dropped, counted, when no supervised
token is left. The rows are a `datasets.Dataset` with `input_ids` and `labels` (-100 off the loss), which TRL's
`SFTTrainer` uses as is.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import TemplateError

from hfl3.provenance import sha256_file, sha256_records

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = frozenset({"role", "content"})
MAX_LOGGED_ERRORS = 10


class InvalidChatRecord(ValueError):
    """A chat record that cannot be trained on. `str(error)` is `"{where}: {reason}"`; `kind` is `"malformed"` or
    `"no_assistant"` (the `ChatDataStats` counter a skipped record goes to)."""

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
        dropped_after_truncation: records whose supervised tokens all fell beyond `max_length`.
        kept: records that became training rows; `read = malformed + no_assistant + dropped_after_truncation + kept`.
        truncated: kept rows that were cut to `max_length`.
        tokens: tokens in the kept rows (after truncation).
        supervised_tokens: tokens with a label in the kept rows (`labels != -100`).
        first_errors: the first `MAX_LOGGED_ERRORS` skip reasons, as `file:line: reason`.
    """

    read: int = 0
    malformed: int = 0
    no_assistant: int = 0
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
            `kind="no_assistant"` when no message is from the assistant; and when the conversation does not end
            with an assistant message (trailing turns would never be trained on).
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
    """Read and validate a chat JSONL file. Blank lines are ignored; a UTF-8 BOM at the start is allowed.

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
            if line_number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
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


@dataclass
class EncodedChat:
    """One conversation rendered and tokenized: `text` (the rendered template), `input_ids`, `labels` (the token id
    where supervised, -100 elsewhere), `offsets` ((start, end) character span of each token in `text`) and `spans`
    (supervised character ranges, one per assistant message). All lists have length `len(input_ids)`."""

    text: str
    input_ids: list[int]
    labels: list[int]
    offsets: list[tuple[int, int]]
    spans: list[tuple[int, int]]


class AssistantMasker:
    """Assistant-only labels from a tokenizer's own chat template (see the module docstring for the method).

    Args:
        tokenizer: a fast tokenizer (offsets needed) with a chat template.
        chat_template: template text to use instead of `tokenizer.chat_template`.

    Raises:
        ValueError: if the tokenizer has no template or no offsets, or the template renders a probe conversation
            without an end-of-turn text after the reply or not prefix-preserving.
    """

    PROBE = ({"role": "user", "content": "Ping?"}, {"role": "assistant", "content": "Pong."})

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template; pass chat_template= or use a chat model"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("assistant masks need a fast (Rust `tokenizers`) tokenizer for character offsets")
        full, prompt = self.render(self.PROBE), self.render(self.PROBE[:1], add_generation_prompt=True)
        tail = full[len(prompt) :] if full.startswith(prompt) else None
        reply = self.PROBE[1]["content"]
        if tail is None or reply not in tail:
            raise ValueError(f"the chat template is not prefix-preserving on {list(self.PROBE)}: {full!r}")
        self.end_of_turn = tail[tail.rindex(reply) + len(reply) :].strip()
        if not self.end_of_turn:
            raise ValueError(
                f"the chat template writes nothing after an assistant reply ({full!r}); without an end-of-turn "
                "token the model cannot learn to stop"
            )
        added = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
        self.special_texts = sorted({*added, *tokenizer.all_special_tokens, self.end_of_turn})

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
        )

    def encode(self, messages: Sequence[dict], where: str = "<conversation>") -> EncodedChat:
        """Render, tokenize and label one validated conversation (untruncated).

        Raises:
            InvalidChatRecord: a content contains special-token text (it would become a control token), the
                template rejects the conversation (e.g. Gemma's alternation check), renders the prefix before an
                assistant message differently from the full conversation, or writes no end-of-turn after a reply.
        """
        for index, message in enumerate(messages):
            for special in self.special_texts:
                if special in message["content"]:
                    raise InvalidChatRecord(
                        where, f"message {index} contains the special token text {special!r}; remove it"
                    )
        try:
            text = self.render(messages)
            spans = []
            for index, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                prompt = self.render(messages[:index], add_generation_prompt=True)
                if not text.startswith(prompt):
                    raise InvalidChatRecord(
                        where,
                        f"the chat template renders the turns before message {index} differently inside the full "
                        "conversation, so the assistant reply cannot be located (e.g. two assistant messages in a row)",
                    )
                end = text.find(self.end_of_turn, len(prompt))
                if end < 0:
                    raise InvalidChatRecord(where, f"no {self.end_of_turn!r} after assistant message {index}")
                spans.append((len(prompt), end + len(self.end_of_turn)))
        except TemplateError as error:
            raise InvalidChatRecord(where, f"the chat template rejected the conversation: {error}") from None
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids, offsets = encoding["input_ids"], [tuple(o) for o in encoding["offset_mapping"]]
        labels, span_index = [], 0
        for token_id, (start, end) in zip(input_ids, offsets):
            while span_index < len(spans) and spans[span_index][1] <= start:
                span_index += 1
            inside = span_index < len(spans) and start < spans[span_index][1] and end > spans[span_index][0]
            labels.append(token_id if inside else -100)
        return EncodedChat(text, input_ids, labels, offsets, spans)


def encode_records(
    records: Iterable[ChatRecord],
    masker: AssistantMasker,
    max_length: int | None,
    *,
    skip_invalid_records: bool = False,
    stats: ChatDataStats | None = None,
) -> tuple[list[ChatRecord], list[list[int]], list[list[int]]]:
    """Mask, truncate (keep the first `max_length` tokens) and filter records.

    Returns:
        `(kept_records, input_ids, labels)`, aligned lists. A row whose labels are all -100 after truncation
        (ignoring position 0, which no loss reads: the model predicts token t from tokens < t) is dropped and
        counted in `stats.dropped_after_truncation`.

    Raises:
        InvalidChatRecord: from `AssistantMasker.encode`, unless `skip_invalid_records`.
    """
    stats = stats if stats is not None else ChatDataStats()
    kept, all_ids, all_labels = [], [], []
    for record in records:
        try:
            encoded = masker.encode(record.messages, record.where)
        except InvalidChatRecord as error:
            if not skip_invalid_records:
                raise
            stats.count_skip(error)
            continue
        ids, labels = encoded.input_ids, encoded.labels
        if max_length is not None and len(ids) > max_length:
            ids, labels = ids[:max_length], labels[:max_length]
            truncated = True
        else:
            truncated = False
        supervised = sum(label != -100 for label in labels[1:])
        if supervised == 0:
            stats.dropped_after_truncation += 1
            continue
        stats.kept += 1
        stats.truncated += truncated
        stats.tokens += len(ids)
        stats.supervised_tokens += supervised
        kept.append(record)
        all_ids.append(ids)
        all_labels.append(labels)
    return kept, all_ids, all_labels


@dataclass
class SFTData:
    """Datasets and provenance for one SFT run (see `load_sft_data`).

    `train` / `eval` have columns `input_ids` and `labels`; `stats` maps `"train_file"` (and `"eval_file"` when
    separate) to `ChatDataStats`; `provenance` holds the record hashes, file hashes, split seed and sizes."""

    train: object
    eval: object | None
    stats: dict[str, ChatDataStats]
    provenance: dict


def split_indices(n: int, val_split: float, seed: int) -> tuple[list[int], list[int]]:
    """Disjoint seeded split of `range(n)`: `round(n * val_split)` (at least 1) indices go to validation, chosen by
    `random.Random(seed).sample`; both lists are returned sorted (original order).

    Raises:
        ValueError: if `val_split` is not in (0, 1) or leaves no training example.
    """
    if not 0.0 < val_split < 1.0:
        raise ValueError(f"val_split={val_split}; expected a fraction in (0, 1)")
    n_val = max(1, round(n * val_split))
    if n_val >= n:
        raise ValueError(f"val_split={val_split} of {n} examples leaves nothing to train on")
    val = sorted(random.Random(seed).sample(range(n), n_val))
    val_set = set(val)
    return [i for i in range(n) if i not in val_set], val


def _encode_file(path, masker, max_length, skip_invalid_records) -> tuple[list, list, list, ChatDataStats]:
    stats = ChatDataStats()
    records = read_chat_jsonl(path, skip_invalid_records=skip_invalid_records, stats=stats)
    kept, ids, labels = encode_records(
        records, masker, max_length, skip_invalid_records=skip_invalid_records, stats=stats
    )
    logger.info("%s: %s", path, {k: v for k, v in stats.as_dict().items() if k != "first_errors"})
    for error in stats.first_errors:
        logger.warning("skipped %s", error)
    if not kept:
        raise ValueError(f"{path}: no usable conversation left ({stats.as_dict()})")
    return kept, ids, labels, stats


def _rows(ids: list, labels: list, indices: Iterable[int]):
    from datasets import Dataset

    indices = list(indices)
    return Dataset.from_dict({"input_ids": [ids[i] for i in indices], "labels": [labels[i] for i in indices]})


def load_sft_data(
    tokenizer,
    train_file: str | os.PathLike,
    *,
    eval_file: str | os.PathLike | None = None,
    val_split: float = 0.0,
    seed: int = 42,
    max_length: int | None = 1024,
    skip_invalid_records: bool = False,
    chat_template: str | None = None,
) -> SFTData:
    """Read, validate, mask and truncate chat JSONL into train/eval datasets with their provenance.

    The evaluation rows come from `eval_file` or, with `val_split > 0`, from a disjoint seeded split of the kept
    training rows (`split_indices`); with neither, `eval` is None. `provenance` holds `train_records_sha256` /
    `eval_records_sha256` (`sha256_records` of the kept messages in dataset order), the files' sha256, the split
    seed and the sizes.

    Raises:
        InvalidChatRecord: for the first bad record, unless `skip_invalid_records`.
        ValueError: if a file has no usable record left, or both `eval_file` and `val_split` are given.
    """
    if eval_file is not None and val_split:
        raise ValueError("give either eval_file or val_split, not both")
    masker = AssistantMasker(tokenizer, chat_template)
    records, ids, labels, train_stats = _encode_file(train_file, masker, max_length, skip_invalid_records)
    stats = {"train_file": train_stats}
    files = {str(train_file): sha256_file(train_file)}
    if val_split:
        train_idx, eval_idx = split_indices(len(records), val_split, seed)
        eval_records, train_records = [records[i] for i in eval_idx], [records[i] for i in train_idx]
        train, evaluation = _rows(ids, labels, train_idx), _rows(ids, labels, eval_idx)
    else:
        train_records, train = records, _rows(ids, labels, range(len(records)))
        eval_records, evaluation = [], None
    if eval_file is not None:
        eval_records, eval_ids, eval_labels, stats["eval_file"] = _encode_file(
            eval_file, masker, max_length, skip_invalid_records
        )
        evaluation = _rows(eval_ids, eval_labels, range(len(eval_records)))
        files[str(eval_file)] = sha256_file(eval_file)
    provenance = {
        "train_records_sha256": sha256_records([list(r.messages) for r in train_records]),
        "eval_records_sha256": sha256_records([list(r.messages) for r in eval_records]) if eval_records else None,
        "files_sha256": files,
        "val_split": val_split,
        "split_seed": seed if val_split else None,
        "train_examples": len(train_records),
        "eval_examples": len(eval_records),
        "max_length": max_length,
        "end_of_turn": masker.end_of_turn,
        "counts": {name: s.as_dict() for name, s in stats.items()},
    }
    return SFTData(train, evaluation, stats, provenance)


# Pure-Python, side-effect-free stdlib modules whose public functions carry docstrings (DESIGN decision 11)
STDLIB_DOC_MODULES = (
    "base64", "bisect", "calendar", "cmath", "colorsys", "copy", "csv", "dataclasses", "datetime", "difflib",
    "email.utils", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html", "inspect",
    "ipaddress", "itertools", "json", "keyword", "math", "mimetypes", "operator", "os", "os.path", "pathlib",
    "platform", "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil", "statistics", "string",
    "struct", "tempfile", "textwrap", "time", "types", "typing", "unicodedata", "urllib.parse", "uuid", "zlib",
)  # fmt: skip
STDLIB_QUESTIONS = (
    "What does `{name}{signature}` do?",
    "Explain the Python function `{name}{signature}`.",
    "In Python's standard library, what is `{name}{signature}` for?",
)
STDLIB_SYSTEM = "You are a concise assistant that explains the Python standard library."
_SIGNATURE_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->.*)?$")


def _first_paragraph(doc: str) -> str | None:
    for paragraph in doc.split("\n\n"):
        text = " ".join(line.strip() for line in paragraph.splitlines()).strip()
        if text and not _SIGNATURE_LINE.match(text):
            return text
    return None


def stdlib_docstring_functions(max_answer_chars: int = 400) -> list[tuple[str, str, str]]:
    """`(qualified name, signature, first docstring paragraph)` for the public functions of `STDLIB_DOC_MODULES`
    that have an `inspect.signature` and a first paragraph of 20 to `max_answer_chars` characters, sorted by name
    and without duplicates (one object reached from two modules is kept under the first name). Memory addresses in
    signatures (`<object object at 0x...>`) are removed, so every process builds the same list."""
    found, seen = [], set()
    for module_name in STDLIB_DOC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)) or id(obj) in seen:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            # Default values such as `<object object at 0x7f...>` differ between processes
            signature = re.sub(r" at 0x[0-9a-fA-F]+", "", signature)
            answer = _first_paragraph(inspect.getdoc(obj) or "")
            if answer is None or not 20 <= len(answer) <= max_answer_chars:
                continue
            seen.add(id(obj))
            found.append((f"{module_name}.{attr}", signature, answer))
    return sorted(found)


def stdlib_docstring_chats(n: int, seed: int = 0) -> list[dict]:
    """`n` chats about real stdlib functions: the user asks what `module.function(signature)` does, the assistant
    answers with the first paragraph of its docstring; about half carry a system prompt. Deterministic for one
    Python installation (docstrings differ across Python versions, so hash the result for provenance).

    Returns:
        `[{"messages": [...], "source": "stdlib:module.function"}, ...]`, in the order drawn.

    Raises:
        ValueError: if `n` exceeds the number of usable functions.
    """
    functions = stdlib_docstring_functions()
    if not 0 < n <= len(functions):
        raise ValueError(f"n={n}; this Python's stdlib offers {len(functions)} documented functions")
    rng = random.Random(seed)
    chats = []
    for name, signature, answer in rng.sample(functions, n):
        question = rng.choice(STDLIB_QUESTIONS).format(name=name, signature=signature)
        system = [{"role": "system", "content": STDLIB_SYSTEM}] if rng.random() < 0.5 else []
        messages = [*system, {"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages, "source": f"stdlib:{name}"})
    return chats


def write_chat_jsonl(chats: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write chats as JSONL (UTF-8, one object per line) atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
