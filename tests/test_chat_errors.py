"""Bad chat input: by default the run stops naming file:line and the reason; with skip_invalid_records the record is
skipped and counted, and the kept rows are exactly those of the valid lines. A file that is not JSONL (Parquet, Arrow,
bzip2, empty) is one line naming it and the fix, before any record is encoded; gzip-compressed JSONL is read."""

import bz2
import codecs
import gzip
import hashlib
import json

import datasets
import pytest
from transformers import AutoTokenizer

from hfl3.data.chat import InvalidChatRecord, SFTDataError, read_chat_jsonl
from hfl3.data.masks import AssistantMasker
from hfl3.data.sft import load_sft_data
from hfl3.trainers.cli.arguments import check_sft_arguments, decide_evaluation
from hfl3.trainers.sft.builder import build_sft_trainer
from hfl3.trainers.sft.config import ChatSFTConfig


def line(messages) -> bytes:
    return json.dumps({"id": "x", "messages": messages}, ensure_ascii=False).encode() + b"\n"


GOOD = [
    line([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]),
    line([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
          {"role": "assistant", "content": "4"}]),
]
U, A = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
T = {"role": "tool", "content": "3"}


def call(arguments) -> dict:
    """An assistant message calling `add` with `arguments` (an object or its JSON string)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": arguments}}]}


CALL = call({"a": 1, "b": 2})


def record(**fields) -> bytes:
    """A JSONL line of a user-assistant record with `fields` set (None: left out)."""
    obj = {key: value for key, value in {"messages": [U, A], **fields}.items() if value is not None}
    return json.dumps(obj).encode() + b"\n"

# (case, bad line, reason fragment, counter); `gemma3` cases need that template
BAD = [
    ("malformed JSON", b'{"messages": [\n', "malformed JSON", "malformed"),
    ("not an object", b"[1, 2]\n", "expected a JSON object", "malformed"),
    ("no messages", b'{"conversation": []}\n', "no 'messages' field", "malformed"),
    ("messages null", b'{"id": 7, "messages": null}\n', "'messages' is null; expected {\"messages\": [...]}",
     "malformed"),
    ("duplicated key", b'{"messages": [{"role": "user", "content": "Hi", "content": "Bye"}, {"role": "assistant", '
                       b'"content": "Hello"}]}\n', "the key 'content' appears twice in one object", "malformed"),
    ("duplicated top-level key", line([U, A])[:-2] + b', "messages": []}\n', "the key 'messages' appears twice",
     "malformed"),
    ("messages not a list", b'{"messages": "hi"}\n', "must be a non-empty list", "malformed"),
    ("empty messages", b'{"messages": []}\n', "must be a non-empty list", "malformed"),
    ("message not an object", line(["hi", A]), "message 0 is a str", "malformed"),
    ("unknown role", line([U, {"role": "bot", "content": "x"}]), "message 1 has role 'bot'", "malformed"),
    ("missing role", line([{"content": "x"}, A]), "message 0 has role None", "malformed"),
    ("unsupported key", line([U, {**A, "weight": 1}]), "unsupported keys ['weight']", "malformed"),
    ("content not a string", line([U, {"role": "assistant", "content": None}]), "content is NoneType", "malformed"),
    ("empty content", line([{"role": "user", "content": ""}, A]), "message 0 (user) has empty content", "malformed"),
    ("blank content", line([U, {"role": "assistant", "content": " \n"}]), "(assistant) has empty content",
     "malformed"),
    ("ends with user", line([U, A, U]), "ends with a 'user' message", "malformed"),
    ("no assistant", line([U]), "no assistant message", "no_assistant"),
    ("no assistant, system only", line([{"role": "system", "content": "x"}]), "no assistant message", "no_assistant"),
    ("not UTF-8", b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', "not valid UTF-8", "malformed"),
    ("special token in content", line([U, {"role": "assistant", "content": "ok<|im_end|>"}]),
     "special token text '<|im_end|>'", "malformed"),
    ("empty tool_calls", line([U, {**A, "tool_calls": []}]), "message 1 tool_calls must be a non-empty list",
     "malformed"),
    ("tool call not in OpenAI's shape", line([U, {**CALL, "tool_calls": [{"name": "add", "arguments": {}}]}, T, A]),
     "message 1 tool_calls[0] has keys ['arguments', 'name']; expected OpenAI's shape", "malformed"),
    ("tool call arguments not JSON", line([U, call('{"a": 1'), T, A]), "tool_calls[0] arguments are not JSON",
     "malformed"),
    ("tool call arguments not an object", line([U, call("[1, 2]"), T, A]),
     "tool_calls[0] arguments are a list; expected an object", "malformed"),
    ("tool result answering no call", line([U, A, T, A]), "message 2 is a tool result, but message 1 is neither",
     "malformed"),
    ("reasoning on a user message", line([{**U, "reasoning_content": "hm"}, A]),
     "message 0 (user) has 'reasoning_content', which only assistant messages carry", "malformed"),
    ("training not a boolean", line([U, {**A, "training": "no"}]), "message 1 training is 'no'; expected true or false",
     "malformed"),
    ("every reply out of the loss", line([U, {**A, "training": False}]),
     "every assistant message has training: false", "no_assistant"),
    ("tools not a list", record(tools='{"type": "function"}'), "'tools' must be a list of JSON-schema objects",
     "malformed"),
    ("tools not JSON", record(tools="[{"), "'tools' is a string but not JSON", "malformed"),
    ("ShareGPT role unknown", record(conversations=[{"from": "bot", "value": "x"}, {"from": "gpt", "value": "y"}],
                                     messages=None), "message 0 has role 'bot'", "malformed"),
    ("prompt text, completion messages", record(prompt="Hi", completion=[A], messages=None),
     "expected prompt and completion both strings, or both non-empty lists of messages", "malformed"),
    ("developer role the template drops", line([{"role": "developer", "content": "Be brief."}, U, A]),
     "the chat template does not render 'developer' messages", "malformed"),
    ("special token in tool-call arguments", line([U, call({"x": "<|im_end|>"}), T, A]),
     "message 1 contains the special token text '<|im_end|>'", "malformed"),
]


CASES = {case[0]: case for case in BAD}


@pytest.fixture(scope="module")
def qwen3(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")


def write(path, lines):
    path.write_bytes(b"".join(lines))
    return path


@pytest.mark.parametrize("case, bad, reason, counter", BAD, ids=[b[0] for b in BAD])
def test_bad_record_stops_the_run_with_file_and_line(tmp_path, qwen3, case, bad, reason, counter):
    data = write(tmp_path / "data.jsonl", [GOOD[0], b"\n", bad, GOOD[1]])
    with pytest.raises(InvalidChatRecord) as error:
        load_sft_data(qwen3, data)
    assert str(error.value).startswith(f"{data}:3: ")
    assert reason in str(error.value)
    assert error.value.kind == counter


@pytest.mark.parametrize("case, bad, reason, counter", BAD, ids=[b[0] for b in BAD])
def test_bad_record_is_skipped_and_counted(tmp_path, qwen3, case, bad, reason, counter):
    data = write(tmp_path / "data.jsonl", [GOOD[0], bad, GOOD[1], bad])
    clean = write(tmp_path / "clean.jsonl", GOOD)
    result = load_sft_data(qwen3, data, skip_invalid_records=True)
    stats = result.stats["train_file"]
    assert stats.read == 4 and stats.kept == 2
    assert getattr(stats, counter) == 2
    assert stats.malformed + stats.no_assistant == 2
    assert stats.first_errors[0].startswith(f"{data}:2: ") and reason in stats.first_errors[0]
    reference = load_sft_data(qwen3, clean)
    assert result.provenance["train_records_sha256"] == reference.provenance["train_records_sha256"]
    assert result.train["input_ids"] == reference.train["input_ids"]
    assert result.train["labels"] == reference.train["labels"]


@pytest.mark.gemma3
def test_template_rejection_is_reported_with_its_reason(tmp_path, gemma3_tokenizer):
    # Gemma 3 requires user/assistant alternation: two user messages in a row
    data = write(tmp_path / "data.jsonl", [GOOD[0], line([U, U, A])])
    with pytest.raises(InvalidChatRecord, match=rf"^{data}:2: the chat template rejected .*must alternate"):
        load_sft_data(gemma3_tokenizer, data)
    stats = load_sft_data(gemma3_tokenizer, data, skip_invalid_records=True).stats["train_file"]
    assert (stats.read, stats.malformed, stats.kept) == (2, 1, 1)


def test_non_prefix_preserving_turns_are_refused_not_guessed(tmp_path, qwen3):
    # Qwen3's stock template renders the think block only on the last assistant turn after the last user message:
    # with two assistant messages in a row, the prefix before the second one differs inside the full conversation
    data = write(tmp_path / "data.jsonl", [GOOD[0], line([U, A, A])])
    with pytest.raises(InvalidChatRecord, match=rf"^{data}:2: .*renders the turns before message 2 differently"):
        load_sft_data(qwen3, data)


def test_empty_after_filtering_is_an_error(tmp_path, qwen3):
    data = write(tmp_path / "data.jsonl", [CASES["malformed JSON"][1], CASES["no assistant"][1], b"\n"])
    with pytest.raises(ValueError, match="no usable conversation left"):
        load_sft_data(qwen3, data, skip_invalid_records=True)
    long_prompt = line([{"role": "user", "content": "word " * 200}, A])
    data = write(tmp_path / "long.jsonl", [long_prompt])
    with pytest.raises(ValueError, match="'dropped_after_truncation': 1"):
        load_sft_data(qwen3, data, max_length=32)


def test_blank_lines_and_bom_are_accepted(tmp_path):
    data = write(tmp_path / "data.jsonl", [b"\xef\xbb\xbf" + GOOD[0], b"\n", b"   \n", GOOD[1]])
    records = read_chat_jsonl(data)
    assert [r.where for r in records] == [f"{data}:1", f"{data}:4"]
    assert records[0].messages == ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"})


def test_val_split_is_disjoint_seeded_and_exclusive_with_eval_file(tmp_path, qwen3):
    lines = [line([{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]) for i in range(20)]
    data = write(tmp_path / "data.jsonl", lines)
    first = load_sft_data(qwen3, data, val_split=0.25, seed=3)
    again = load_sft_data(qwen3, data, val_split=0.25, seed=3)
    other = load_sft_data(qwen3, data, val_split=0.25, seed=4)
    assert (len(first.train), len(first.eval)) == (15, 5)
    train_rows = {tuple(ids) for ids in first.train["input_ids"]}
    eval_rows = {tuple(ids) for ids in first.eval["input_ids"]}
    assert not train_rows & eval_rows and len(train_rows | eval_rows) == 20
    assert first.provenance == again.provenance
    assert first.provenance["eval_records_sha256"] != other.provenance["eval_records_sha256"]
    assert first.provenance["split_seed"] == 3
    with pytest.raises(ValueError, match="either eval_file or val_split, not both"):
        load_sft_data(qwen3, data, val_split=0.25, eval_file=data)


def test_recipe_stops_before_loading_the_model(tmp_path, assets, sft_recipe):
    data = write(tmp_path / "data.jsonl", [GOOD[0], CASES["unknown role"][1]])
    script = sft_recipe.SFTScriptArguments(train_file=str(data), val_split=0.5)
    model = sft_recipe.SFTModelArguments(model_name_or_path=str(assets / "tokenizers" / "qwen3"))  # has no weights
    with pytest.raises(InvalidChatRecord, match=rf"^{data}:2: message 1 has role 'bot'"):
        build_sft_trainer(script, ChatSFTConfig(output_dir=str(tmp_path / "out")), model)
    asked_to_evaluate = ChatSFTConfig(output_dir=str(tmp_path), eval_strategy="steps")
    has_eval_data = check_sft_arguments(sft_recipe.SFTScriptArguments(train_file=str(data)), asked_to_evaluate, model)
    with pytest.raises(ValueError, match="needs --dataset_test_split, --val_split or --eval_file"):
        decide_evaluation(asked_to_evaluate, has_eval_data, resuming=False)


def encoded_records(monkeypatch) -> list:
    """Counts `AssistantMasker.encode` calls (one per record encoded) from now on."""
    calls = []
    original = AssistantMasker.encode
    monkeypatch.setattr(AssistantMasker, "encode", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    return calls


def parquet_file(path, records):
    datasets.Dataset.from_list(records).to_parquet(str(path))
    return path


def arrow_file(path, records):
    import pyarrow as pa

    table = datasets.Dataset.from_list(records).data.table
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


RECORDS = [json.loads(good) for good in GOOD]
# (case, how the file is written, the error after "--train_file PATH: ")
NOT_JSONL = [
    ("Parquet", lambda path: parquet_file(path, RECORDS),
     "a Parquet file, not JSONL; pass it as --dataset_name {path}, which reads it"),
    ("Arrow", lambda path: arrow_file(path, RECORDS),
     "an Arrow file, not JSONL; pass it as --dataset_name {path}, which reads it"),
    ("bzip2", lambda path: path.write_bytes(bz2.compress(b"".join(GOOD))),
     "a bzip2-compressed file, not JSONL; decompress it to JSONL (gzip is read as it is)"),
    ("empty", lambda path: path.write_bytes(b""), "the file is empty; expected one JSON record per line"),
    ("blank lines only", lambda path: path.write_bytes(b"\n  \n\xef\xbb\xbf\r\n\t\n"),
     "the file holds only blank lines; expected one JSON record per line"),
    ("gzip of blank lines", lambda path: path.write_bytes(gzip.compress(b"\n\n")),
     "the file holds only blank lines; expected one JSON record per line"),
    ("broken gzip", lambda path: path.write_bytes(gzip.compress(b"".join(GOOD))[:-12]), "not a readable gzip file"),
]


@pytest.mark.parametrize("case, write_file, message", NOT_JSONL, ids=[c[0] for c in NOT_JSONL])
@pytest.mark.parametrize("argument", ["train_file", "eval_file"])
def test_a_file_that_is_not_jsonl_is_named_before_any_record_is_encoded(tmp_path, qwen3, monkeypatch, case,
                                                                        write_file, message, argument):
    bad = tmp_path / "data.jsonl"
    write_file(bad)
    good = write(tmp_path / "good.jsonl", GOOD)
    calls = encoded_records(monkeypatch)
    files = {"train_file": bad, "eval_file": good} if argument == "train_file" else \
        {"train_file": good, "eval_file": bad}
    with pytest.raises(SFTDataError) as error:
        load_sft_data(qwen3, **files, cache_dir=str(tmp_path / "cache"))
    assert str(error.value).startswith(f"--{argument} {bad}: " + message.format(path=bad))
    assert "\n" not in str(error.value) and calls == []


def test_gzip_jsonl_is_read_as_the_plain_file(tmp_path, qwen3, assets):
    lines = (assets / "chat" / "gsm8k_messages_train.jsonl").read_bytes().splitlines(keepends=True)[:30]
    plain = write(tmp_path / "chats.jsonl", lines[:20] + [b"\n", CASES["unknown role"][1]] + lines[20:])
    packed = tmp_path / "chats.jsonl.gz"  # two gzip members, as `cat a.gz b.gz` makes
    packed.write_bytes(gzip.compress(b"".join(lines[:20])) + gzip.compress(b"".join([b"\n", CASES["unknown role"][1]]
                                                                               + lines[20:])))
    cache = str(tmp_path / "cache")
    with pytest.raises(InvalidChatRecord, match=rf"^{packed}:22: message 1 has role 'bot'"):
        load_sft_data(qwen3, packed, cache_dir=cache)
    reference = load_sft_data(qwen3, plain, skip_invalid_records=True, cache_dir=cache)
    for num_proc in (1, 2):
        read = load_sft_data(qwen3, packed, skip_invalid_records=True, dataset_num_proc=num_proc,
                             cache_dir=str(tmp_path / f"cache{num_proc}"))
        assert read.train["input_ids"] == reference.train["input_ids"] and read.train["labels"] == \
            reference.train["labels"]
        assert read.provenance["train_records_sha256"] == reference.provenance["train_records_sha256"]
        assert read.stats["train_file"].first_errors == [f"{packed}:22: message 1 has role 'bot'; expected one of "
                                                         "system/developer/user/assistant/tool"]
    assert read.provenance["files_sha256"] == {str(packed): hashlib.sha256(packed.read_bytes()).hexdigest()}


def test_a_key_given_twice_in_a_dataset_file_is_one_line(tmp_path, qwen3):
    """A `--dataset_name` JSON file is parsed by `datasets` (pyarrow), which hfl3 does not see: its error, one line."""
    data = write(tmp_path / "dup.jsonl", [GOOD[0], CASES["duplicated key"][1]])
    with pytest.raises(SFTDataError, match=rf"^--dataset_name {data} \(train split\): datasets cannot read it: .*"
                                           r"content.* specified twice"):
        load_sft_data(qwen3, dataset_name=str(data), cache_dir=str(tmp_path / "cache"))


def test_an_empty_dataset_split_is_one_line(tmp_path, qwen3):
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_list([{"text": "x"}]).select([]).to_parquet(str(empty))
    with pytest.raises(SFTDataError, match=rf"^--dataset_name {empty} \(train split\): no rows$"):
        load_sft_data(qwen3, dataset_name=str(empty), cache_dir=str(tmp_path / "cache"))


# ---- a conversation's opening, byte order marks ----------------------------------------------------------------------

BOM = codecs.BOM_UTF8
S, U, A = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!"})

OPENING_ERRORS = [  # (case, messages, reason)
    ("assistant first", [A, U, A], "message 0 is from the assistant, but a conversation starts with a user message"),
    ("assistant after the system prompt", [S, A], "message 1 is from the assistant"),
    ("assistant first, no user at all", [A], "message 0 is from the assistant"),
]


@pytest.mark.parametrize("case, messages, reason", OPENING_ERRORS, ids=[c[0] for c in OPENING_ERRORS])
def test_a_conversation_must_open_with_the_user(tmp_path, qwen3, case, messages, reason):
    data = tmp_path / "data.jsonl"
    data.write_bytes(line([U, A]) + line(messages) + line([S, U, A]))
    with pytest.raises(InvalidChatRecord, match=f"^{data}:2: {reason}") as error:
        load_sft_data(qwen3, data)
    assert "add the user turn it answers" in str(error.value) and error.value.kind == "malformed"
    result = load_sft_data(qwen3, data, skip_invalid_records=True)
    stats = result.stats["train_file"]
    assert (stats.read, stats.malformed, stats.kept) == (3, 1, 2)
    assert stats.first_errors == [str(error.value)]


def test_a_byte_order_mark_starting_any_line_is_dropped(tmp_path, qwen3):
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_bytes(line([U, A]) + line([S, U, A]))
    marked.write_bytes(BOM + line([U, A]) + BOM + line([S, U, A]))  # two BOM-prefixed files concatenated
    reference, result = load_sft_data(qwen3, plain), load_sft_data(qwen3, marked)
    assert result.train["input_ids"] == reference.train["input_ids"]
    assert result.provenance["train_records_sha256"] == reference.provenance["train_records_sha256"]
