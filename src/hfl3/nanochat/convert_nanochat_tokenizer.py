"""nanochat's tokenizer ↔ a `tokenizers` byte-level BPE that `AutoTokenizer` loads, with the same ids on any text.

nanochat (karpathy/nanochat 92d63d4, nanochat/tokenizer.py) trains a BPE with rustbpe and encodes with a tiktoken
`Encoding` pickled to `tokenizer.pkl`: mergeable ranks (token bytes → id, the 256 single bytes first, then one token
per merge in training order), its split pattern (GPT-4's with digit runs of at most 2), and 9 special tokens after
the ranks (`SPECIAL_TOKENS`). tiktoken encodes a regex piece by returning it whole when it is a token, else by merging
the adjacent pair whose concatenation has the lowest rank, leftmost first, until none is a token.

The converted tokenizer reproduces that exactly: the same split regex (`Split`, isolated), byte-level mapping without
a prefix space, `ignore_merges=True` (a whole piece that is a token is returned as is) and, for every token that the
merges can build from its own bytes, the one pair tiktoken's procedure merges last (`bpe_merges`), in rank order.
Inside a word a token only ever forms from a span of bytes that evolves as it would alone, so that pair is the only
one ever needed; a second split of the same token would be merged in an order tiktoken does not use.

Special tokens: nanochat's `encode` is tiktoken's `encode_ordinary` (special-token text is plain text); a
transformers tokenizer splits special-token text out as the special ids, which the chat template needs. Pass
`split_special_tokens=True` to the tokenizer for `encode_ordinary`'s ids on such text.

The chat template renders `RustBPETokenizer.render_conversation`: `<|bos|>`, then `<|user_start|>…<|user_end|>` and
`<|assistant_start|>…<|assistant_end|>` turns (strictly alternating, user first), a system message joined to the
first user message with a blank line, assistant content given as parts (`text`, `python` in
`<|python_start|>…<|python_end|>`, `python_output` in `<|output_start|>…<|output_end|>`); the generation prompt is
`<|assistant_start|>` (`render_for_completion`). nanochat encodes each part separately: two adjacent `text` parts
can tokenize differently once joined by the template.

`tokenizer.pkl` is read without executing code: `load_nanochat_encoding` unpickles with a `find_class` that accepts
only `tiktoken.core.Encoding` and records its state in a stand-in object (tiktoken need not be installed), and
`encoding_pickle_bytes` gives the bytes `pickle.dump(encoding)` produces for a tiktoken `Encoding`.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIAL_TOKENS = (
    "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>",
)  # fmt: skip
BOS_TOKEN, END_OF_TURN = "<|bos|>", "<|assistant_end|>"
PICKLE_NAME, TOKEN_BYTES_NAME = "tokenizer.pkl", "token_bytes.pt"
# The one class a nanochat tokenizer.pkl refers to (tiktoken's Encoding, pickled through its __getstate__).
ENCODING_CLASS = ("tiktoken.core", "Encoding")

_ROLE_ERROR = "nanochat conversations alternate user/assistant turns, starting with user"
NANOCHAT_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages | length < 2 or messages[1]['role'] != 'user' -%}"
    "{{ raise_exception('a system message must be followed by a user message') }}{%- endif -%}"
    "{%- set turns = [{'role': 'user', 'content': messages[0]['content'] + '\\n\\n' + messages[1]['content']}]"
    " + messages[2:] -%}"
    "{%- else -%}{%- set turns = messages -%}{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for message in turns -%}"
    "{%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}"
    "{{ raise_exception('" + _ROLE_ERROR + "') }}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|user_start|>' + message['content'] + '<|user_end|>' -}}"
    "{%- else -%}"
    "{{- '<|assistant_start|>' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'python' -%}{{- '<|python_start|>' + part['text'] + '<|python_end|>' -}}"
    "{%- elif part['type'] == 'python_output' -%}{{- '<|output_start|>' + part['text'] + '<|output_end|>' -}}"
    "{%- else -%}{{ raise_exception('unknown content part type ' + part['type']) }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|assistant_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}"
)


@dataclass
class NanochatEncoding:
    """The state of nanochat's tiktoken `Encoding`: `pat_str` (split regex), `mergeable_ranks` (token bytes → id,
    ids 0..n-1), `special_tokens` (text → id) and tiktoken's `name` (nanochat: "rustbpe")."""

    pat_str: str
    mergeable_ranks: dict[bytes, int]
    special_tokens: dict[str, int]
    name: str = "rustbpe"

    @property
    def n_vocab(self) -> int:
        """tiktoken's `n_vocab`: largest id + 1 (nanochat's `get_vocab_size`)."""
        return max([*self.mergeable_ranks.values(), *self.special_tokens.values()]) + 1

    def check(self, where: str) -> None:
        """Raise `ValueError` naming `where` when the state is not a tokenizer tiktoken (and this module) accepts:
        ranks must be 0..n-1 and hold all 256 single bytes, special ids must not collide with them."""
        ranks = sorted(self.mergeable_ranks.values())
        if ranks != list(range(len(ranks))):
            raise ValueError(f"{where}: mergeable ranks are not the ids 0..{len(ranks) - 1} (a BPE trained by rustbpe)")
        missing = [b for b in range(256) if bytes([b]) not in self.mergeable_ranks]
        if missing:
            raise ValueError(f"{where}: {len(missing)} single bytes have no token (first: {missing[0]}); byte-level "
                             "BPE needs all 256")
        clash = sorted(i for i in self.special_tokens.values() if i < len(ranks))
        if clash or len(set(self.special_tokens.values())) != len(self.special_tokens):
            raise ValueError(f"{where}: special token ids {clash or sorted(self.special_tokens.values())} collide")


class _EncodingState:
    """Stand-in for `tiktoken.core.Encoding` during unpickling: keeps the state `__getstate__` wrote, runs nothing."""

    state = None

    def __setstate__(self, state):
        self.state = state


class _TokenizerUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ENCODING_CLASS:
            return _EncodingState
        raise pickle.UnpicklingError(
            f"refusing to load global {module}.{name}: a nanochat tokenizer.pkl holds only a {'.'.join(ENCODING_CLASS)}"
            " and plain data, and loading anything else could run arbitrary code"
        )


def load_nanochat_encoding(tokenizer_dir: str | os.PathLike) -> NanochatEncoding:
    """Read `tokenizer_dir/tokenizer.pkl` (written by nanochat's `RustBPETokenizer.save`) without executing code.

    Raises:
        FileNotFoundError: no `tokenizer.pkl` in `tokenizer_dir`.
        pickle.UnpicklingError: the pickle refers to any class other than `tiktoken.core.Encoding`.
        ValueError: the state is not a plain-data encoding (a registered tiktoken encoding pickled by name, such
            as nanochat's `RustBPETokenizer.from_pretrained("gpt2")`, or inconsistent ranks).
    """
    path = Path(tokenizer_dir) / PICKLE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass nanochat's tokenizer folder (NANOCHAT_BASE_DIR/tokenizer)")
    with open(path, "rb") as f:
        try:
            loaded = _TokenizerUnpickler(f).load()
        except pickle.UnpicklingError as error:
            raise pickle.UnpicklingError(f"{path}: {error}") from None
        except (EOFError, AttributeError, IndexError, TypeError, ValueError) as error:  # truncated or not a pickle
            raise ValueError(f"{path}: not a readable pickle ({type(error).__name__}: {error})") from None
    state = loaded.state if isinstance(loaded, _EncodingState) else None
    if isinstance(state, str):
        raise ValueError(f"{path} names the registered tiktoken encoding {state!r} instead of holding its ranks; "
                         "convert from a tokenizer trained by nanochat's scripts.tok_train")
    if not isinstance(state, dict) or not {"pat_str", "mergeable_ranks", "special_tokens"} <= set(state):
        raise ValueError(f"{path} does not hold a tiktoken Encoding's state (pat_str, mergeable_ranks, special_tokens)")
    ranks, specials = state["mergeable_ranks"], state["special_tokens"]
    if not (isinstance(state["pat_str"], str) and all(isinstance(k, bytes) and type(v) is int for k, v in ranks.items())
            and all(isinstance(k, str) and type(v) is int for k, v in specials.items())):
        raise ValueError(f"{path}: pat_str must be str, mergeable_ranks bytes → int, special_tokens str → int")
    encoding = NanochatEncoding(state["pat_str"], dict(ranks), dict(specials), str(state.get("name", "rustbpe")))
    encoding.check(str(path))
    return encoding


def encoding_pickle_bytes(encoding: NanochatEncoding) -> bytes:
    """What `pickle.dump(tiktoken_encoding, f)` writes for this state (the class by reference, then `__getstate__`'s
    dict, restored through `__setstate__`), built without tiktoken: protocol 3 opcodes GLOBAL `tiktoken.core
    Encoding`, EMPTY_TUPLE, NEWOBJ, the pickled state dict, BUILD, STOP."""
    state = {"name": encoding.name, "pat_str": encoding.pat_str, "mergeable_ranks": encoding.mergeable_ranks,
             "special_tokens": encoding.special_tokens}
    body = pickle.dumps(state, protocol=3)  # b"\x80\x03" + dict + b"."; its memo indices start at 0, as here
    return b"\x80\x03c" + "\n".join(ENCODING_CLASS).encode() + b"\n)\x81" + body[2:-1] + b"b."


def bpe_merges(mergeable_ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """For each token (in rank order) that tiktoken's merging builds from its own bytes, the last pair merged; tokens
    it cannot build (reachable only as a whole piece) get none. Cost: O(Σ len(token)²)."""
    merges = []
    for token, rank in sorted(mergeable_ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        last = None
        while len(parts) > 1:
            ranks = [mergeable_ranks.get(parts[i] + parts[i + 1]) for i in range(len(parts) - 1)]
            candidates = [(r, i) for i, r in enumerate(ranks) if r is not None]
            if not candidates:
                break
            _, i = min(candidates)  # lowest rank, leftmost on ties (tiktoken's _byte_pair_merge)
            last = (parts[i], parts[i + 1])
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if parts == [token]:
            merges.append(last)
    return merges


def tokenizer_from_encoding(encoding: NanochatEncoding) -> PreTrainedTokenizerFast:
    """The transformers tokenizer equal to nanochat's on every text (see the module docstring): BOS `<|bos|>`, EOS
    `<|assistant_end|>` (where a chat reply ends), PAD `<|bos|>` (nanochat has none; BOS is never a target, so a
    collator that masks pad ids loses nothing), nanochat's chat template, no special token added by encoding.

    Raises:
        ValueError: special tokens that are not nanochat's 9, or ids not following the ranks in nanochat's order.
    """
    expected = {name: len(encoding.mergeable_ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    if encoding.special_tokens != expected:
        raise ValueError(f"special tokens {encoding.special_tokens} are not nanochat's {expected}")
    to_unicode = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {text(token): rank for token, rank in encoding.mergeable_ranks.items()}
    merges = [(text(left), text(right)) for left, right in bpe_merges(encoding.mergeable_ranks)]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(encoding.pat_str), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS])
    assert all(backend.token_to_id(name) == i for name, i in expected.items()), "special ids follow the ranks"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS_TOKEN, eos_token=END_OF_TURN, pad_token=BOS_TOKEN,
        chat_template=NANOCHAT_CHAT_TEMPLATE, model_max_length=1 << 30, clean_up_tokenization_spaces=False,
    )  # fmt: skip


def encoding_from_tokenizer(tokenizer) -> NanochatEncoding:
    """The nanochat (tiktoken) state of a transformers tokenizer that `tokenizer_from_encoding` could have built:
    byte-level BPE with `ignore_merges`, a `Split` regex, ids 0..n-1 for the vocabulary followed by nanochat's 9
    special tokens, and exactly the merges `bpe_merges` derives from those ranks (so nanochat gives the same ids).

    Raises:
        ValueError: naming the first property the tokenizer lacks.
    """
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model, pre = state["model"], state.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if model.get("type") != "BPE" or kinds != ["Split", "ByteLevel"] or "Regex" not in steps[0].get("pattern", {}):
        raise ValueError(f"tokenizer is {model.get('type')} with pre-tokenizers {kinds}; nanochat's is a byte-level "
                         "BPE after one Split regex (convert it from a nanochat tokenizer.pkl)")
    if not model.get("ignore_merges") or steps[1].get("add_prefix_space") or state.get("normalizer"):
        raise ValueError("tokenizer must return whole pieces found in the vocabulary (ignore_merges), add no prefix "
                         "space and have no normalizer, as tiktoken does")
    from_unicode = {char: byte for byte, char in bytes_to_unicode().items()}
    try:
        ranks = {bytes(from_unicode[c] for c in token): i for token, i in model["vocab"].items()}
    except KeyError as error:
        raise ValueError(f"vocabulary token with character {error} is not byte-level") from None
    specials = {t["content"]: t["id"] for t in state.get("added_tokens", []) if t.get("special")}
    encoding = NanochatEncoding(steps[0]["pattern"]["Regex"], ranks, specials)
    encoding.check("tokenizer")
    expected = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    if specials != expected:
        raise ValueError(f"tokenizer's special tokens {specials} are not nanochat's {expected}: nanochat's chat_cli "
                         "and render_conversation look these names up")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    to_unicode = bytes_to_unicode()
    derived = [("".join(to_unicode[b] for b in a), "".join(to_unicode[b] for b in b_)) for a, b_ in bpe_merges(ranks)]
    if merges != derived:
        raise ValueError("tokenizer's merges are not the ones tiktoken's rank order implies; nanochat would split "
                         "some words differently")
    return encoding


__all__ = [
    "NANOCHAT_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "NanochatEncoding",
    "bpe_merges",
    "encoding_from_tokenizer",
    "encoding_pickle_bytes",
    "load_nanochat_encoding",
    "tokenizer_from_encoding",
]
