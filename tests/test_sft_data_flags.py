"""TRL's data flags act on hfl3's SFT rows as TRL acts on them: the rows `load_sft_data` builds equal, token for token
and label for label, those TRL 1.16's own preparation (`SFTTrainer._prepare_dataset`) builds from the same GSM8K
records for `assistant_only_loss=False`, `completion_only_loss`, `truncation_mode`, `eos_token`, `shuffle_dataset`,
language-modeling text with `dataset_text_field`, and `bfd_split` / `wrapped` packing; hfl3's own default
(`assistant_only_loss=True`, the masks of the model's template) checked against hand-marked text where the mask changes;
every option in the cache fingerprint and the provenance; `sft_data_options` maps the recipe's arguments."""

import dataclasses
import json
import re

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl import SFTConfig, SFTTrainer

from hfl3.data import inspect as inspect_cli
from hfl3.data.chat import normalize_record, write_chat_jsonl
from hfl3.data.inspect import highlight
from hfl3.data.masks import AssistantMasker
from hfl3.data.sft import load_sft_data, sft_data_options
from hfl3.trainers.sft.config import ChatSFTConfig, SFTScriptArguments

pytestmark = pytest.mark.timeout(300)

OUT_OF_LOSS = {"messages": [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "training": False}, {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"}]}
PROMPT_COMPLETION = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "user", "content": "2+2?"}],
                     "completion": [{"role": "assistant", "content": "4"}]}
HEAD = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"

# (name, record, load_sft_data options, the rendered text with [[supervised]] marked by hand)
HAND_MARKED = [
    ("whole text but the reply out of the loss", OUT_OF_LOSS, {"assistant_only_loss": False},
     "[[<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n]]"
     "Hello!<|im_end|>[[\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4"
     "<|im_end|>\n]]"),
    ("prompt-completion, completion only, whole text", PROMPT_COMPLETION, {"assistant_only_loss": False},
     HEAD + "<|im_start|>assistant\n[[<think>\n\n</think>\n\n4<|im_end|>\n]]"),
    ("prompt-completion as one conversation", PROMPT_COMPLETION, {"completion_only_loss": False},
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[[Hello!<|im_end|>]]\n<|im_start|>user\n2+2?<|im_end|>\n"
     "<|im_start|>assistant\n[[<think>\n\n</think>\n\n4<|im_end|>]]\n"),
    ("prompt-completion as one text", PROMPT_COMPLETION, {"completion_only_loss": False, "assistant_only_loss": False},
     "[[" + HEAD + "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n]]"),
    ("plain prompt-completion, whole text", {"prompt": "The sky is", "completion": " blue."},
     {"completion_only_loss": False}, "[[The sky is blue.<|im_end|>]]"),
    ("plain prompt-completion, another EOS", {"prompt": "The sky is", "completion": " blue."},
     {"eos_token": "<|endoftext|>"}, "The sky is[[ blue.<|endoftext|>]]"),
    ("language modeling", {"text": "Once upon a time."}, {}, "[[Once upon a time.<|im_end|>]]"),
    ("language modeling, its own field, special tokens kept", {"body": "Hi<|im_end|>\nThere<|endoftext|>"},
     {"dataset_text_field": "body", "eos_token": "<|endoftext|>"}, "[[Hi<|im_end|>\nThere<|endoftext|>]]"),
]


@pytest.fixture(scope="module")
def qwen3(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")


@pytest.mark.parametrize("name, record, options, expected", HAND_MARKED, ids=[c[0] for c in HAND_MARKED])
def test_supervised_text_is_what_was_marked_by_hand(qwen3, tmp_path, name, record, options, expected):
    data = load_sft_data(qwen3, write_chat_jsonl([record], tmp_path / "d.jsonl"), cache_dir=str(tmp_path / "c"),
                         **options)
    [row] = data.train
    masker = AssistantMasker(qwen3, assistant_only_loss=options.get("assistant_only_loss", True),
                             eos_token=options.get("eos_token"))
    encoded = masker.encode(normalize_record(record, "t", completion_only_loss=options.get("completion_only_loss"),
                                             dataset_text_field=options.get("dataset_text_field", "text")))
    assert (encoded.input_ids, encoded.labels) == (row["input_ids"], row["labels"])
    assert highlight(encoded, plain=True) == expected
    marked = "".join(re.findall(r"\[\[(.*?)\]\]", expected, flags=re.S))
    assert qwen3.decode([label for label in row["labels"] if label != -100]) == marked


def gsm8k(assets, n: int) -> list[list[dict]]:
    lines = (assets / "chat" / "gsm8k_messages_train.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["messages"] for line in lines]


def records_as(shape: str, conversations: list[list[dict]]) -> list[dict]:
    """The same GSM8K conversations in one of TRL's dataset formats."""
    if shape == "messages":
        return [{"messages": messages} for messages in conversations]
    if shape == "prompt-completion":
        return [{"prompt": messages[:-1], "completion": messages[-1:]} for messages in conversations]
    if shape == "plain prompt-completion":
        return [{"prompt": messages[-2]["content"], "completion": " " + messages[-1]["content"]}
                for messages in conversations]
    return [{"body": messages[-1]["content"]} for messages in conversations]


@pytest.fixture(scope="module")
def trl_prepare(qwen3, tmp_path_factory):
    """TRL 1.16's own dataset preparation (`SFTTrainer._prepare_dataset`) with the given `SFTConfig` fields, as
    `trl sft` runs it (no `{% generation %}` template: `assistant_only_loss` off, TRL's default)."""
    config = Qwen3Config(vocab_size=len(qwen3), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    args = SFTConfig(output_dir=str(tmp_path_factory.mktemp("trl")), report_to="none", use_cpu=True, bf16=False)
    tiny = Dataset.from_list(records_as("messages", [[{"role": "user", "content": "Hi"},
                                                      {"role": "assistant", "content": "Yo"}]]))
    trainer = SFTTrainer(model=Qwen3ForCausalLM(config), args=args, train_dataset=tiny, processing_class=qwen3)

    def prepare(records: list[dict], **fields) -> Dataset:
        run_args = dataclasses.replace(args, **fields)
        trainer.completion_only_loss = run_args.completion_only_loss is not False and "prompt" in records[0]
        eos = qwen3.eos_token
        qwen3.eos_token = run_args.eos_token or eos  # as SFTTrainer.__init__ sets it
        try:
            return trainer._prepare_dataset(Dataset.from_list(records), qwen3, run_args, run_args.packing, None, "t")
        finally:
            qwen3.eos_token = eos
    return prepare


def as_rows(dataset: Dataset) -> list:
    return [(row["input_ids"], row["labels"]) for row in dataset]


# (name, record shape, TRL's SFTConfig fields, which `sft_data_options` maps to the same `load_sft_data` options)
AS_TRL = [
    ("whole conversation", "messages", {"max_length": None}),
    ("prompt-completion, completion only", "prompt-completion", {"max_length": None}),
    ("prompt-completion, whole", "prompt-completion", {"max_length": None, "completion_only_loss": False}),
    ("plain prompt-completion", "plain prompt-completion", {"max_length": None}),
    ("plain prompt-completion, whole", "plain prompt-completion", {"max_length": None, "completion_only_loss": False}),
    ("plain prompt-completion, another EOS", "plain prompt-completion", {"max_length": None,
                                                                        "eos_token": "<|endoftext|>"}),
    ("language modeling", "text", {"max_length": None, "dataset_text_field": "body"}),
    ("keep the start", "messages", {"max_length": 150}),
    ("keep the end", "messages", {"max_length": 150, "truncation_mode": "keep_end"}),
    ("shuffled", "messages", {"max_length": None, "shuffle_dataset": True, "seed": 3}),
    ("bfd_split packing keeps the overflow", "messages", {"max_length": 160, "packing": True,
                                                          "packing_strategy": "bfd_split"}),
    ("wrapped packing", "messages", {"max_length": 160, "packing": True, "packing_strategy": "wrapped"}),
]


@pytest.mark.parametrize("name, shape, fields", AS_TRL, ids=[c[0] for c in AS_TRL])
def test_rows_equal_trls_own_preparation(qwen3, assets, tmp_path, trl_prepare, name, shape, fields):
    records = records_as(shape, gsm8k(assets, 8))
    theirs = trl_prepare(records, **fields)
    data_file = write_chat_jsonl(records, tmp_path / "d.jsonl")
    options = sft_data_options(SFTScriptArguments(train_file=str(data_file)),
                               ChatSFTConfig(output_dir=str(tmp_path / "out"), assistant_only_loss=False, **fields),
                               None)
    ours = load_sft_data(qwen3, data_file, **options, cache_dir=str(tmp_path / "cache"))
    rows = ours.train
    if fields.get("packing"):  # TRL packs hfl3's rows: its preparation of a dataset of input_ids and labels
        rows = trl_prepare([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows], **fields)
        assert sum(map(len, rows["input_ids"])) == sum(len(r["input_ids"]) for r in ours.train)  # no token lost
        assert options["max_length"] is None and ours.stats["train_file"].truncated == 0
    assert as_rows(rows) == as_rows(theirs)
    if "max_length" in fields and fields["max_length"] and not fields.get("packing"):
        assert ours.stats["train_file"].truncated > 0  # the case cuts rows
    if fields.get("shuffle_dataset"):
        assert as_rows(rows) != as_rows(load_sft_data(qwen3, data_file, assistant_only_loss=False, max_length=None,
                                                      cache_dir=str(tmp_path / "cache")).train)


def test_keep_end_ends_every_cut_row_with_the_last_reply(qwen3, assets, tmp_path):
    data_file = write_chat_jsonl(records_as("messages", gsm8k(assets, 40)), tmp_path / "d.jsonl")
    start = load_sft_data(qwen3, data_file, max_length=120, cache_dir=str(tmp_path / "c"))
    end = load_sft_data(qwen3, data_file, max_length=120, truncation_mode="keep_end", cache_dir=str(tmp_path / "c"))
    end_of_turn = qwen3.convert_tokens_to_ids("<|im_end|>")
    assert all(ids[-2] == end_of_turn for ids in end.train["input_ids"])  # "<|im_end|>", "\n"
    assert sum(ids[-2] == end_of_turn for ids in start.train["input_ids"]) < len(start.train) / 2
    assert (end.stats["train_file"].kept, end.stats["train_file"].dropped_after_truncation) == (40, 0)
    assert start.stats["train_file"].dropped_after_truncation > 0  # the start alone holds no reply
    with pytest.raises(ValueError, match="truncation_mode='keep_middle'; expected one of keep_start, keep_end"):
        load_sft_data(qwen3, data_file, truncation_mode="keep_middle")


@pytest.mark.parametrize("option, value", [
    ("assistant_only_loss", False), ("completion_only_loss", False), ("truncation_mode", "keep_end"),
    ("eos_token", "<|endoftext|>"), ("dataset_text_field", "body"), ("max_length", 64),
    ("split_reasoning_turns", True), ("ignore_empty_reasoning", True)])
def test_every_option_enters_the_cache_fingerprint_and_the_provenance(qwen3, tmp_path, monkeypatch, option, value):
    records = [{"prompt": "Say hi", "completion": " hi"}, {"body": "A text."}, PROMPT_COMPLETION,
               {"messages": [{"role": "user", "content": "Q " * 40}, {"role": "assistant", "content": "A " * 40,
                                                                      "reasoning_content": "R"},
                             {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}]
    data_file = write_chat_jsonl(records, tmp_path / "d.jsonl")
    encoded = []
    original = AssistantMasker.encode
    monkeypatch.setattr(AssistantMasker, "encode", lambda self, *a, **k: encoded.append(1) or original(self, *a, **k))
    cache = str(tmp_path / "cache")
    before = load_sft_data(qwen3, data_file, max_length=128, skip_invalid_records=True, cache_dir=cache)
    count = len(encoded)
    after = load_sft_data(qwen3, data_file, **{"max_length": 128, option: value}, skip_invalid_records=True,
                          cache_dir=cache)
    assert len(encoded) > count  # encoded again, not read from the cache of the other option
    recorded = after.provenance if option == "max_length" else after.provenance["options"]
    assert recorded[option] == value and (before.provenance if option == "max_length" else
                                          before.provenance["options"])[option] != value


def test_sft_data_options_maps_the_recipes_arguments(tmp_path):
    script = SFTScriptArguments(train_file="t.jsonl", eval_file="e.jsonl", skip_invalid_records=True)
    config = ChatSFTConfig(output_dir=str(tmp_path))
    default = sft_data_options(script, config, None)
    assert default == {
        "eval_file": "e.jsonl", "dataset_name": None, "dataset_config": None, "dataset_train_split": None,
        "dataset_test_split": None, "val_split": 0.0, "seed": 42, "max_length": 1024, "truncation_mode": "keep_start",
        "assistant_only_loss": config.assistant_only_loss, "completion_only_loss": None, "eos_token": None,
        "dataset_text_field": "text", "shuffle_dataset": False, "split_reasoning_turns": False,
        "ignore_empty_reasoning": False, "skip_invalid_records": True, "dataset_num_proc": None}

    def options(**fields):
        return sft_data_options(script, ChatSFTConfig(output_dir=str(tmp_path), **fields), None)

    assert options(shuffle_dataset=True)["shuffle_dataset"] is True  # TRL's preparation is skipped: hfl3 shuffles
    assert options(shuffle_dataset=True, packing=True)["shuffle_dataset"] is False  # TRL's preparation shuffles
    assert options(packing=True)["max_length"] == 1024  # bfd cuts the overflow
    for strategy in ("bfd_split", "wrapped"):
        assert options(packing=True, packing_strategy=strategy)["max_length"] is None
    assert options(truncation_mode="keep_end", eos_token="<|endoftext|>", completion_only_loss=False,
                   dataset_text_field="body", assistant_only_loss=not config.assistant_only_loss, seed=7) == {
        **default, "truncation_mode": "keep_end", "eos_token": "<|endoftext|>", "completion_only_loss": False,
        "dataset_text_field": "body", "assistant_only_loss": not config.assistant_only_loss, "seed": 7}
    reasoning = dataclasses.replace(script)
    reasoning.split_reasoning_turns, reasoning.ignore_empty_reasoning = True, True  # until the recipe declares them
    assert sft_data_options(reasoning, ChatSFTConfig(output_dir=str(tmp_path)), None) == {
        **default, "split_reasoning_turns": True, "ignore_empty_reasoning": True}


def test_an_eos_token_outside_the_vocabulary_is_refused_before_encoding(qwen3, tmp_path):
    with pytest.raises(ValueError, match=r"eos_token '<\|nope\|>' is not in the tokenizer's vocabulary"):
        load_sft_data(qwen3, write_chat_jsonl([{"text": "x"}], tmp_path / "d.jsonl"), eos_token="<|nope|>")



def test_a_text_dataset_read_by_dataset_name_gives_the_rows_of_the_same_jsonl(qwen3, tmp_path):
    records = [{"body": f"Document {i}: once upon a time."} for i in range(4)]
    folder = tmp_path / "texts"
    folder.mkdir()
    Dataset.from_list(records).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError, match=r"no chat column \(columns: \['body'\]\)"):
        load_sft_data(qwen3, dataset_name=str(folder), cache_dir=cache)
    read = load_sft_data(qwen3, dataset_name=str(folder), dataset_text_field="body", cache_dir=cache)
    same = load_sft_data(qwen3, write_chat_jsonl(records, tmp_path / "d.jsonl"), dataset_text_field="body",
                         cache_dir=cache)
    assert as_rows(read.train) == as_rows(same.train) and all(r["labels"] == r["input_ids"] for r in read.train)


def test_inspect_cuts_as_truncation_mode_says(tmp_path, assets, capsys):
    data = write_chat_jsonl([OUT_OF_LOSS], tmp_path / "d.jsonl")
    tokenizer = str(assets / "tokenizers" / "qwen3")
    assert inspect_cli.main(["--tokenizer", tokenizer, "--data", str(data), "--plain", "--max_length", "12",
                             "--truncation_mode", "keep_end", "--assistant_only_loss", "false"]) == 0
    out = capsys.readouterr().out
    shown = out.split("\n", 1)[1]  # after "=== where"
    assert shown.startswith("✂ ") and "4<|im_end|>\n]]\n--- tokens 12 (of " in shown
