"""SFT data in the formats people train on, through `datasets`: tool calls, reasoning, tool results, `training: false`,
prompt–completion and ShareGPT records masked from each model's own template (checked against hand-marked text),
Hub-style dataset folders read by `dataset_name`, rows cached by content and equal with several processes, and bad
data ending the recipe and the inspect tool with one line and exit status 2."""

import hashlib
import json
import re

import datasets
import pytest
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl.chat_template_utils import qwen2_5_chat_template

from hfl3.data import inspect as inspect_cli
from hfl3.data.chat import InvalidChatRecord, SFTDataError, iter_jsonl, normalize_record, write_chat_jsonl
from hfl3.data.inspect import highlight
from hfl3.data.masks import AssistantMasker
from hfl3.data.sft import load_sft_data
from hfl3.data.sft_sources import iter_shard, open_jsonl
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.nanochat.convert_nanochat_tokenizer import load_nanochat_encoding, tokenizer_from_encoding
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.cli.exits import recipe_exits
from hfl3.trainers.cli.arguments import parse_recipe_args

pytestmark = pytest.mark.timeout(120)

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = {"tools": json.dumps(WEATHER), "messages": [  # OpenAI's shape, as Hub datasets store it
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "id": "c1", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": "22 C, sunny", "tool_call_id": "c1", "name": "get_weather"},
    {"role": "assistant", "content": "22 C and sunny.", "reasoning_content": "Report it."}]}
TOOLS_PROMPT = (  # Qwen's system block for WEATHER, written out
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n"
HISTORY_CHAT = {"messages": [  # the README's example of Qwen3's history rule
    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "Add."},
    {"role": "user", "content": "Times 3?"}, {"role": "assistant", "content": "12", "reasoning_content": "Times."}]}
OUT_OF_LOSS = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "training": False}, {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"}]}
PROMPT_COMPLETION = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "2+2?"}],
                     "completion": [{"role": "assistant", "content": "4"}]}
SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "2+2?"},
                              {"from": "gpt", "value": "4"}]}
PLAIN = {"prompt": "The sky is", "completion": " blue."}
GEMMA3 = pytest.mark.gemma3

# (name, template, record, the rendered text with [[supervised]] marked by hand, or the error it must raise)
CASES = [
    ("tool call and reasoning", "qwen3", TOOL_CHAT,
     TOOLS_PROMPT + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
     f"[[<think>\nNeed the tool.\n</think>\n\n{CALL}<|im_end|>]]\n" + RESULT +
     "<|im_start|>assistant\n[[<think>\nReport it.\n</think>\n\n22 C and sunny.<|im_end|>]]\n"),
    ("tool call, no reasoning in the template", "qwen2.5", TOOL_CHAT,
     TOOLS_PROMPT + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
     f"[[{CALL}<|im_end|>]]\n" + RESULT + "<|im_start|>assistant\n[[22 C and sunny.<|im_end|>]]\n"),
    ("history rule drops earlier reasoning", "qwen3", HISTORY_CHAT,
     "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n[[4<|im_end|>]]\n<|im_start|>user\nTimes 3?<|im_end|>\n"
     "<|im_start|>assistant\n[[<think>\nTimes.\n</think>\n\n12<|im_end|>]]\n"),
    ("training false", "qwen3", OUT_OF_LOSS,
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
     "Hello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
     "[[<think>\n\n</think>\n\n4<|im_end|>]]\n"),
    ("prompt-completion messages", "qwen2.5", PROMPT_COMPLETION,
     "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
     "<|im_start|>assistant\n[[4<|im_end|>]]\n"),
    ("ShareGPT", "l3gpt", SHAREGPT,
     "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
     "[[Hello!<|im_end|>]]\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n[[4<|im_end|>]]\n"),
    ("plain prompt-completion", "qwen3", PLAIN, "The sky is[[ blue.<|im_end|>]]"),
    ("nanochat, training false", "nanochat", OUT_OF_LOSS,
     "<|bos|><|user_start|>Be brief.\n\nHi<|user_end|><|assistant_start|>Hello!<|assistant_end|><|user_start|>2+2?"
     "<|user_end|><|assistant_start|>[[4<|assistant_end|>]]"),
    pytest.param("Gemma 3, training false", "gemma3", OUT_OF_LOSS,
                 "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                 "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n[[4<end_of_turn>]]\n", marks=GEMMA3),
    pytest.param("Gemma 3 has no tools", "gemma3", TOOL_CHAT, InvalidChatRecord(
        "t:1", "the chat template does not render 'tool' messages, assistant 'tool_calls', 'tools'"), marks=GEMMA3),
    ("ChatML has no tool calls", "l3gpt", TOOL_CHAT, InvalidChatRecord(
        "t:1", "the chat template does not render assistant 'tool_calls', 'tools'")),
    ("nanochat has no tools", "nanochat", TOOL_CHAT, InvalidChatRecord(
        "t:1", "the chat template does not render 'tool' messages, assistant 'tool_calls', 'tools'")),
]


@pytest.fixture(scope="module")
def tokenizers(assets, gemma3_tokenizer, tmp_path_factory):
    import sys

    sys.path.insert(0, str(assets.parent))  # tests/: nanochat's reference code
    from nanochat_reference import train_ranks, write_tokenizer_pickle

    folder = tmp_path_factory.mktemp("nanochat")
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]
    write_tokenizer_pickle(folder, train_ranks(text, 491))
    qwen25 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    qwen25.chat_template = qwen2_5_chat_template
    return {"qwen3": AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3"), "qwen2.5": qwen25,
            "gemma3": gemma3_tokenizer, "l3gpt": train_tokenizer([text], vocab_size=600),
            "nanochat": tokenizer_from_encoding(load_nanochat_encoding(folder))}


@pytest.mark.parametrize("name, template, record, expected", CASES, ids=[getattr(c, "values", c)[0] for c in CASES])
def test_supervised_text_is_what_was_marked_by_hand(tokenizers, name, template, record, expected):
    tokenizer, record = tokenizers[template], normalize_record(record, "t:1")
    masker = AssistantMasker(tokenizer)
    if isinstance(expected, InvalidChatRecord):
        with pytest.raises(InvalidChatRecord, match=re.escape(str(expected))):
            masker.encode(record)
        return
    encoded = masker.encode(record)
    assert highlight(encoded, plain=True) == expected
    # the same text and tokens as transformers gives for the record
    if hasattr(record, "messages"):
        assert encoded.text == tokenizer.apply_chat_template(list(record.messages), tools=record.tools,
                                                             tokenize=False)
        assert encoded.input_ids == tokenizer(encoded.text, add_special_tokens=False)["input_ids"]
    else:
        assert encoded.input_ids == tokenizer(encoded.text)["input_ids"]
    # labels are the token ids exactly where the marks are
    assert all(label in (-100, token) for label, token in zip(encoded.labels, encoded.input_ids))
    marked = "".join(re.findall(r"\[\[(.*?)\]\]", expected, flags=re.S))
    assert tokenizer.decode([label for label in encoded.labels if label != -100]) == marked


def test_reasoning_the_template_drops_is_counted(tokenizers):
    qwen3 = AssistantMasker(tokenizers["qwen3"])
    assert qwen3.encode(normalize_record(HISTORY_CHAT, "t")).reasoning_not_rendered == 1  # the first turn's
    assert qwen3.encode(normalize_record(TOOL_CHAT, "t")).reasoning_not_rendered == 0
    assert AssistantMasker(tokenizers["qwen2.5"]).encode(normalize_record(TOOL_CHAT, "t")).reasoning_not_rendered == 2


def test_a_context_the_model_never_sees_is_reported_not_trained(tokenizers):
    # Qwen3 keeps the reasoning of a tool-calling turn while the tool sequence is the latest query, and drops it once
    # a new user message follows: the second reply was written after a context that the full render no longer holds
    later = {**TOOL_CHAT, "messages": TOOL_CHAT["messages"] + [{"role": "user", "content": "And Rome?"},
                                                               {"role": "assistant", "content": "No idea."}]}
    with pytest.raises(InvalidChatRecord, match=r"^t:7: the chat template renders the turns before message 4 "
                                                r"differently .*<think>\\nNeed the tool.* alone"):
        AssistantMasker(tokenizers["qwen3"]).encode(normalize_record(later, "t:7"))


def test_formats_normalize_to_the_same_conversation():
    messages = normalize_record(OUT_OF_LOSS, "a").messages
    assert normalize_record(SHAREGPT, "b").messages == tuple(
        {k: v for k, v in m.items() if k != "training"} for m in messages)
    completion = normalize_record(PROMPT_COMPLETION, "c")
    assert completion.context == 3 and completion.messages == tuple(PROMPT_COMPLETION["prompt"] +
                                                                    PROMPT_COMPLETION["completion"])
    assert normalize_record(PROMPT_COMPLETION, "c", completion_only_loss=False).context == 0
    arrow_row = {"messages": [{**m, "tool_calls": None, "reasoning_content": None} for m in OUT_OF_LOSS["messages"]],
                 "tools": None, "prompt": None, "completion": None}  # a struct column: every key, null where absent
    assert normalize_record(arrow_row, "d").messages == messages
    tool = normalize_record(TOOL_CHAT, "e")
    assert tool.tools == tuple(WEATHER) and tool.messages[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"}
    assert tool.messages[2]["content"] == ""


def test_jsonl_shards_cover_every_line_once(tmp_path):
    lines = [b'{"a": %d}\n' % i for i in range(50)]
    lines[3], lines[10], lines[20] = b"\n", b"\xef\xbb\xbf" + lines[10], b"not json\n"
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join(lines) + b'{"last": true}')  # no newline at the end
    whole = [(where, repr(obj)) for where, obj in iter_jsonl(path)]
    assert len(whole) == 50 and whole[-1][0] == f"{path}:51"
    source = open_jsonl(str(path), shards=7)
    for count in (1, 3, 7, 60):
        shards = source.shards(count)
        assert 1 <= len(shards) <= max(count, 8)
        assert [(where, repr(obj)) for shard in shards for where, obj in iter_shard(shard)] == whole


def write_folder(folder, splits: dict[str, list[dict]]):
    """A Hub-style dataset folder: one parquet file per split (`datasets` gives the messages one struct type)."""
    folder.mkdir()
    for split, records in splits.items():
        columns = {key: [record.get(key) for record in records] for key in {k for r in records for k in r}}
        datasets.Dataset.from_dict(columns).to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    return folder


def rows(split) -> list:
    return [(row["input_ids"], row["labels"]) for row in split]


def gsm8k(assets, split: str, n: int) -> list[dict]:
    lines = (assets / "chat" / f"gsm8k_messages_{split}.jsonl").read_text().splitlines()[:n]
    return [{"messages": json.loads(line)["messages"]} for line in lines]


def test_a_parquet_folder_read_by_dataset_name_gives_the_rows_of_the_same_jsonl(tmp_path, tokenizers, assets):
    train, test = gsm8k(assets, "train", 6) + [TOOL_CHAT], gsm8k(assets, "test", 3)
    folder = write_folder(tmp_path / "hub_style", {"train": train, "test": test})
    tokenizer, cache = tokenizers["qwen3"], str(tmp_path / "cache")
    from_folder = load_sft_data(tokenizer, dataset_name=str(folder), dataset_test_split="test", cache_dir=cache)
    from_files = load_sft_data(tokenizer, write_chat_jsonl(train, tmp_path / "train.jsonl"),
                               eval_file=write_chat_jsonl(test, tmp_path / "test.jsonl"), cache_dir=cache)
    assert (len(from_folder.train), len(from_folder.eval)) == (7, 3)
    assert rows(from_folder.train) == rows(from_files.train) and rows(from_folder.eval) == rows(from_files.eval)
    for key in ("train_records_sha256", "eval_records_sha256"):
        assert from_folder.provenance[key] == from_files.provenance[key]
    assert set(from_folder.stats) == {"dataset_train_split", "dataset_test_split"}
    assert from_folder.stats["dataset_train_split"].first_errors == []
    [train_split, test_split] = from_folder.provenance["datasets"]
    assert (train_split["split"], test_split["split"]) == ("train", "test")
    assert sorted(from_folder.provenance["files_sha256"]) == sorted(str(p) for p in folder.glob("*.parquet"))
    with pytest.raises(ValueError, match=r"Unknown split \"validation\""):
        load_sft_data(tokenizer, dataset_name=str(folder), dataset_test_split="validation", cache_dir=cache)


def test_rows_are_cached_by_content_and_equal_with_two_processes(tmp_path, tokenizers, assets, monkeypatch):
    tokenizer, cache = tokenizers["qwen3"], str(tmp_path / "cache")
    data = write_chat_jsonl(gsm8k(assets, "train", 40), tmp_path / "d.jsonl")
    encoded = []
    original = AssistantMasker.encode
    monkeypatch.setattr(AssistantMasker, "encode", lambda self, *a, **k: encoded.append(1) or original(self, *a, **k))
    first = load_sft_data(tokenizer, data, val_split=0.25, max_length=200, cache_dir=cache)
    assert len(encoded) == 40
    again = load_sft_data(tokenizer, data, val_split=0.25, max_length=200, cache_dir=cache)
    assert len(encoded) == 40  # nothing encoded: the cached rows were read
    assert rows(again.train) == rows(first.train) and again.provenance == first.provenance
    load_sft_data(tokenizer, data, val_split=0.25, max_length=100, cache_dir=cache)
    assert len(encoded) == 80  # another max_length: other rows
    with open(data, "a") as f:
        f.write(json.dumps(gsm8k(assets, "test", 1)[0]) + "\n")
    changed = load_sft_data(tokenizer, data, val_split=0.25, max_length=200, cache_dir=cache)
    assert len(encoded) == 121 and changed.provenance["train_examples"] + changed.provenance["eval_examples"] == 41
    monkeypatch.setattr(AssistantMasker, "encode", original)
    two = load_sft_data(tokenizer, data, val_split=0.25, max_length=200, cache_dir=str(tmp_path / "other"),
                        dataset_num_proc=2)
    assert rows(two.train) == rows(changed.train) and two.provenance == changed.provenance


def test_fixture_rows_are_those_of_the_previous_path(tokenizers, assets, tmp_path):
    """The sha256 of the fixture's rows as the list-based path before `datasets` made them (commit 03c6c7e)."""
    data = load_sft_data(tokenizers["qwen3"], assets / "chat" / "gsm8k_messages_train.jsonl",
                         eval_file=assets / "chat" / "gsm8k_messages_test.jsonl", cache_dir=str(tmp_path))
    digest = hashlib.sha256()
    for split in (data.train, data.eval):
        for row in split:
            digest.update(json.dumps([row["input_ids"], row["labels"]]).encode())
    assert digest.hexdigest() == "f57f927dd3e6e52cf99a49e87bd294531c09d949a0189e490eb4d6970a4b1916"
    assert data.provenance["train_records_sha256"] == \
        "5f0a9658bf207c36aa3717f9294fc4f839c0265c23835e8d2133d5362bde31d8"
    assert data.train_supervised_tokens == data.stats["train_file"].supervised_tokens == 29487


BAD_LINES = [b'{"messages": [\n', b'{"messages": null, "text": null}\n',
             json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode() + b"\n"]


def test_inspect_shows_every_part_and_exits_2_on_an_all_invalid_file(tmp_path, assets, capsys):
    tokenizer = str(assets / "tokenizers" / "qwen3")
    tools = write_chat_jsonl([TOOL_CHAT], tmp_path / "tools.jsonl")
    assert inspect_cli.main(["--tokenizer", tokenizer, "--train_file", str(tools), "--plain"]) == 0
    out = capsys.readouterr().out
    assert CALL in out and "<tool_response>\n22 C, sunny" in out and "[[<think>\nReport it." in out
    assert out.count("[[") == 2
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_bytes(b"".join(BAD_LINES))
    with pytest.raises(SystemExit) as exit_info:
        inspect_cli.main(["--tokenizer", tokenizer, "--data", str(invalid)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out.count("=== ") == 3 and "malformed JSON" in captured.out and "'messages', 'text' are null" in \
        captured.out and "no assistant message" in captured.out
    assert captured.err.splitlines() == [f"python -m hfl3.data.inspect: error: {invalid}: no valid record in the 3 "
                                         "read (each reason above)"]


@pytest.mark.parametrize("flags, message", [
    (["--skip_invalid_records"], "{data}: no usable conversation left ({{'read': 3, 'malformed': 2, "
                                 "'no_assistant': 1, 'duplicates': 0"),
    ([], "{data}:1: malformed JSON (Expecting value at column 1) (2 more invalid record(s), the first logged "
         "above; --skip_invalid_records skips and counts them)"),
])
def test_the_recipe_ends_with_one_line_and_exit_2_when_nothing_valid_is_left(tmp_path, assets, sft_recipe, capsys,
                                                                             flags, message):
    model = tmp_path / "model"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(model)
    AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3").save_pretrained(model)
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b"".join(BAD_LINES))
    parsed = parse_recipe_args(sft_recipe.make_parser(), [
        "--model_name_or_path", str(model), "--train_file", str(data), "--output_dir", str(tmp_path / "out"),
        *flags])
    with pytest.raises(SystemExit) as exit_info, recipe_exits("sft_lora.py"):
        sft_recipe.main(*parsed)
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.splitlines()[-1]  # after the progress bars of `datasets`
    assert line.startswith("sft_lora.py: error: " + message.format(data=data))
    assert not (tmp_path / "out").exists()


def test_no_usable_record_in_a_dataset_split_is_one_error(tmp_path, tokenizers):
    folder = write_folder(tmp_path / "hub_style", {"train": [{"messages": [{"role": "user", "content": "Hi"}]}]})
    with pytest.raises(SFTDataError, match=r"\(train split\): no usable conversation left \({'read': 1, "
                                           r"'malformed': 0, 'no_assistant': 1"):
        load_sft_data(tokenizers["qwen3"], dataset_name=str(folder), skip_invalid_records=True,
                      cache_dir=str(tmp_path / "cache"))


# ---- repeated records ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")


def test_duplicate_records_are_dropped_before_the_split_and_counted(tmp_path, qwen3):
    chats = stdlib_docstring_chats(20, seed=0)
    assert len({json.dumps(c["messages"]) for c in chats}) == 20
    # 5 repeats (another id, same messages): without the drop, val_split=0.5 would put some on both sides
    data = write_chat_jsonl(chats + [{"id": "again", **chats[i]} for i in (0, 3, 3, 7, 19)], tmp_path / "d.jsonl")
    result = load_sft_data(qwen3, data, val_split=0.5, seed=0, max_length=256)
    stats = result.stats["train_file"]
    assert (stats.read, stats.duplicates, stats.kept) == (25, 5, 20)
    assert stats.first_errors[0] == f"{data}:21: same messages as {data}:1"
    assert result.provenance["counts"]["train_file"]["duplicates"] == 5
    assert result.provenance["train_examples"] + result.provenance["eval_examples"] == 20
    train, evaluation = ({tuple(ids) for ids in split["input_ids"]} for split in (result.train, result.eval))
    assert len(train) == 10 and len(evaluation) == 10 and not train & evaluation
    # the kept rows are exactly those of the file without its repeats
    clean = load_sft_data(qwen3, write_chat_jsonl(chats, tmp_path / "c.jsonl"), val_split=0.5, seed=0, max_length=256)
    assert result.train["input_ids"] == clean.train["input_ids"]
    assert result.provenance["train_records_sha256"] == clean.provenance["train_records_sha256"]


def test_an_eval_record_repeating_a_training_record_is_dropped(tmp_path, qwen3):
    chats = stdlib_docstring_chats(6, seed=1)
    train = write_chat_jsonl(chats[:4], tmp_path / "train.jsonl")
    evaluation = write_chat_jsonl([chats[1], chats[4], chats[5], chats[4]], tmp_path / "eval.jsonl")
    result = load_sft_data(qwen3, train, eval_file=evaluation, max_length=256)
    stats = result.stats["eval_file"]
    assert (stats.read, stats.duplicates, stats.kept) == (4, 2, 2) and len(result.eval) == 2
    assert stats.first_errors == [f"{evaluation}:1: same messages as {train}:2",
                                  f"{evaluation}:4: same messages as {evaluation}:2"]
