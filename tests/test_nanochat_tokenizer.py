"""nanochat's tokenizer.pkl → a transformers tokenizer (nanochat/convert_nanochat_tokenizer.py) and back: same ids
as tiktoken's procedure on real text, nanochat's chat format and masks, no code run while unpickling."""

import pickle
import pickletools

import pytest
from jinja2 import TemplateError
from nanochat_reference import (
    SPECIAL_TOKENS, SPLIT_PATTERN, render_conversation, tiktoken_encode, train_ranks, write_tokenizer_pickle,
)  # fmt: skip
from transformers import AutoTokenizer

from hfl3.data.chat import read_chat_jsonl
from hfl3.data.masks import AssistantMasker
from hfl3.nanochat.convert_nanochat_tokenizer import (
    NanochatEncoding, bpe_merges, encoding_from_tokenizer, encoding_pickle_bytes, load_nanochat_encoding,
    tokenizer_from_encoding,
)  # fmt: skip
from hfl3.tokenization import train_tokenizer

# Text the rank table never saw, and the shapes the split pattern treats specially (digit pairs, contractions,
# newline runs, CRLF, non-Latin scripts, emoji, trailing spaces)
EDGE_TEXT = ("I'LL say it's 1234567 o'clock.\r\n\r\n  Ünïcödé: Ελληνικά, русский, 中文字符, عربى, 😀🚀!!\t\tend   \n"
             "x=[1,22,333];  y = x ** 2  # comment\n\n\n    indented\u00a0nbsp\u3000ideographic")


@pytest.fixture(scope="module")
def ranks(assets):
    # 491 ranks + 9 specials = 500 tokens: not a multiple of 64, as a real vocabulary may be
    return train_ranks((assets / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000], 491)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, ranks):
    folder = tmp_path_factory.mktemp("nanochat_tokenizer")
    write_tokenizer_pickle(folder, ranks)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir, tmp_path_factory):
    converted = tokenizer_from_encoding(load_nanochat_encoding(tokenizer_dir))
    folder = tmp_path_factory.mktemp("converted_tokenizer")
    converted.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)  # what users load: tokenizer.json + tokenizer_config.json


def test_ids_equal_tiktoken_on_gutenberg(tokenizer, ranks, assets):
    novels = sorted((assets / "text" / "gutenberg").glob("*.txt"))
    texts = [path.read_text(encoding="utf-8")[:40_000] for path in novels]
    texts.append(EDGE_TEXT)
    assert len(novels) >= 2  # the guard: real novels were found
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == tiktoken_encode(text, ranks), text[:60]
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 500 and tokenizer.vocab_size == 491


def test_special_tokens_follow_the_ranks_and_encode_ordinary_is_available(tokenizer, ranks):
    ids = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert ids == list(range(491, 500))
    named = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert named == ("<|bos|>", "<|assistant_end|>", "<|bos|>")
    text = "hi <|user_start|> there"
    assert ids[1] in tokenizer(text, add_special_tokens=False)["input_ids"]  # split out, as templates need
    ordinary = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert ordinary == tiktoken_encode(text, ranks) and ids[1] not in ordinary  # nanochat's encode_ordinary


def test_chat_template_renders_nanochat_conversations_and_masks(tokenizer, ranks, assets):
    records = read_chat_jsonl(assets / "chat" / "gsm8k_messages_test.jsonl")[:40]  # system + user + assistant
    masker = AssistantMasker(tokenizer)
    assert masker.end_of_turn == "<|assistant_end|>"
    for record in records:
        messages = list(record.messages)
        ids, mask = render_conversation(messages, ranks)
        encoded = masker.encode(messages, record.where)
        assert encoded.input_ids == ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert [int(label != -100) for label in encoded.labels] == mask  # reply + <|assistant_end|>, as nanochat
        assert sum(mask) > 1
    tool_use = [{"role": "user", "content": "What is 12*7?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me compute "},
                                                  {"type": "python", "text": "12*7"},
                                                  {"type": "python_output", "text": "84"},
                                                  {"type": "text", "text": " so 84."}]}]  # fmt: skip
    assert tokenizer.apply_chat_template(tool_use, tokenize=True, return_dict=False) == render_conversation(
        tool_use, ranks)[0]
    prompt = tokenizer.apply_chat_template(tool_use[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt == render_conversation(tool_use[:1], ranks)[0] + [tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[3])]
    with pytest.raises(TemplateError, match="alternate"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "first"}], tokenize=False)


def test_tokenizer_pickle_never_runs_code(tmp_path, tokenizer_dir):
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            import os

            return os.system, (f"touch {marker}",)

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "tokenizer.pkl").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load global (posix|os)\.system"):
        load_nanochat_encoding(tmp_path / "evil")
    assert not marker.exists()
    write_tokenizer_pickle(tmp_path / "by_name", {}, state="gpt2")  # tiktoken pickles registered encodings by name
    with pytest.raises(ValueError, match="registered tiktoken encoding 'gpt2'"):
        load_nanochat_encoding(tmp_path / "by_name")
    with pytest.raises(FileNotFoundError, match="tokenizer folder"):
        load_nanochat_encoding(tmp_path)
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "tokenizer.pkl").write_bytes((tokenizer_dir / "tokenizer.pkl").read_bytes()[:500])
    with pytest.raises(pickle.UnpicklingError, match="tokenizer.pkl: pickle data was truncated"):
        load_nanochat_encoding(tmp_path / "cut")
    assert load_nanochat_encoding(tokenizer_dir).pat_str == SPLIT_PATTERN  # the guard: the real pickle loads


def test_back_to_nanochat_gives_the_same_pickle_state(tmp_path, tokenizer, tokenizer_dir, ranks):
    original = load_nanochat_encoding(tokenizer_dir)
    encoding = encoding_from_tokenizer(tokenizer)
    assert encoding == original
    (tmp_path / "tokenizer.pkl").write_bytes(encoding_pickle_bytes(encoding))
    assert load_nanochat_encoding(tmp_path) == original
    # nanochat's pickle and ours both name the class, build it with NEWOBJ and restore __getstate__'s dict with BUILD
    ops = lambda data: [op.name for op, _, _ in pickletools.genops(data)]  # noqa: E731
    written, nanochat = ops(encoding_pickle_bytes(encoding)), ops((tokenizer_dir / "tokenizer.pkl").read_bytes())
    for sequence in (written, nanochat):
        assert [op for op in sequence if op in ("GLOBAL", "STACK_GLOBAL", "NEWOBJ", "BUILD", "REDUCE")][1:] == [
            "NEWOBJ", "BUILD"]


def test_merges_are_the_last_pair_tiktoken_merges():
    # "aaa" is built as ("aa", "a"): tiktoken merges the leftmost lowest pair first; "ab" + "c" never forms "abc"
    # because ("b", "c") has the lower rank, so "abc" comes from ("a", "bc")
    ranks = {bytes([b]): b for b in range(256)}
    for token in (b"aa", b"bc", b"aaa", b"ab", b"abc"):
        ranks[token] = len(ranks)
    assert bpe_merges(ranks) == [(b"a", b"a"), (b"b", b"c"), (b"aa", b"a"), (b"a", b"b"), (b"a", b"bc")]
    encoding = NanochatEncoding(SPLIT_PATTERN, ranks, {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)})
    converted = tokenizer_from_encoding(encoding)
    for text in ("abc", "aaaa", "aabcabcaaa bcab", "cabc"):
        assert converted(text, add_special_tokens=False)["input_ids"] == tiktoken_encode(text, ranks), text


def test_refuses_tokenizers_nanochat_cannot_hold(tokenizer_dir, ranks, assets):
    text = (assets / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:20_000]
    with pytest.raises(ValueError, match="ignore_merges"):  # a BPE that merges whole-vocabulary words
        encoding_from_tokenizer(train_tokenizer([text], vocab_size=300))
    extra = tokenizer_from_encoding(load_nanochat_encoding(tokenizer_dir))
    extra.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    with pytest.raises(ValueError, match="special tokens"):
        encoding_from_tokenizer(extra)
    broken = NanochatEncoding(SPLIT_PATTERN, {k: v for k, v in ranks.items() if k != b"\x00"}, {})
    with pytest.raises(ValueError, match="not the ids 0"):
        broken.check("tokenizer.pkl")
    with pytest.raises(ValueError, match="not nanochat's"):
        tokenizer_from_encoding(NanochatEncoding(SPLIT_PATTERN, ranks, {"<|endoftext|>": len(ranks)}))
