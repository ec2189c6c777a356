"""Tokenizer training and token_bytes; corpora (text, JSONL, parquet, datasets folders, stdlib) read in resumable
batches; the hash split; disjoint streams; the packed stream's bounded buffers and exact resume; best-fit packing."""

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from hfl3.data import packing, sources, streaming
from hfl3.tokenization import BOS_TOKEN, IM_END, IM_START, token_bytes, train_tokenizer
from hfl3.trainers.pretraining.trainer import BitsPerByte, PackedCollator, document_position_ids


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


@pytest.mark.parametrize("name", ["ours", "qwen3", pytest.param("gemma3", marks=pytest.mark.gemma3)])
def test_token_bytes_counts_raw_utf8_bytes(name, tokenizer, assets, gemma3_tokenizer):
    loaded = {"ours": tokenizer, "gemma3": gemma3_tokenizer}
    tok = loaded[name] if name in loaded else AutoTokenizer.from_pretrained(assets / "tokenizers" / name)
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


@pytest.fixture(scope="module")
def paragraphs(shakespeare) -> list[str]:
    return [p for p in shakespeare[:300_000].split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def shard_folder(tmp_path_factory, paragraphs) -> Path:
    """Shakespeare's paragraphs in three parquet shards, one JSONL shard and one text shard (blank-line separated)."""
    folder = tmp_path_factory.mktemp("shards")
    for i in range(3):
        pq.write_table(pa.table({"text": paragraphs[i:1200:4], "n": list(range(len(paragraphs[i:1200:4])))}),
                       folder / f"part{i}.parquet", row_group_size=64)
    with open(folder / "part3.jsonl", "w") as f:
        for text in paragraphs[3:1200:4]:
            f.write(json.dumps({"text": text}) + "\n")
    (folder / "extra.txt").write_text("\n\n".join(paragraphs[1200:1400]))
    return folder


def read_all(shard, position=None, batch_size=16, stride=(1, 0)) -> list[tuple[list[str], dict]]:
    return list(shard.read(position, batch_size, stride))


def test_corpus_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        sources.open_corpus(str(tmp_path / "nothing*.txt"))
    (tmp_path / "good.txt").write_text("hello world\n")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 latin-1\n")
    with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8 \(byte 3\)"):
        sources.open_corpus(str(tmp_path / "*.txt"))
    corpus = sources.open_corpus(str(tmp_path / "*.txt"), skip_invalid=True)
    assert [shard.name for shard in corpus.shards] == ["good.txt"]
    assert corpus.skipped == {"bad.txt": "not UTF-8 (byte 3)"}
    assert corpus.files[0].sha256 == hashlib.sha256(b"hello world\n").hexdigest() and corpus.files[0].bytes == 12
    (tmp_path / "good.txt").write_text("   \n")
    with pytest.raises(ValueError, match="good.txt: empty"):
        sources.open_corpus(str(tmp_path / "good.txt"))


def test_stdlib_corpus_is_real_python():
    corpus = sources.open_corpus("stdlib")
    names = [shard.name for shard in corpus.shards]
    assert len(names) > 1000 and sum(f.bytes for f in corpus.files) > 5_000_000
    assert "json/decoder.py" in names and not any(name.startswith("encodings/") for name in names)
    assert any(reason.startswith("not UTF-8") for reason in corpus.skipped.values())  # the stdlib's mis-encoded tests
    assert not any(name.startswith("/") for name in names)  # no absolute path goes into the metadata
    decoder = next(shard for shard in corpus.shards if shard.name == "json/decoder.py")
    (texts, _), = read_all(decoder)
    assert texts == [Path(decoder.path).read_text()]  # one document per file


TEXT = "first para\nstill first\n\n\nsecond  \n \t\nthird\r\n\r\nfourth<|sep|>fifth\n\n"


@pytest.mark.parametrize("separator, expected", [
    (None, ["first para\nstill first", "second  ", "third\r", "fourth<|sep|>fifth"]),  # one file: blank lines
    ("<|sep|>", [TEXT[:TEXT.index("<|sep|>")], "fifth\n\n"]),
    ("", [TEXT]),
])
def test_a_text_file_splits_into_documents(tmp_path, monkeypatch, separator, expected):
    (tmp_path / "one.txt").write_text(TEXT)
    corpus = sources.open_corpus(str(tmp_path / "one.txt"), document_separator=separator)
    documents = [text for texts, _ in read_all(corpus.shards[0], batch_size=1) for text in texts]
    assert documents == expected
    monkeypatch.setattr(sources, "READ_BYTES", 3)  # separators straddle the read blocks
    assert [t for texts, _ in read_all(corpus.shards[0], batch_size=1) for t in texts] == expected


def test_text_file_resumes_after_every_document(tmp_path, monkeypatch, paragraphs):
    (tmp_path / "a.txt").write_text("\n\n \n".join(paragraphs[:60]))
    shard = sources.open_corpus(str(tmp_path / "a.txt")).shards[0]
    monkeypatch.setattr(sources, "READ_BYTES", 1000)
    batches = read_all(shard, batch_size=7)
    assert [t for texts, _ in batches for t in texts] == [p.strip("\n") for p in paragraphs[:60]]
    for k, (_, position) in enumerate(batches):
        assert read_all(shard, position, batch_size=7) == batches[k + 1:]


def test_folder_mixes_formats_and_every_shard_resumes(shard_folder, paragraphs):
    corpus = sources.open_corpus(str(shard_folder))
    names = [s.name for s in corpus.shards]  # a parquet file has a shard per row group (300 records, 64 a group)
    assert names == ["extra.txt", *(f"part{i}.parquet#{g}" for i in range(3) for g in range(5)), "part3.jsonl"]
    assert [f.name for f in corpus.files] == ["extra.txt", "part0.parquet", "part1.parquet", "part2.parquet",
                                              "part3.jsonl"]
    assert all(len(f.sha256) == 64 for f in corpus.files) and corpus.report()["shards"] == 17
    for index in range(4):
        shards = [s for s in corpus.shards if s.name.startswith(f"part{index}")]
        assert [t for s in shards for texts, _ in read_all(s) for t in texts] == paragraphs[index:1200:4]
    for shard in corpus.shards[1:]:
        batches = read_all(shard, batch_size=16)
        for k in (0, len(batches) // 2):  # resume, then resume again from a position the resumed reading gave
            resumed = read_all(shard, batches[k][1], batch_size=16)
            assert [texts for texts, _ in resumed] == [texts for texts, _ in batches[k + 1:]]
            if len(resumed) > 1:
                again = read_all(shard, resumed[0][1], batch_size=16)
                assert [texts for texts, _ in again] == [texts for texts, _ in batches[k + 2:]]
    # several text files: each is one document
    (shard_folder / "more").mkdir(exist_ok=True)
    for i in range(2):
        (shard_folder / "more" / f"{i}.txt").write_text(f"doc {i}\n\nparagraph two")
    texts = [t for s in sources.open_corpus(str(shard_folder / "more")).shards for b, _ in read_all(s) for t in b]
    assert texts == ["doc 0\n\nparagraph two", "doc 1\n\nparagraph two"]


def test_a_held_out_source_leaves_the_training_corpus(assets):
    folder = assets / "text" / "gutenberg"
    held_out = sources.open_corpus(str(folder / "pg11_alice_in_wonderland.txt"))
    corpus = sources.open_corpus(str(folder), exclude=held_out)
    assert [s.separator for s in held_out.shards] == [sources.BLANK_LINES]  # one file: split at blank lines
    novels = len(list(folder.glob("*.txt")))
    assert len(corpus.shards) == novels - 1 and "pg11_alice_in_wonderland.txt" not in [s.name for s in corpus.shards]
    assert all(s.separator is None for s in corpus.shards)  # files of a folder: whole


def test_a_datasets_folder_is_streamed_shard_by_shard(tmp_path, paragraphs):
    (tmp_path / "repo" / "data").mkdir(parents=True)
    for i in range(2):
        pq.write_table(pa.table({"content": paragraphs[i:400:2]}), tmp_path / "repo" / "data" / f"train-{i}.parquet")
    corpus = sources.open_corpus(str(tmp_path / "repo"), text_column="content")
    files = ["data/train-0.parquet", "data/train-1.parquet"]
    assert len(corpus.shards) == 2 and corpus.datasets == [
        {"name": str(tmp_path / "repo"), "config": None, "split": "train", "shards": 2, "data_files": files}]
    assert [f.name for f in corpus.files] == files
    assert corpus.files[0].sha256 == hashlib.sha256((tmp_path / "repo" / files[0]).read_bytes()).hexdigest()
    texts = sorted(t for s in corpus.shards for b, _ in read_all(s) for t in b)
    assert texts == sorted(paragraphs[:400])
    with pytest.raises(ValueError, match="no column 'text'"):
        sources.open_corpus(str(tmp_path / "repo"))


def test_split_is_seeded_by_content_and_disjoint(paragraphs):
    split = streaming.DocumentSplit(0.2, seed=3)
    held_out = [p for p in paragraphs if split.is_validation(p)]
    assert 0.15 < len(held_out) / len(paragraphs) < 0.25
    assert held_out == [p for p in paragraphs if streaming.DocumentSplit(0.2, seed=3).is_validation(p)]
    assert held_out != [p for p in paragraphs if streaming.DocumentSplit(0.2, seed=4).is_validation(p)]
    with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
        streaming.DocumentSplit(1.0, seed=0)


@pytest.mark.parametrize("num_streams", [1, 2, 7])  # 7 > 5 shards: every stream reads every 7th document
def test_streams_are_disjoint_and_cover_the_training_side(shard_folder, num_streams):
    corpus = sources.open_corpus(str(shard_folder))
    split = streaming.DocumentSplit(0.1, seed=0)
    source = streaming.DocumentSource(corpus, split, seed=0, read_batch=16, epochs=1)
    per_stream = [[t for texts, _, _ in source.batches(i, num_streams) for t in texts] for i in range(num_streams)]
    everything = [t for s in corpus.shards for texts, _ in read_all(s) for t in texts]
    training = [t for t in everything if not split.is_validation(t)]
    assert sorted(t for stream in per_stream for t in stream) == sorted(training)  # disjoint and complete
    assert all(per_stream)
    validation = streaming.DocumentSource(corpus, split, validation=True, shuffle_shards=False, epochs=1)
    assert [t for texts, _, _ in validation.batches() for t in texts] == [t for t in everything
                                                                        if split.is_validation(t)]


def test_shard_order_is_seeded_and_changes_every_pass(shard_folder):
    corpus = sources.open_corpus(str(shard_folder))

    def first_documents(seed):  # the first document of every shard, in reading order, epoch after epoch
        source = streaming.DocumentSource(corpus, seed=seed, read_batch=1000, epochs=2)
        firsts = [texts[0] for texts, _, _ in source.batches()]  # every shard fits one read batch
        return firsts[:len(corpus.shards)], firsts[len(corpus.shards):]

    first, second = first_documents(5)
    assert sorted(first) == sorted(second) and first != second and len(set(first)) == len(corpus.shards)
    assert first_documents(5) == (first, second) and first_documents(6)[0] != first


def test_a_stream_without_documents_is_an_error(tmp_path):
    (tmp_path / "one.txt").write_text("just one document")
    source = streaming.DocumentSource(sources.open_corpus(str(tmp_path / "one.txt")))
    with pytest.raises(ValueError, match="stream 1 of 2 found no training document"):
        for _ in source.batches(1, 2):  # reads and drops the only document, then stops at the end of the epoch
            pass


@pytest.fixture(scope="module")
def packed(shard_folder, tokenizer):
    source = streaming.DocumentSource(sources.open_corpus(str(shard_folder)), streaming.DocumentSplit(0.1, 0),
                                      seed=0, read_batch=16)
    return streaming.PackedStream(source, tokenizer, max_seq_len=64, document_max_chars=200, packing_buffer=30,
                                  shuffle_buffer=50)


def test_stream_rows_are_bos_aligned_and_buffers_bounded(packed, tokenizer):
    reader = packed.reader(0, 2)
    rows = np.stack([reader.next_row() for _ in range(1500)])  # more than one epoch over this stream's shards
    assert rows.shape == (1500, 64) and (rows[:, 0] == tokenizer.bos_token_id).all()
    assert reader.position["epoch"] >= 1 and len(reader.packer) <= 30
    assert len(reader.documents) < 50 + 16 * 10  # one read batch of 16 documents adds a few pieces each
    report = reader.packer.report
    assert report.packed_tokens == rows.size and report.rows == 1500 and report.documents > 1500


def test_stream_resumes_exactly_from_a_snapshot(packed, tmp_path):
    reader = packed.reader(1, 2)
    progress = streaming.StreamProgress(packed.fingerprint(), rank=0, world_size=1, workers=2)
    for batch in range(9):  # the main process rebuilds the snapshot from what each batch carries
        rows = np.stack([reader.next_row() for _ in range(4 + batch)])
        progress.consume(streaming.WorkerState(1, reader.update()), torch.from_numpy(rows.astype(np.int64)))
    snapshot = reader.snapshot()
    assert progress.worker_snapshots()[1]["meta"] == snapshot["meta"]
    expected = [reader.next_row() for _ in range(80)]
    resumed = packed.reader(1, 2, snapshot)
    assert all((a == b).all() for a, b in zip(expected, (resumed.next_row() for _ in range(80))))
    # the rebuilt snapshot, through a checkpoint file
    progress.save(tmp_path)
    loaded = streaming.StreamProgress.load(tmp_path, packed.fingerprint(), rank=0, world_size=1, workers=2)
    assert (loaded.batches, loaded.sha256) == (9, progress.sha256)
    again = packed.reader(1, 2, loaded.worker_snapshots()[1])
    assert all((a == b).all() for a, b in zip(expected, (again.next_row() for _ in range(80))))
    with pytest.raises(ValueError, match="resume with the same numbers"):
        streaming.StreamProgress.load(tmp_path, packed.fingerprint(), rank=0, world_size=1, workers=3)
    with pytest.raises(ValueError, match="differs in: max_seq_len"):
        streaming.StreamProgress.load(tmp_path, {**packed.fingerprint(), "max_seq_len": 32}, 0, 1, 2)


def test_updates_carry_about_a_batch_of_tokens(packed):
    """A batch's state update holds the buffers by key and the pieces new since the previous batch, not the buffers'
    tokens: its size follows the batch, not the buffers."""
    reader = streaming.PackedStream(packed.source, packed.tokenizer, 64, 200, packing_buffer=500,
                                    shuffle_buffer=500).reader()
    reader.next_row()
    reader.update()
    buffered = sum(len(tokens) for _, tokens in reader.snapshot()["buffers"]["packer"])
    for _ in range(8):
        reader.next_row()
    new = sum(len(tokens) for tokens in reader.update()["new"].values())
    assert 0 < new < buffered / 4  # 8 rows of 64 tokens and what a read batch of 16 documents adds
    for _ in range(3000):  # without update() calls the reader remembers no more than its buffers
        reader.next_row()
    assert len(reader._arrived) <= 2 * (500 + 500) + 16 * 10


def test_samples_for_tokenizer_and_allocation_are_bounded(packed):
    texts = list(packed.source.sample_texts(5000))
    assert sum(map(len, texts)) == 5000
    documents = packed.sample_documents(3000)
    assert 3000 <= sum(map(len, documents)) < 3000 + max(map(len, documents))


def test_chunking_keeps_every_character_budget(shakespeare):
    pieces = list(packing.chunk_text(shakespeare[:50_000], 300))
    assert all(len(p) <= 300 for p in pieces)
    assert sum(len(p.replace("\n", "")) for p in pieces) == len(shakespeare[:50_000].replace("\n", ""))
    assert list(packing.chunk_text("whole\n\ntext", 0)) == ["whole\n\ntext"]


def pack_all(documents: list[list[int]], max_seq_len: int) -> tuple[np.ndarray, packing.PackingReport]:
    """Every document, in order, through one `BestFitPacker` until it runs dry (as `PackedStream.materialize` reads
    a finite stream): the rows `(rows, max_seq_len)` and the packer's report."""
    packer = packing.BestFitPacker(max_seq_len)
    pending = enumerate(np.asarray(document, dtype=np.int64) for document in documents)
    rows = []
    while (row := packer.next_row(lambda: next(pending, None))) is not None:
        rows.append(row)
    return np.array(rows).reshape(-1, max_seq_len), packer.report


def test_best_fit_packing_invariants(tokenizer, shakespeare):
    pieces = list(packing.chunk_text(shakespeare[:60_000], 128))
    bos = tokenizer.bos_token_id
    documents = [[bos, *ids] for ids in tokenizer(pieces, add_special_tokens=False)["input_ids"]]  # ~40 tokens each
    lengths = [len(ids) for ids in documents]
    rows, report = pack_all(documents, max_seq_len=256)
    assert rows.shape == (report.rows, 256)
    assert (rows[:, 0] == tokenizer.bos_token_id).all()  # every row starts with BOS
    assert tokenizer.pad_token_id not in rows  # no padding
    assert report.input_tokens == sum(lengths) == report.packed_tokens + report.cropped_tokens
    assert report.documents == len(lengths) and report.cropped_share < 0.05
    # documents appear whole (BOS to BOS) except the counted crops
    pieces = [len(p) for row in rows for p in np.split(row, np.flatnonzero(row == bos)[1:])]
    assert sum(pieces) == rows.size


def test_packing_crops_only_when_nothing_fits():
    rows, report = pack_all([[0] + [5] * 9, [0] + [6] * 2, [0] + [7] * 20], max_seq_len=12)
    # row 1: the largest that fits (10 tokens); then nothing fits the 2 left, so the shortest (3) is cropped to 2
    assert rows[0].tolist() == [0] + [5] * 9 + [0, 6]
    # row 2: the 21-token document fits nowhere and is cropped to the row
    assert rows[1].tolist() == [0] + [7] * 11
    assert report.rows == 2 and report.cropped_tokens == 1 + 9 and report.input_tokens == 34


def test_document_position_ids_restart_at_bos():
    ids = torch.tensor([[0, 5, 5, 0, 6, 6, 6], [7, 7, 0, 8, 0, 9, 9]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 0, 1, 2]])
    assert torch.equal(document_position_ids(ids, bos_token_id=0), expected)
    batch = PackedCollator(bos_token_id=0)([{"input_ids": row.tolist()} for row in ids])
    assert torch.equal(batch["labels"], batch["input_ids"]) and torch.equal(batch["position_ids"], expected)
    assert "position_ids" not in PackedCollator(0, attend_across_documents=True)([{"input_ids": [0, 1]}])
    state = streaming.WorkerState(1, {})
    streamed = PackedCollator(bos_token_id=0)(streaming.StreamBatch(ids.numpy().astype(np.uint16), state))
    assert torch.equal(streamed["input_ids"], ids) and streamed["input_ids"].dtype == torch.long
    assert torch.equal(streamed["position_ids"], expected) and streamed["data_state"] is state


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
