"""Tokenizer training, token_bytes, corpus loading errors, the document split and best-fit packing invariants."""

import math

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from hfl3.data import text
from hfl3.tokenization import BOS_TOKEN, IM_END, IM_START, token_bytes, train_tokenizer
from hfl3.trainers.pretrain import BitsPerByte, PackedCollator, document_position_ids


@pytest.fixture(scope="module")
def shakespeare(assets) -> str:
    return (assets / "text" / "tinyshakespeare.txt").read_text()


@pytest.fixture(scope="module")
def tokenizer(shakespeare):
    return train_tokenizer([shakespeare[:200_000]], vocab_size=1024)


def test_trained_tokenizer_round_trips_and_has_chatml(tokenizer):
    sample = "KING: Wherefore — ünïcode 日本語, 12345?"
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == sample
    assert len(tokenizer) == 1024
    assert tokenizer.bos_token == BOS_TOKEN and tokenizer.eos_token == IM_END
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert chat == f"{BOS_TOKEN}{IM_START}user\nhi{IM_END}\n{IM_START}assistant\nyo{IM_END}\n"
    assert tokenizer.convert_tokens_to_ids(IM_START) != tokenizer.unk_token_id


@pytest.mark.parametrize("name", ["ours", "qwen3", "gemma3"])
def test_token_bytes_counts_raw_utf8_bytes(name, tokenizer, assets):
    tok = tokenizer if name == "ours" else AutoTokenizer.from_pretrained(assets / "tokenizers" / name)
    lengths = token_bytes(tok)
    assert lengths.shape == (len(tok),)
    for sample in ["naïve café — 日本語 🙂", "def f(x):\n    return x ** 2\n", "  \t spaces"]:
        ids = tok(sample, add_special_tokens=False)["input_ids"]
        assert int(lengths[ids].sum()) == len(sample.encode("utf-8")), sample
    assert all(lengths[i] == 0 for i in tok.all_special_ids)


def test_token_bytes_of_partial_multibyte_tokens(tokenizer):
    # '日' is 3 UTF-8 bytes: byte-level tokens may split it; a decode round trip would count U+FFFD (3 bytes) each
    ids = tokenizer("日", add_special_tokens=False)["input_ids"]
    assert int(token_bytes(tokenizer)[ids].sum()) == 3
    if len(ids) > 1:
        assert sum(len(tokenizer.decode([i]).encode()) for i in ids) != 3  # the round trip would be wrong


def test_corpus_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        text.load_corpus(str(tmp_path / "nothing*.txt"))
    (tmp_path / "good.txt").write_text("hello world\n")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1\n")
    with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8"):
        text.load_corpus(str(tmp_path / "*.txt"))
    corpus, report = text.load_corpus(str(tmp_path / "*.txt"), skip_invalid=True)
    assert len(corpus) == 1 and report.skipped == {str(tmp_path / "bad.txt"): "not UTF-8"}
    (tmp_path / "good.txt").write_text("   \n")
    with pytest.raises(ValueError, match="empty"):
        text.load_corpus(str(tmp_path / "good.txt"))


def test_stdlib_corpus_is_real_python():
    corpus, report = text.load_corpus("stdlib")
    assert report.documents > 500 and report.characters > 5_000_000
    assert any(source.endswith("/json/decoder.py") for source in corpus["source"])
    assert not any("/encodings/" in source for source in corpus["source"])  # generated codec tables


def test_split_is_seeded_disjoint_and_document_level():
    corpus = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(40)], "source": [str(i) for i in range(40)]})
    train, val = text.split_documents(corpus, 0.25, seed=3)
    assert len(val) == 10 and len(train) == 30
    assert not set(train["source"]) & set(val["source"])
    again, _ = text.split_documents(corpus, 0.25, seed=3)
    assert again["source"] == train["source"]
    assert text.split_documents(corpus, 0.25, seed=4)[0]["source"] != train["source"]
    with pytest.raises(ValueError, match=">= 2 documents"):
        text.split_documents(corpus.select([0]), 0.5, seed=0)


def test_chunking_keeps_every_character_budget(shakespeare):
    corpus = datasets.Dataset.from_dict({"text": [shakespeare[:50_000]], "source": ["s"]})
    chunks = text.chunk_documents(corpus, 300)
    assert all(len(t) <= 300 for t in chunks["text"])
    assert sum(len(t.replace("\n", "")) for t in chunks["text"]) == len(shakespeare[:50_000].replace("\n", ""))


def test_best_fit_packing_invariants(tokenizer, shakespeare):
    corpus = datasets.Dataset.from_dict({"text": [shakespeare[:60_000]], "source": ["s"]})
    tokens = text.tokenize_documents(text.chunk_documents(corpus, 128), tokenizer)  # ~40-token documents
    lengths = [len(ids) for ids in tokens["input_ids"]]
    packed, report = text.pack_best_fit(tokens, max_seq_len=256)
    rows = np.array(packed["input_ids"])
    assert rows.shape == (report.rows, 256)
    assert (rows[:, 0] == tokenizer.bos_token_id).all()  # every row starts with BOS
    assert tokenizer.pad_token_id not in rows  # no padding
    assert report.input_tokens == sum(lengths) == report.packed_tokens + report.cropped_tokens
    assert report.cropped_share < 0.05
    # documents appear whole (BOS to BOS) except the counted crops
    bos = tokenizer.bos_token_id
    pieces = [len(p) for row in rows for p in np.split(row, np.flatnonzero(row == bos)[1:])]
    assert sum(pieces) == rows.size


def test_packing_crops_only_when_nothing_fits():
    documents = datasets.Dataset.from_dict({"input_ids": [[0] + [5] * 9, [0] + [6] * 2, [0] + [7] * 20]})
    packed, report = text.pack_best_fit(documents, max_seq_len=12)
    rows = packed["input_ids"]
    # row 1: the largest that fits (10 tokens); then nothing fits the 2 left, so the shortest (3) is cropped to 2
    assert rows[0] == [0] + [5] * 9 + [0, 6]
    # row 2: the 21-token document fits nowhere and is cropped to the row
    assert rows[1] == [0] + [7] * 11
    assert report.rows == 2 and report.cropped_tokens == 1 + 9 and report.input_tokens == 34


def test_document_position_ids_restart_at_bos():
    ids = torch.tensor([[0, 5, 5, 0, 6, 6, 6], [7, 7, 0, 8, 0, 9, 9]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 0, 1, 2]])
    assert torch.equal(document_position_ids(ids, bos_token_id=0), expected)
    batch = PackedCollator(bos_token_id=0)([{"input_ids": row.tolist()} for row in ids])
    assert torch.equal(batch["labels"], batch["input_ids"]) and torch.equal(batch["position_ids"], expected)
    assert "position_ids" not in PackedCollator(0, attend_across_documents=True)([{"input_ids": [0, 1]}])


def test_bits_per_byte_on_a_hand_computed_case():
    token_bytes_table = torch.tensor([0, 1, 2, 3])  # token 0 is special (0 bytes)
    # one row, targets are labels[1:] = [1, 3, 0, 2]; the special target 0 is left out
    labels = torch.tensor([[2, 1, 3, 0, 2]])
    logits = torch.zeros(1, 5, 4)  # uniform: every target costs ln 4 nats
    nats = BitsPerByte.preprocess_logits_for_metrics(logits, labels)
    torch.testing.assert_close(nats, torch.full((1, 4), math.log(4)))
    metric = BitsPerByte(token_bytes_table)
    result = metric(type("P", (), {"predictions": nats.numpy(), "label_ids": labels.numpy()})())
    # 3 counted targets × ln 4 nats = 3 × 2 bits over 1 + 3 + 2 = 6 bytes -> 1.0 bit per byte
    assert result["bpb"] == pytest.approx(1.0)
