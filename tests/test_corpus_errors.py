"""Pretraining corpora never lose data silently: a file its reader would stop on is found when the corpus is opened
(one line naming it, the problem and --skip_invalid_files; or skipped and listed with the reason), for every format;
records left out while streaming are counted by reason, through a resume and across streams; compressed files are
read; a corpus too small for its validation split stops before any work is done on it."""

import bz2
import codecs
import collections
import gzip
import hashlib
import io
from pathlib import Path
import json
import lzma
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hfl3.data import sources, streaming
from hfl3.errors import InputError
from hfl3.tokenization import train_tokenizer

SEPARATOR = "<|sep|>"


@pytest.fixture(scope="module")
def paragraphs(assets) -> list[str]:
    """Distinct Tiny Shakespeare paragraphs (no blank line inside), in order."""
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:200_000]
    return list(dict.fromkeys(p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()))


@pytest.fixture(scope="module")
def tokenizer(assets):
    return train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]], 512)


def jsonl(records: list) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def parquet(columns: dict, row_group_size: int = 64) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table(columns), sink, row_group_size=row_group_size)
    return sink.getvalue()


def arrow(columns: dict) -> bytes:
    table, sink = pa.table(columns), io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=16)
    return sink.getvalue()


# (file name, its bytes made from real paragraphs, the problem as the error line and the report give it)
FILE_PROBLEMS = [
    ("empty.jsonl", lambda p: b"", r"empty \(no JSON record\)"),
    ("blank.jsonl", lambda p: b"\n  \n\n", r"empty \(no JSON record\)"),
    ("binary.jsonl", lambda p: bytes(range(256)), r"not UTF-8 \(byte 128\)"),
    ("truncated.jsonl", lambda p: jsonl([{"text": t} for t in p[:10]]) + b'{"text": "Cut sho',
     r"line 11: not valid JSON \(Unterminated string starting at: column 10\)"),
    ("number.jsonl", lambda p: jsonl([{"text": t} for t in p[:3]] + [{"text": 12}] + [{"text": t} for t in p[3:9]]),
     r"line 4: 'text' is a JSON number, not a string"),
    ("list-line.jsonl", lambda p: jsonl([{"text": p[0]}, [p[1], p[2]]]),
     r"line 2: a JSON array where a record \(object\) is expected"),
    ("other-field.jsonl", lambda p: jsonl([{"content": t, "id": i} for i, t in enumerate(p[:5])]),
     r"no record has a field 'text' \(fields: content, id\); set --text_column"),
    ("no-text.jsonl", lambda p: jsonl([{"text": None}, {"text": ""}, {"text": " \n\t"}, {"title": p[0]}]),
     r"no record has text in 'text' \(all null, empty or blank\)"),
    ("broken-array.json", lambda p: json.dumps([{"text": t} for t in p[:4]]).encode()[:-30],
     r"not valid JSON \(.*: line 1 column \d+\)"),
    ("strings-array.json", lambda p: json.dumps(p[:4]).encode(), r"record 1: a JSON string where a record"),
    ("other-column.parquet", lambda p: parquet({"content": p[:100]}),
     r"no column 'text' \(columns: content\); set --text_column"),
    ("numbers.parquet", lambda p: parquet({"text": list(range(100))}), r"column 'text' holds .*int64.*, not strings"),
    ("no-rows.parquet", lambda p: parquet({"text": pa.array([], pa.string())}), r"empty \(no row\)"),
    ("corrupt.parquet", lambda p: b"PAR1" + "".join(p[:5]).encode(), r"not a readable parquet file \(.*\)"),
    ("truncated.arrow", lambda p: arrow({"text": p[:100]})[:3000], r"not a readable arrow file \(.*\)"),
    ("other-column.arrow", lambda p: arrow({"content": p[:100]}), r"no column 'text' \(columns: content\)"),
    ("truncated.jsonl.gz", lambda p: gzip.compress(jsonl([{"text": t} for t in p[:100]]))[:-40],
     r"not valid gzip data \(Compressed file ended before the end-of-stream marker was reached\)"),
    ("not-gzip.txt.gz", lambda p: "\n\n".join(p[:20]).encode(), r"not valid gzip data \(Not a gzipped file .*\)"),
    ("latin-1.txt.xz", lambda p: lzma.compress("café crème".encode("latin-1")), r"not UTF-8 \(byte 3\)"),
    ("blank.txt.bz2", lambda p: bz2.compress(b" \n\n\t\n"), "empty"),
    ("records.jsonl.zst", lambda p: b"\x28\xb5\x2f\xfd" + jsonl(p[:5]),
     r"zstd data \(\.zst\), which hfl3 does not read: decompress it, or compress it with gzip, bzip2 or xz"),
    ("records.parquet.gz", lambda p: gzip.compress(parquet({"text": p[:100]})),
     r"a compressed \.parquet file, which is not read: decompress it"),
]


@pytest.mark.parametrize("name, content, problem", FILE_PROBLEMS, ids=[case[0] for case in FILE_PROBLEMS])
def test_a_file_its_reader_would_stop_on_is_refused_or_skipped_when_opened(tmp_path, caplog, paragraphs, name,
                                                                            content, problem):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(paragraphs[0])
    (folder / name).write_bytes(content(paragraphs))
    with pytest.raises(InputError, match=rf"^{re.escape(str(folder / name))}: {problem}.*; fix or remove it, or pass "
                                         r"--skip_invalid_files$") as refused:
        sources.open_corpus(str(folder))
    assert "\n" not in str(refused.value)  # one line
    with caplog.at_level("WARNING", logger="hfl3.data.sources"):
        corpus = sources.open_corpus(str(folder), skip_invalid=True)
    assert list(corpus.report()["skipped_files"]) == [name] and re.match(problem, corpus.skipped[name])
    assert [shard.name for shard in corpus.shards] == [f.name for f in corpus.files] == ["good.txt"]
    assert f"skipped 1 file(s), all listed with the reason in the metadata: {name}: " in caplog.text


def test_files_a_folder_holds_with_another_suffix_are_counted_and_listed(tmp_path, caplog, paragraphs):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text(paragraphs[0])
    (folder / "more.jsonl").write_bytes(jsonl([{"text": paragraphs[1]}]))
    (folder / "blob.bin").write_bytes(bytes(range(256)))
    (folder / "README.md").write_text(paragraphs[2])
    (folder / "sub").mkdir()  # a folder inside is not a file of the entry
    with caplog.at_level("WARNING", logger="hfl3.data.sources"):
        corpus = sources.open_corpus(str(folder))
    assert [f.name for f in corpus.files] == ["good.txt", "more.jsonl"]
    skipped = corpus.report()["skipped_files"]  # what metadata.json lists
    assert list(skipped) == ["README.md", "blob.bin"]
    assert skipped["blob.bin"].startswith("not read: a folder's .txt, .py, .jsonl, .json, .parquet, .arrow files are "
                                          "read") and skipped["blob.bin"].endswith("its suffix is .bin")
    assert "skipped 2 file(s), all listed with the reason in the metadata: README.md: not read" in caplog.text


def write_records(path, paragraphs: list[str]) -> list[str]:
    """399 records at `path` in its format, 3 of them without text (the first, the 200th and the last): two missing
    or null (a text file: blank pieces between separators instead), one blank. Returns the 396 texts in order."""
    texts = paragraphs[:396]
    if ".txt" in path.name:  # separators at both ends delimit nothing: not counted
        data = SEPARATOR + SEPARATOR.join([" ", *texts[:199], "", *texts[199:], "\n \n"]) + SEPARATOR + "\n"
        data = data.encode()
    elif ".jsonl" in path.name:
        data = jsonl([{"title": "no text field"}, *({"text": t} for t in texts[:199]), {"text": None},
                      *({"text": t} for t in texts[199:]), {"text": " \n"}])
    else:
        data = parquet({"text": [None, *texts[:199], None, *texts[199:], " \n"]})
    compress = {".gz": gzip.compress, ".xz": lzma.compress}.get(path.suffix, bytes)
    path.write_bytes(compress(data))
    return texts


STREAM_FORMATS = [  # (file name, what its reader counts besides the 396 documents)
    ("records.jsonl", {"missing_text": 2, "empty_text": 1}),
    ("records.jsonl.gz", {"missing_text": 2, "empty_text": 1}),
    ("records.parquet", {"missing_text": 2, "empty_text": 1}),
    ("records.txt", {"missing_text": 0, "empty_text": 3}),
    ("records.txt.xz", {"missing_text": 0, "empty_text": 3}),
]


@pytest.mark.parametrize("name, dropped", STREAM_FORMATS, ids=[case[0] for case in STREAM_FORMATS])
def test_records_without_text_are_counted_by_reason(tmp_path, caplog, paragraphs, tokenizer, name, dropped):
    texts = write_records(tmp_path / name, paragraphs)
    corpus = sources.open_corpus(str(tmp_path / name), document_separator=SEPARATOR)
    source = streaming.DocumentSource(corpus, read_batch=16, shuffle_shards=False, epochs=1)
    assert [t for batch, _, _ in source.batches() for t in batch] == texts
    with caplog.at_level("INFO", logger="hfl3.data.streaming"):
        _, _, counts = streaming.PackedStream(source, tokenizer, max_seq_len=64, shuffle_buffer=0).materialize(10_000)
    assert counts == {"documents": 396, "held_out": 0, "duplicates": 0, **dropped}
    assert f"dropped 0 document(s) repeating an earlier one of their shard, {dropped['missing_text']} without text " \
           f"(missing or null), {dropped['empty_text']} empty" in caplog.text


def drain(reader: streaming.StreamReader) -> dict:
    while reader.next_row() is not None:
        pass
    return reader.counts


def test_the_counts_add_up_over_streams_and_survive_a_resume(tmp_path, paragraphs, tokenizer):
    write_records(tmp_path / "records.parquet", paragraphs)
    corpus = sources.open_corpus(str(tmp_path / "records.parquet"))
    assert len(corpus.shards) == 7  # 399 rows, 64 a row group
    source = streaming.DocumentSource(corpus, streaming.DocumentSplit(0.1, seed=0), seed=0, read_batch=16, epochs=1)
    packed = streaming.PackedStream(source, tokenizer, max_seq_len=64, packing_buffer=8, shuffle_buffer=8)
    for num_streams in (1, 3, 9):  # 9 streams > 7 shards: every stream reads every shard, keeping every 9th record
        total = collections.Counter()
        for stream in range(num_streams):
            total.update(drain(packed.reader(stream, num_streams)))
        assert (total["missing_text"], total["empty_text"], total["documents"] + total["held_out"]) == (2, 1, 396)
    whole = drain(packed.reader())
    reader = packed.reader()
    progress = streaming.StreamProgress(packed.fingerprint(), rank=0, world_size=1, workers=1)
    for _ in range(15):  # 60 of 181 rows
        rows = np.stack([reader.next_row() for _ in range(4)]).astype(np.int64)
        progress.consume(streaming.WorkerState(0, reader.update()), torch.from_numpy(rows))
    progress.save(tmp_path)
    loaded = streaming.StreamProgress.load(tmp_path, packed.fingerprint(), rank=0, world_size=1, workers=1)
    assert loaded.summary() == progress.summary()
    counted = (loaded.summary()["missing_text_documents"], loaded.summary()["empty_text_documents"])
    assert counted == (1, 0)  # guard: one record without text is behind the checkpoint, two are ahead
    assert drain(packed.reader(0, 1, loaded.worker_snapshots()[0])) == whole  # counted on, as without the resume
    assert (whole["missing_text"], whole["empty_text"]) == (2, 1)


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.json.bz2", "c.jsonl.xz", "c.txt.gz", "c.txt.bz2"])
def test_compressed_files_are_read_and_resume(tmp_path, paragraphs, name):
    texts = paragraphs[:100]
    data = jsonl([{"text": t} for t in texts]) if ".json" in name else SEPARATOR.join(texts).encode()
    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[name[name.rindex("."):]]
    (tmp_path / name).write_bytes(compress(data))
    corpus = sources.open_corpus(str(tmp_path / name), document_separator=SEPARATOR)
    assert corpus.files[0].sha256 == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()  # the file as stored
    shard, = corpus.shards
    batches = list(shard.read(None, 16))
    assert [t for batch, _ in batches for t in batch] == texts
    for k in (0, 3):
        assert [batch for batch, _ in shard.read(batches[k][1], 16)] == [batch for batch, _ in batches[k + 1:]]


def test_a_bad_data_file_of_a_datasets_folder_is_refused_or_skipped(tmp_path, paragraphs):
    (tmp_path / "repo" / "data").mkdir(parents=True)
    (tmp_path / "repo" / "data" / "train-0.jsonl").write_bytes(jsonl([{"text": t} for t in paragraphs[:50]]))
    (tmp_path / "repo" / "data" / "train-1.jsonl").write_bytes(jsonl([{"text": "one"}, {"text": "two"}, {"text": 3}]))
    with pytest.raises(InputError, match=r"train-1\.jsonl: line 3: 'text' is a JSON number, not a string; fix or "
                                         "remove it, or pass --skip_invalid_files"):
        sources.open_corpus(str(tmp_path / "repo"))
    corpus = sources.open_corpus(str(tmp_path / "repo"), skip_invalid=True)
    assert corpus.skipped == {"data/train-1.jsonl": "line 3: 'text' is a JSON number, not a string"}
    assert corpus.datasets[0]["data_files"] == [f.name for f in corpus.files] == ["data/train-0.jsonl"]
    assert [t for shard in corpus.shards for batch, _ in shard.read(None, 16) for t in batch] == paragraphs[:50]


def test_a_non_string_text_met_while_streaming_is_one_line(tmp_path, paragraphs):
    """A `datasets` source whose features were not checked when it was opened (as a Hub dataset's may be)."""
    (tmp_path / "mixed.jsonl").write_bytes(jsonl([{"text": paragraphs[0]}, {"text": None}, {"text": 12}]))
    shard, = sources.DatasetsSource("json", "mixed.jsonl", "text", data_files=(str(tmp_path / "mixed.jsonl"),)).shards()
    with pytest.raises(InputError, match=r"^mixed\.jsonl: record 3: its text is int 12, not a string; set "
                                         r"--text_column to a text field$"):
        list(shard.read(None, 16))


def test_a_corpus_too_small_for_the_validation_split_stops_before_any_work(tmp_path, paragraphs, tokenizer):
    (tmp_path / "small.txt").write_text("\n\n".join(paragraphs[:3]))
    corpus = sources.open_corpus(str(tmp_path / "small.txt"))
    split = streaming.DocumentSplit(0.05, seed=0)
    assert not any(split.is_validation(p) for p in paragraphs[:3])  # guard: the split holds none of them out
    validation = streaming.DocumentSource(corpus, split, validation=True, shuffle_shards=False, epochs=1)
    line = (rf"^stream 0 of 1 found no validation document in 1 shard\(s\) of '{re.escape(str(tmp_path))}/small\.txt' "
            r"\(read: 3 on the training side\); raise --val_fraction or pass --eval_dataset$")
    with pytest.raises(InputError, match=line):
        validation.require_document()  # before a tokenizer is trained on the training side
    assert streaming.DocumentSource(corpus, split).require_document() == paragraphs[0]
    with pytest.raises(InputError, match=line):  # the same line where the validation rows are packed
        streaming.PackedStream(validation, tokenizer, max_seq_len=64).materialize(16)


# ---- folders, byte order marks, repeats ------------------------------------------------------------------------------

BOM = codecs.BOM_UTF8


@pytest.mark.parametrize("files", [["notes.md", "README.md"], ["BOOK.TXT"], ["a.md", "b.TXT"]])
def test_a_folder_without_readable_files_says_which_suffixes_are_read(tmp_path, files):
    for name in files:
        (tmp_path / name).write_text("some text\n")
    found = ", ".join(sorted({Path(name).suffix for name in files}))
    with pytest.raises(FileNotFoundError, match=r"matches no file: a --dataset entry reads \.txt, \.py, \.jsonl, "
                                                rf"\.json, \.parquet, \.arrow files \(suffixes are case-sensitive\).*holds "
                                                rf"{found}: rename or convert the files"):
        sources.open_corpus(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"holds {found}: rename"):
        sources.open_corpus(str(tmp_path / "*.txt"))


def read_documents(spec: str, **kwargs) -> list[str]:
    corpus = sources.open_corpus(spec, **kwargs)
    return [text for shard in corpus.shards for texts, _ in shard.read(None, 4) for text in texts]


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "one.txt").write_bytes(BOM + b"first\n\nsecond\n")
    assert read_documents(str(tmp_path / "one.txt")) == ["first", "second\n"]
    (tmp_path / "c.jsonl").write_bytes(BOM + b'{"text": "first"}\n' + b'{"text": "second"}\n')
    assert read_documents(str(tmp_path / "c.jsonl")) == ["first", "second"]
    (tmp_path / "only.txt").write_bytes(BOM + b"\n")
    with pytest.raises(ValueError, match=r"only\.txt: empty"):
        sources.open_corpus(str(tmp_path / "only.txt"))


def test_identical_files_are_left_out_and_listed(tmp_path):
    (tmp_path / "data").mkdir()
    for name, text in [("data/a.txt", "alpha"), ("data/b.txt", "beta"), ("data/c.txt", "alpha"), ("held.txt", "beta")]:
        (tmp_path / name).write_text(text)
    corpus = sources.open_corpus(str(tmp_path / "data"))
    assert [s.name for s in corpus.shards] == ["a.txt", "b.txt"]
    assert corpus.report()["duplicate_files"] == {"c.txt": "a.txt"}
    held_out = sources.open_corpus(str(tmp_path / "held.txt"))
    corpus = sources.open_corpus(str(tmp_path / "data"), exclude=held_out)
    assert corpus.duplicates == {"b.txt": "held.txt (held out)", "c.txt": "a.txt"}  # no eval text in training


def test_repeated_documents_are_dropped_per_shard_and_resume_exactly(tmp_path, paragraphs):
    unique = paragraphs[:40]
    documents = unique[:30] + unique[5:12] + unique[30:] + unique[:3]  # 10 repeats inside the one shard
    (tmp_path / "book.txt").write_text("\n\n".join(documents))
    source = streaming.DocumentSource(sources.open_corpus(str(tmp_path / "book.txt")), read_batch=4,
                                      shuffle_shards=False, epochs=2)
    batches = list(source.batches())
    assert [t for texts, _, _ in batches for t in texts] == unique + unique  # every epoch drops the same repeats
    assert sum(skipped["duplicates"] for _, skipped, _ in batches) == 2 * 10
    for k in (3, 9, 14):  # resume mid-shard after batch k: the repeats before it are remembered by replaying
        assert list(source.batches(position=batches[k][2])) == batches[k + 1:]
    kept_all = streaming.DocumentSource(source.corpus, read_batch=4, shuffle_shards=False, epochs=1, deduplicate=False)
    assert [t for texts, _, _ in kept_all.batches() for t in texts] == documents


def test_the_stream_counts_repeats_and_its_fingerprint_names_the_filter(tmp_path, paragraphs, tokenizer):
    (tmp_path / "book.txt").write_text("\n\n".join(paragraphs[:50] * 2))
    source = streaming.DocumentSource(sources.open_corpus(str(tmp_path / "book.txt")), read_batch=8, epochs=1)
    packed = streaming.PackedStream(source, tokenizer, max_seq_len=64, shuffle_buffer=0)
    _, _, counts = packed.materialize(10_000)
    assert counts == {"documents": 50, "held_out": 0, "duplicates": 50, "missing_text": 0, "empty_text": 0}
    assert packed.fingerprint()["deduplicate"] == "within shards"
