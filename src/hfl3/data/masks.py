"""Assistant-only labels for chat conversations, from the model's own chat template (docs/design.md, decision 9).

Masks come from the template without `{% generation %}` markers (`AssistantMasker`):

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
token is left (`encode_records`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jinja2 import TemplateError

from hfl3.data.chat import ChatDataStats, ChatRecord, InvalidChatRecord, messages_sha256

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
    seen: dict[bytes, str] | None = None,
) -> tuple[list[ChatRecord], list[list[int]], list[list[int]]]:
    """Mask, truncate (keep the first `max_length` tokens) and filter records, dropping exact duplicates.

    With `seen` (digest → `file:line` of earlier kept records, updated with the kept ones: one 32-byte digest per
    record; `load_sft_data` passes one), a record whose messages equal those of an earlier kept record
    (`messages_sha256`) is dropped and counted in `stats.duplicates`, its reason being `file:line: same messages as
    file:line`. A record that is itself skipped (invalid, or no supervised token left) does not make its repeats
    duplicates: they are skipped for the same reason.

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
        digest = messages_sha256(record.messages) if seen is not None else None
        if seen is not None and digest in seen:
            stats.count_skip(InvalidChatRecord(record.where, f"same messages as {seen[digest]}", kind="duplicates"))
            continue
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
        if seen is not None:
            seen[digest] = record.where
        kept.append(record)
        all_ids.append(ids)
        all_labels.append(labels)
    return kept, all_ids, all_labels
