"""Reasoning in every turn, opt-in: `split_reasoning_turns` makes each assistant turn with `reasoning_content` a
sample of its own, ending at that turn, so that Qwen3 (which drops earlier turns' reasoning) renders and trains it,
while the earlier turns of a sample are context only; `ignore_empty_reasoning` leaves the empty `<think>` block a
template inserts out of the loss. Masks against hand-marked text for Qwen3 and for a template that keeps reasoning in
history; counts, duplicates, the train/eval split by conversation, provenance and the inspect tool."""

import re

import pytest
from transformers import AutoTokenizer
from trl.chat_template_utils import qwen2_5_chat_template

from hfl3.data import inspect as inspect_cli
from hfl3.data.chat import normalize_record, split_reasoning_turns, write_chat_jsonl
from hfl3.data.inspect import highlight
from hfl3.data.masks import AssistantMasker
from hfl3.data.sft import load_sft_data

pytestmark = pytest.mark.timeout(120)

# A ChatML template that renders every assistant turn's reasoning, in history too
KEEPS_REASONING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
U1, U2, U3 = ({"role": "user", "content": text} for text in ("2+2?", "Times 3?", "Minus 2?"))
THREE_TURNS = {"messages": [
    U1, {"role": "assistant", "content": "4", "reasoning_content": "Add."},
    U2, {"role": "assistant", "content": "12", "reasoning_content": "Times."},
    U3, {"role": "assistant", "content": "10", "reasoning_content": "Minus."}]}
MIXED = {"messages": [  # a turn without reasoning is trained in the sample of the next cut
    {"role": "system", "content": "Be brief."},
    U1, {"role": "assistant", "content": "4", "reasoning_content": "Add."},
    U2, {"role": "assistant", "content": "12"},
    U3, {"role": "assistant", "content": "10", "reasoning_content": "Minus."},
    {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You're welcome.", "training": False}]}

Q1 = "<|im_start|>user\n2+2?<|im_end|>\n"
Q2 = "<|im_start|>user\nTimes 3?<|im_end|>\n"
Q3 = "<|im_start|>user\nMinus 2?<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"
# (name, template, record, options, each sample's text with [[supervised]] marked by hand)
CASES = [
    ("Qwen3 drops earlier reasoning: off", "qwen3", THREE_TURNS, {}, [
        Q1 + ASSISTANT + "[[4<|im_end|>]]\n" + Q2 + ASSISTANT + "[[12<|im_end|>]]\n" + Q3 + ASSISTANT +
        "[[<think>\nMinus.\n</think>\n\n10<|im_end|>]]\n"]),
    ("Qwen3, split", "qwen3", THREE_TURNS, {"split_reasoning_turns": True}, [
        Q1 + ASSISTANT + "[[<think>\nAdd.\n</think>\n\n4<|im_end|>]]\n",
        Q1 + ASSISTANT + "4<|im_end|>\n" + Q2 + ASSISTANT + "[[<think>\nTimes.\n</think>\n\n12<|im_end|>]]\n",
        Q1 + ASSISTANT + "4<|im_end|>\n" + Q2 + ASSISTANT + "12<|im_end|>\n" + Q3 + ASSISTANT +
        "[[<think>\nMinus.\n</think>\n\n10<|im_end|>]]\n"]),
    ("Qwen3, split, a turn without reasoning and one out of the loss", "qwen3", MIXED,
     {"split_reasoning_turns": True}, [
         "<|im_start|>system\nBe brief.<|im_end|>\n" + Q1 + ASSISTANT + "[[<think>\nAdd.\n</think>\n\n4<|im_end|>]]\n",
         "<|im_start|>system\nBe brief.<|im_end|>\n" + Q1 + ASSISTANT + "4<|im_end|>\n" + Q2 + ASSISTANT +
         "[[12<|im_end|>]]\n" + Q3 + ASSISTANT + "[[<think>\nMinus.\n</think>\n\n10<|im_end|>]]\n"]),
    ("Qwen3, split, whole text", "qwen3", THREE_TURNS, {"split_reasoning_turns": True, "assistant_only_loss": False}, [
        "[[" + Q1 + ASSISTANT + "<think>\nAdd.\n</think>\n\n4<|im_end|>\n]]",
        Q1 + ASSISTANT + "4<|im_end|>[[\n" + Q2 + ASSISTANT + "<think>\nTimes.\n</think>\n\n12<|im_end|>\n]]",
        Q1 + ASSISTANT + "4<|im_end|>\n" + Q2 + ASSISTANT + "12<|im_end|>[[\n" + Q3 + ASSISTANT +
        "<think>\nMinus.\n</think>\n\n10<|im_end|>\n]]"]),
    ("reasoning kept in history: off", "keeps", THREE_TURNS, {}, [
        Q1 + ASSISTANT + "[[<think>\nAdd.\n</think>\n\n4<|im_end|>]]\n" + Q2 + ASSISTANT +
        "[[<think>\nTimes.\n</think>\n\n12<|im_end|>]]\n" + Q3 + ASSISTANT +
        "[[<think>\nMinus.\n</think>\n\n10<|im_end|>]]\n"]),
    ("reasoning kept in history, split", "keeps", THREE_TURNS, {"split_reasoning_turns": True}, [
        Q1 + ASSISTANT + "[[<think>\nAdd.\n</think>\n\n4<|im_end|>]]\n",
        Q1 + ASSISTANT + "<think>\nAdd.\n</think>\n\n4<|im_end|>\n" + Q2 + ASSISTANT +
        "[[<think>\nTimes.\n</think>\n\n12<|im_end|>]]\n",
        Q1 + ASSISTANT + "<think>\nAdd.\n</think>\n\n4<|im_end|>\n" + Q2 + ASSISTANT +
        "<think>\nTimes.\n</think>\n\n12<|im_end|>\n" + Q3 + ASSISTANT +
        "[[<think>\nMinus.\n</think>\n\n10<|im_end|>]]\n"]),
    ("Qwen3, empty reasoning out of the loss", "qwen3", {"messages": [U1, {"role": "assistant", "content": "4"}]},
     {"ignore_empty_reasoning": True}, [Q1 + ASSISTANT + "<think>\n\n</think>\n\n[[4<|im_end|>]]\n"]),
    ("Qwen3, empty reasoning out of the whole-text loss", "qwen3",
     {"messages": [U1, {"role": "assistant", "content": "4", "reasoning_content": ""}]},
     {"ignore_empty_reasoning": True, "assistant_only_loss": False},
     ["[[" + Q1 + ASSISTANT + "]]<think>\n\n</think>\n\n[[4<|im_end|>\n]]"]),
    ("Qwen3, reasoning given is trained", "qwen3", {"messages": [U1, THREE_TURNS["messages"][1]]},
     {"ignore_empty_reasoning": True}, [Q1 + ASSISTANT + "[[<think>\nAdd.\n</think>\n\n4<|im_end|>]]\n"]),
    ("Qwen3, split, empty reasoning out of the loss", "qwen3", MIXED,
     {"split_reasoning_turns": True, "ignore_empty_reasoning": True}, [
         "<|im_start|>system\nBe brief.<|im_end|>\n" + Q1 + ASSISTANT + "[[<think>\nAdd.\n</think>\n\n4<|im_end|>]]\n",
         "<|im_start|>system\nBe brief.<|im_end|>\n" + Q1 + ASSISTANT + "4<|im_end|>\n" + Q2 + ASSISTANT +
         "[[12<|im_end|>]]\n" + Q3 + ASSISTANT + "[[<think>\nMinus.\n</think>\n\n10<|im_end|>]]\n"]),
]


@pytest.fixture(scope="module")
def tokenizers(assets):
    qwen3 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    keeps = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    keeps.chat_template = KEEPS_REASONING
    qwen25 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    qwen25.chat_template = qwen2_5_chat_template
    return {"qwen3": qwen3, "keeps": keeps, "qwen2.5": qwen25}


def marked(text: str) -> str:
    return "".join(re.findall(r"\[\[(.*?)\]\]", text, flags=re.S))


@pytest.mark.parametrize("name, template, record, options, expected", CASES, ids=[c[0] for c in CASES])
def test_each_sample_supervises_what_was_marked_by_hand(tokenizers, tmp_path, name, template, record, options,
                                                        expected):
    tokenizer = tokenizers[template]
    masker = AssistantMasker(tokenizer, assistant_only_loss=options.get("assistant_only_loss", True),
                             ignore_empty_reasoning=options.get("ignore_empty_reasoning", False))
    normalized = normalize_record(record, "t:1")
    samples = split_reasoning_turns(normalized) if options.get("split_reasoning_turns") else (normalized,)
    encoded = [masker.encode(sample) for sample in samples]
    assert [highlight(chat, plain=True) for chat in encoded] == expected
    assert all(chat.text == tokenizer.apply_chat_template(list(sample.messages), tokenize=False)
               for chat, sample in zip(encoded, samples))
    # the rows load_sft_data writes: the same tokens and labels, one row per sample, in order
    data = load_sft_data(tokenizer, write_chat_jsonl([record], tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "c"),
                         **options)
    assert [(row["input_ids"], row["labels"]) for row in data.train] == [(c.input_ids, c.labels) for c in encoded]
    for row, text in zip(data.train, expected):
        assert tokenizer.decode([label for label in row["labels"] if label != -100]) == marked(text)
    stats = data.stats["train_file"]
    split = len(expected) > 1
    assert (stats.read, stats.kept, stats.reasoning_expanded, stats.reasoning_samples) == \
        (1, len(expected), int(split), len(expected) if split else 0)
    assert data.provenance["options"]["split_reasoning_turns"] == options.get("split_reasoning_turns", False)


def test_every_reasoning_turn_is_trained_only_when_split(tokenizers, tmp_path):
    data_file = write_chat_jsonl([THREE_TURNS], tmp_path / "d.jsonl")
    off = load_sft_data(tokenizers["qwen3"], data_file, cache_dir=str(tmp_path / "c"))
    on = load_sft_data(tokenizers["qwen3"], data_file, cache_dir=str(tmp_path / "c"), split_reasoning_turns=True)
    assert off.stats["train_file"].reasoning_not_rendered == 2 and on.stats["train_file"].reasoning_not_rendered == 0
    assert off.provenance["train_records_sha256"] != on.provenance["train_records_sha256"]  # the rows are samples
    assert on.provenance == load_sft_data(tokenizers["qwen3"], data_file, cache_dir=str(tmp_path / "c2"),
                                          split_reasoning_turns=True).provenance


def test_a_tool_turn_whose_reasoning_a_new_question_drops_is_trained_in_its_own_sample(tokenizers):
    """Qwen3 renders a tool-calling turn's reasoning while it is the latest exchange and drops it once a new user
    message follows: unsplit, the turns before the last reply render differently alone (refused); split, each
    reasoning turn ends its sample."""
    call = {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    record = normalize_record({"messages": [U1, call, {"role": "tool", "content": "4"},
                                            {"role": "assistant", "content": "4", "reasoning_content": "Got it."},
                                            U2, {"role": "assistant", "content": "12"}]}, "t:3")
    masker = AssistantMasker(tokenizers["qwen3"])
    with pytest.raises(Exception, match="renders the turns before message 3 differently"):
        masker.encode(record)
    samples = [masker.encode(sample) for sample in split_reasoning_turns(record)]
    assert [marked(highlight(chat, plain=True)) for chat in samples] == [
        '<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n'
        "</tool_call><|im_end|>",
        "<think>\nGot it.\n</think>\n\n4<|im_end|>",
        "<think>\n\n</think>\n\n12<|im_end|>"]


def conversations(n: int) -> list[dict]:
    return [{"messages": [
        {"role": "user", "content": f"Q{i}a"}, {"role": "assistant", "content": f"A{i}a", "reasoning_content": "r1"},
        {"role": "user", "content": f"Q{i}b"}, {"role": "assistant", "content": f"A{i}b", "reasoning_content": "r2"},
        {"role": "user", "content": f"Q{i}c"}, {"role": "assistant", "content": f"A{i}c", "reasoning_content": "r3"}]}
        for i in range(n)]


def test_samples_of_a_conversation_stay_on_one_side_of_the_split(tokenizers, tmp_path):
    data = load_sft_data(tokenizers["qwen3"], write_chat_jsonl(conversations(12), tmp_path / "d.jsonl"),
                         val_split=0.25, seed=1, split_reasoning_turns=True, cache_dir=str(tmp_path / "c"))
    assert (data.provenance["train_examples"], data.provenance["eval_examples"]) == (27, 9)

    def conversation_of(split) -> list[str]:
        return [re.search(r"Q(\d+)a", tokenizers["qwen3"].decode(ids)).group(1) for ids in split["input_ids"]]

    train, evaluation = conversation_of(data.train), conversation_of(data.eval)
    assert not set(train) & set(evaluation) and len(set(evaluation)) == 3  # 3 of 12 conversations, all 3 samples
    assert all(train.count(i) == 3 for i in train) and all(evaluation.count(i) == 3 for i in evaluation)


def test_a_sample_equal_to_another_record_is_a_duplicate(tokenizers, tmp_path):
    [conversation] = conversations(1)
    first_turn = {"messages": conversation["messages"][:2]}  # the conversation's first sample, as a record
    data = load_sft_data(tokenizers["qwen3"], write_chat_jsonl([first_turn, conversation], tmp_path / "d.jsonl"),
                         split_reasoning_turns=True, cache_dir=str(tmp_path / "c"))
    stats = data.stats["train_file"]
    assert (stats.read, stats.reasoning_expanded, stats.reasoning_samples, stats.duplicates, stats.kept) == \
        (2, 1, 3, 1, 3)
    assert stats.read + stats.reasoning_samples - stats.reasoning_expanded == stats.duplicates + stats.kept
    assert stats.first_errors == [f"{tmp_path / 'd.jsonl'}:2: same messages as {tmp_path / 'd.jsonl'}:1"]


def test_a_template_without_an_empty_block_leaves_the_loss_alone(tokenizers, caplog):
    record = normalize_record({"messages": [U1, {"role": "assistant", "content": "4"}]}, "t")
    plain = AssistantMasker(tokenizers["qwen2.5"]).encode(record)
    with caplog.at_level("WARNING"):
        ignoring = AssistantMasker(tokenizers["qwen2.5"], ignore_empty_reasoning=True)
    assert ignoring.empty_reasoning == "" and "writes no empty reasoning block" in caplog.text
    assert ignoring.encode(record).labels == plain.labels
    assert AssistantMasker(tokenizers["keeps"]).empty_reasoning == ""
    assert AssistantMasker(tokenizers["qwen3"]).empty_reasoning == "<think>\n\n</think>\n\n"


def test_inspect_shows_each_sample(tmp_path, assets, capsys):
    data = write_chat_jsonl([THREE_TURNS], tmp_path / "d.jsonl")
    tokenizer = str(assets / "tokenizers" / "qwen3")
    assert inspect_cli.main(["--tokenizer", tokenizer, "--train_file", str(data), "--plain",
                             "--split_reasoning_turns", "--ignore_empty_reasoning"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("===")] == [
        f"=== {data}:1 (sample {k} of 3)" for k in (1, 2, 3)]
    assert re.findall(r"\[\[(.*?)\]\]", out, flags=re.S) == [marked(text) for text in CASES[1][4]]
