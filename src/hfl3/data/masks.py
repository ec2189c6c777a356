"""Assistant-only labels for chat records, from the model's own chat template (docs/design.md, decision 9).

Masks come from the template without `{% generation %}` markers (`AssistantMasker`):

1. Render the whole conversation once, with its `tools`: `text`. This is what the model trains on, with the
   template's own history rules (Qwen3 keeps a `<think>` block only on assistant turns after the last user message,
   so the reasoning of earlier turns is not in `text`; Gemma folds the system prompt into the first user turn).
2. For each assistant message i that is trained on (not `training: false`), render `messages[:i]` with
   `add_generation_prompt=True`: its length is where the reply starts, because it ends with the role header
   (`<|im_start|>assistant\\n`, `<start_of_turn>model\\n`). A template that does not render that prefix identically
   inside `text` is reported, never guessed around: the reply would be trained in a context the model never sees
   when it generates it.
3. The reply (its text, tool calls, and reasoning where the template keeps it) ends with the template's end-of-turn
   text (`<|im_end|>`, `<end_of_turn>`), found once by rendering a probe conversation; it is inside the mask, the
   newline the template writes after it is not (generation stops at the end-of-turn token, so the model never
   produces that newline). No string of a record may contain special-token text, so the first end-of-turn after
   the header closes the reply.
4. Tokenize `text` with offsets (no special tokens added: templates write their own BOS); a token is supervised when
   its characters overlap a reply span.

Options, each TRL's meaning where TRL has the flag: `assistant_only_loss=False` trains the whole rendered text (system,
user and tool text included, as TRL does), but what is context only (a prompt–completion record's prompt, an earlier
turn of a `split_reasoning_turns` sample: the text up to the start of the first trained reply, or the end of the last
context reply) and replies marked `training: false`; `ignore_empty_reasoning` leaves out of the loss the empty
reasoning block that a template inserts before a reply without reasoning (Qwen3's `<think>\n\n</think>\n\n`,
found by probing the template once); `eos_token` replaces the tokenizer's EOS token (TRL's `eos_token`: appended to
plain text, and the template's `eos_token` variable).

What a template cannot render is refused rather than trained without: probe conversations show whether it renders
`developer` and `tool` messages, assistant `tool_calls` and `tools` (Gemma 3's stock template has none of them).
Plain-text records (`TextRecord`) bypass the template, as TRL tokenizes them: `prompt + completion + EOS` with the
tokenizer's special tokens, the completion and EOS supervised; a language-modeling text (no prompt) gets EOS unless
it ends with it and is supervised whole, special-token text included (no mask depends on it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from hfl3.data.chat import ChatRecord, InvalidChatRecord, TextRecord
from hfl3.provenance import sha256_records

logger = logging.getLogger(__name__)

MARK = "hfl3-probe-8d1c"
_BACKENDS: dict[str, Tokenizer] = {}
"""Tokenizer backends of fingerprinted maskers, by fingerprint: a worker process forked afterwards (a `datasets` pool)
inherits them, and unpickling a masker there takes the backend from here instead of rebuilding it (0.7 s for
Qwen3's)."""


@dataclass
class EncodedChat:
    """One record rendered and tokenized: `text` (the rendered template), `input_ids`, `labels` (the token id where
    supervised, -100 elsewhere), `spans` (supervised character ranges, one per trained assistant message),
    `reasoning_not_rendered` (assistant messages whose `reasoning_content` is not in `text`) and `offsets` ((start,
    end) character span of each token in `text`, built on first use: the rows need none). The token lists have length
    `len(input_ids)`. With holes in a reply (`training: false` inside a whole-text loss, an ignored empty reasoning
    block) a reply gives several spans."""

    text: str
    input_ids: list[int]
    labels: list[int]
    encoding: object = field(repr=False)
    spans: list[tuple[int, int]]
    reasoning_not_rendered: int = 0

    @functools.cached_property
    def offsets(self) -> list[tuple[int, int]]:
        return self.encoding.offsets


def _texts(value) -> Iterator[str]:
    """Every string inside a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


class AssistantMasker:
    """Assistant-only labels from a tokenizer's own chat template (see the module docstring for the method).

    Holds what encoding needs and nothing else (the template, its variables, the `tokenizers` backend), so that it
    pickles in a fraction of a second to `datasets` worker processes.

    Args:
        tokenizer: a fast tokenizer (offsets needed) with a chat template.
        chat_template: template text to use instead of `tokenizer.chat_template`.
        assistant_only_loss: False trains the whole text but context and `training: false` replies (module
            docstring).
        eos_token: instead of the tokenizer's EOS token (TRL's `eos_token`); must be in its vocabulary.
        ignore_empty_reasoning: leave the empty reasoning block the template inserts out of the loss.

    Attributes:
        end_of_turn: the text the template writes after a reply (`<|im_end|>`).
        empty_reasoning: what the template writes before a reply without reasoning where it writes reasoning
            (Qwen3: `<think>\n\n</think>\n\n`), or "".
        renders: what the template renders, by probe: `developer`, `tool` (messages of that role), `tool_calls`,
            `tools`.

    Raises:
        ValueError: if the tokenizer has no template or no offsets, `eos_token` is not in its vocabulary, or the
            template renders a probe conversation without an end-of-turn text after the reply or not
            prefix-preserving.
    """

    PROBE = ({"role": "user", "content": "Ping?"}, {"role": "assistant", "content": "Pong."})

    def __init__(self, tokenizer, chat_template: str | None = None, *, assistant_only_loss: bool = True,
                 eos_token: str | None = None, ignore_empty_reasoning: bool = False):
        if chat_template is None and not tokenizer.chat_template:
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template; pass chat_template= or use a chat model"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("assistant masks need a fast (Rust `tokenizers`) tokenizer for character offsets")
        # as apply_chat_template: a named "tool_use" template when there are tools, the special tokens as variables
        self.template = tokenizer.get_chat_template(chat_template)
        self.tool_template = tokenizer.get_chat_template(chat_template, tools=[])
        self.variables = dict(tokenizer.special_tokens_map)
        self.backend = tokenizer.backend_tokenizer
        if eos_token is not None and eos_token not in tokenizer.get_vocab():
            raise ValueError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary; give one of its tokens "
                             f"(its own EOS token is {tokenizer.eos_token!r})")
        self.eos_token = eos_token or tokenizer.eos_token
        if eos_token is not None:
            self.variables["eos_token"] = eos_token
        self.assistant_only_loss, self.ignore_empty_reasoning = assistant_only_loss, ignore_empty_reasoning
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
        self.special_texts = sorted({*added, *tokenizer.all_special_tokens, self.end_of_turn, self.eos_token} - {None})
        self.renders = self._probe()
        self.empty_reasoning = self._probe_empty_reasoning(prompt)
        if ignore_empty_reasoning and not self.empty_reasoning:
            logger.warning("ignore_empty_reasoning: the chat template writes no empty reasoning block before a reply "
                           "without reasoning; nothing to leave out")

    def _probe_empty_reasoning(self, prompt: str) -> str:
        """What the template writes between the role header and a reply without reasoning, when it writes a reply's
        reasoning there (probed with a marked `reasoning_content`); "" otherwise."""
        user, reply = self.PROBE
        try:
            marked = self.render([user, {**reply, "reasoning_content": MARK}])[len(prompt) :]
        except Exception:  # noqa: BLE001 (a template refusing reasoning_content renders none)
            return ""
        plain = self.render(self.PROBE)[len(prompt) :]
        before = plain[: plain.find(reply["content"])]
        return before if before.strip() and MARK in marked[: marked.find(reply["content"])] else ""

    def _probe(self) -> dict[str, bool]:
        user, reply = self.PROBE
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": MARK, "arguments": {"x": 1}}}]}
        tool = {"type": "function", "function": {"name": MARK, "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}
        probes = {"developer": ([{"role": "developer", "content": MARK}, user, reply], None),
                  "tool": ([user, {**call, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                            {"role": "tool", "content": MARK}, reply], None),
                  "tool_calls": ([user, call], None),
                  "tools": ([user, reply], [tool])}
        renders = {}
        for name, (messages, tools) in probes.items():
            try:
                renders[name] = MARK in self.render(messages, tools)
            except Exception:  # noqa: BLE001 (a template refusing the probe does not render it)
                renders[name] = False
        return renders

    @functools.cached_property
    def backend_json(self) -> str:
        """The tokenizer backend as `tokenizer.json` holds it."""
        return self.backend.to_str()

    def fingerprint(self) -> str:
        """sha256 of all that encoding depends on: the tokenizer (vocabulary, merges, normalizer, ...), the templates,
        their variables, the special texts. Leaves the backend in `_BACKENDS` for the worker processes forked later."""
        if "_fingerprint" not in self.__dict__:
            self._fingerprint = sha256_records([self.backend_json, self.template, self.tool_template, self.variables,
                                                self.special_texts, self.eos_token, self.options()])
            _BACKENDS[self._fingerprint] = self.backend
        return self._fingerprint

    def options(self) -> dict:
        """The options that shape the labels (for fingerprints and provenance)."""
        return {"assistant_only_loss": self.assistant_only_loss, "eos_token": self.eos_token,
                "ignore_empty_reasoning": self.ignore_empty_reasoning}

    def __getstate__(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items() if k != "backend"}, "backend_json": self.backend_json,
                "backend_key": self.fingerprint()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        inherited = _BACKENDS.get(state["backend_key"])
        self.backend = inherited if inherited is not None else Tokenizer.from_str(state["backend_json"])

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = False) -> str:
        """The template's text for `messages`, exactly as `tokenizer.apply_chat_template(..., tokenize=False)`."""
        rendered, _ = render_jinja_template(
            conversations=[list(messages)], tools=list(tools) if tools else None,
            chat_template=self.tool_template if tools else self.template,
            add_generation_prompt=add_generation_prompt, **self.variables)
        return rendered[0]

    def check_renderable(self, record: ChatRecord) -> None:
        """Refuse a record with special-token text in any string, or with what the template does not render.

        Raises:
            InvalidChatRecord: naming the message (or `tools`) and the special text, or what the template drops.
        """
        if isinstance(record, TextRecord) and record.prompt is None:
            return  # language modeling: tokenized as is, no mask depends on the special tokens
        places = [("'prompt'", record.prompt), ("'completion'", record.completion)] \
            if isinstance(record, TextRecord) else \
            [(f"message {i}", m) for i, m in enumerate(record.messages)] + [("'tools'", record.tools or ())]
        texts = "\x00".join(text for _, value in places for text in _texts(value))  # \x00: no match across strings
        for special in self.special_texts:
            if special in texts:
                place = next(place for place, value in places if special in "\x00".join(_texts(value)))
                raise InvalidChatRecord(record.where, f"{place} contains the special token text {special!r}; remove it")
        if isinstance(record, TextRecord):
            return
        needed = {role for role in ("developer", "tool") if any(m["role"] == role for m in record.messages)}
        needed |= {"tool_calls"} if any("tool_calls" in m for m in record.messages) else set()
        needed |= {"tools"} if record.tools else set()
        missing = sorted(name for name in needed if not self.renders[name])
        if missing:
            what = {"developer": "'developer' messages", "tool": "'tool' messages", "tool_calls": "assistant "
                    "'tool_calls'", "tools": "'tools'"}
            dropped = ", ".join(what[name] for name in missing)
            raise InvalidChatRecord(record.where, f"the chat template does not render {dropped}: they would be left "
                                                  "out of training (use a template that has them, or drop them from "
                                                  "the data)")

    def encode(self, record: ChatRecord | TextRecord | Sequence[dict], where: str = "<conversation>") -> EncodedChat:
        """Render, tokenize and label one validated record (untruncated); a bare message sequence is taken as a
        `ChatRecord` at `where`.

        Raises:
            InvalidChatRecord: special-token text in any string, something the template does not render
                (`check_renderable`), the template rejects the conversation (e.g. Gemma's alternation check) or
                renders the prefix before a labelled assistant message differently from the full conversation, or
                writes no end-of-turn after a reply.
        """
        if not isinstance(record, (ChatRecord, TextRecord)):
            record = ChatRecord(where, tuple(record))
        self.check_renderable(record)
        if isinstance(record, TextRecord):
            return self._encode_text(record)
        messages, tools, where = record.messages, record.tools, record.where
        assistant = [index for index, message in enumerate(messages)
                     if index >= record.context and message["role"] == "assistant"]
        trained = [index for index in assistant if messages[index].get("training", True)]
        try:
            text = self.render(messages, tools)
            replies = _Replies(self, text, messages, tools, where)
            if self.assistant_only_loss:
                spans, holes = [replies[index] for index in trained], []
            else:
                spans = [(replies.context_end(record.context), len(text))]
                holes = [replies[index] for index in assistant if index not in trained]
            if self.ignore_empty_reasoning and self.empty_reasoning:
                starts = [replies[index][0] for index in trained]
                holes += [(start, start + len(self.empty_reasoning)) for start in starts
                          if text.startswith(self.empty_reasoning, start)]
        except InvalidChatRecord:
            raise
        except Exception as error:  # noqa: BLE001 (jinja's TemplateError, or a TypeError inside the template)
            raise InvalidChatRecord(where, f"the chat template rejected the conversation: {error}") from None
        encoding = self._tokenize(text, add_special_tokens=False)
        unrendered = sum(1 for index in trained if messages[index].get("reasoning_content", "").strip() and
                         messages[index]["reasoning_content"].strip() not in text)
        return self._labelled(text, encoding, _without(spans, holes), unrendered)

    def _encode_text(self, record: TextRecord) -> EncodedChat:
        if not self.eos_token:
            raise InvalidChatRecord(record.where, "plain text needs the tokenizer's EOS token, and this tokenizer has "
                                                  "none; give the record as messages, or pass eos_token")
        prompt = record.prompt or ""
        text = prompt + record.completion
        if not text.endswith(self.eos_token):  # as TRL: a text that ends with EOS keeps its one
            text += self.eos_token
        return self._labelled(text, self._tokenize(text, add_special_tokens=True), [(len(prompt), len(text))])

    def _tokenize(self, text: str, add_special_tokens: bool):
        """`tokenizer(text)`'s encoding: the backend as transformers sets it for a call without truncation, padding
        or `split_special_tokens` (each call there sets these, and they stay set on the backend after it)."""
        backend = self.backend
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        backend.encode_special_tokens = False
        return backend.encode(text, add_special_tokens=add_special_tokens)

    @staticmethod
    def _labelled(text: str, encoding, spans: list[tuple[int, int]], unrendered: int = 0) -> EncodedChat:
        """Labels: a token is supervised when its characters overlap a span. The tokens of a span run from the one
        holding its first character to the last one holding its last character."""
        input_ids = encoding.ids
        labels = [-100] * len(input_ids)
        for start, end in spans:
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is None or last is None:  # characters no token covers (a normalizer dropped them)
                inside = [i for i, (a, b) in enumerate(encoding.offsets) if a < end and b > start]
                first, last = (inside[0], inside[-1]) if inside else (0, -1)
            while last + 1 < len(input_ids) and encoding.token_to_chars(last + 1)[0] < end:
                last += 1  # a character split over several tokens (byte-level BPE)
            labels[first : last + 1] = input_ids[first : last + 1]
        return EncodedChat(text, input_ids, labels, encoding, spans, unrendered)


class _Replies:
    """Where each assistant reply of a rendered conversation starts and ends (`replies[index]`: characters of `text`),
    each found once: it starts where the rendered turns before it with the generation prompt end, which must be a
    prefix of `text`, and ends after the first end-of-turn text from there."""

    def __init__(self, masker: AssistantMasker, text: str, messages: Sequence[dict], tools, where: str):
        self.masker, self.text, self.messages, self.tools, self.where = masker, text, messages, tools, where
        self.found: dict[int, tuple[int, int]] = {}

    def __getitem__(self, index: int) -> tuple[int, int]:
        if index not in self.found:
            self.found[index] = self._find(index)
        return self.found[index]

    def _find(self, index: int) -> tuple[int, int]:
        text, where = self.text, self.where
        prompt = self.masker.render(self.messages[:index], self.tools, add_generation_prompt=True)
        if not text.startswith(prompt):
            at = next((i for i, (a, b) in enumerate(zip(prompt, text)) if a != b), len(text))
            raise InvalidChatRecord(
                where,
                f"the chat template renders the turns before message {index} differently inside the full "
                f"conversation ({prompt[max(0, at - 30):at + 30]!r} alone, {text[max(0, at - 30):at + 30]!r} "
                "inside), so the reply would be trained in a context the model never sees when it writes it "
                "(e.g. two assistant messages in a row; Qwen3 with reasoning in a tool-calling turn followed "
                "by a new user message: split the record at that message, or split_reasoning_turns)",
            )
        end_of_turn = self.masker.end_of_turn
        end = text.find(end_of_turn, len(prompt))
        if end < 0:
            raise InvalidChatRecord(where, f"no {end_of_turn!r} after assistant message {index}")
        return len(prompt), end + len(end_of_turn)

    def context_end(self, context: int) -> int:
        """Where the text after the first `context` messages starts: 0 without context, the start of the reply that
        follows it, or the end of the reply that closes it."""
        if not context:
            return 0
        if self.messages[context]["role"] == "assistant":
            return self[context][0]
        if self.messages[context - 1]["role"] == "assistant":
            return self[context - 1][1]
        raise InvalidChatRecord(self.where, f"message {context} ({self.messages[context]['role']}) opens the trained "
                                            f"part after a {self.messages[context - 1]['role']} message; start the "
                                            "completion with the assistant's reply")


def _without(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The character ranges of `spans` (sorted, disjoint) less those of `holes`."""
    kept = []
    for start, end in spans:
        for hole_start, hole_end in sorted(holes):
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                kept.append((start, hole_start))
            start = max(start, hole_end)
        if start < end:
            kept.append((start, end))
    return kept
