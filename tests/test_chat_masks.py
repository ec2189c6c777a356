"""Assistant-only masks from the models' own chat templates (real Qwen3 / Gemma 3 tokenizers, Qwen2.5 ChatML, the
L3GPT ChatML tokenizer), cross-checked against TRL's `{% generation %}` training templates; truncation; packing."""

import importlib
import inspect
import re
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl.chat_template_utils import get_training_chat_template, qwen2_5_chat_template, qwen3_training_chat_template
from trl.data_utils import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data import inspect as inspect_cli
from hfl3.data.chat import SFTDataError, normalize_record, write_chat_jsonl
from hfl3.data.masks import AssistantMasker
from hfl3.data.sft import load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats, stdlib_docstring_functions
from hfl3.tokenization import train_tokenizer

EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tokenizers(assets, gemma3_tokenizer):
    qwen3 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    qwen25 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    qwen25.chat_template = qwen2_5_chat_template  # Qwen2.5's template (as TRL ships it) on a real BPE vocabulary
    l3gpt = train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]], vocab_size=600)
    return {"qwen3": qwen3, "qwen2.5": qwen25, "gemma3": gemma3_tokenizer, "l3gpt": l3gpt}


def chat(*turns, system=None):
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": role, "content": content} for role, content in zip(roles, turns)]
    return tuple(([{"role": "system", "content": system}] if system else []) + messages)


def expected_replies(template: str, messages) -> list[str]:
    """What each assistant turn must supervise: the reply as the template writes it, plus the end-of-turn token."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    if template == "gemma3":
        return [r.strip() + "<end_of_turn>" for r in replies]
    if template == "qwen3":  # the stock template keeps the empty think block on the last turn only
        return [r + "<|im_end|>" for r in replies[:-1]] + [EMPTY_THINK + replies[-1] + "<|im_end|>"]
    return [r + "<|im_end|>" for r in replies]


def supervised_runs(tokenizer, input_ids, labels) -> list[str]:
    runs, current = [], []
    for token, label in zip(input_ids, labels):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


CONVERSATIONS = [
    ("single-turn", chat("What is 2+2?", "4")),
    ("single-turn with system", chat("What is 2+2?", "It is 4.", system="Be brief.")),
    ("multi-turn", chat("Hi", "Hello! How can I help?", "Add 2 and 3.", "5", "Thanks", "You're welcome.")),
    ("multi-turn with system", chat("Hi", "Hello!", "2+2?", "4\n\nDone.", system="You are a math tutor.")),
    ("unicode", chat("Héllo 👋 世界, ça va?", "Très bien 😀 — 你好! ∑x²", "Ünïcödé?", "Ja, naïve café ☕.")),
    ("reply with surrounding spaces", chat("Why?", "  Because.  ")),
]
GEMMA3 = pytest.param("gemma3", marks=pytest.mark.gemma3)
TEMPLATES = ["qwen3", "qwen2.5", GEMMA3, "l3gpt"]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("name, messages", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_every_assistant_turn_and_only_it_is_supervised(tokenizers, template, name, messages):
    tokenizer = tokenizers[template]
    encoded = AssistantMasker(tokenizer).encode(messages)
    assert encoded.input_ids == tokenizer(encoded.text, add_special_tokens=False)["input_ids"]
    runs = supervised_runs(tokenizer, encoded.input_ids, encoded.labels)
    assert runs == expected_replies(template, messages)
    # The role header right before every reply is outside the mask
    header = {"gemma3": "<start_of_turn>model\n"}.get(template, "<|im_start|>assistant\n")
    for start, _ in encoded.spans:
        assert encoded.text[:start].endswith(header)
    if template == "gemma3" and messages[0]["role"] == "system":  # folded into the first user turn, unsupervised
        assert f"<start_of_turn>user\n{messages[0]['content']}\n\n" in encoded.text


@pytest.mark.parametrize("template, end_of_turn", [("qwen3", "<|im_end|>"), ("l3gpt", "<|im_end|>"),
                                                   pytest.param("gemma3", "<end_of_turn>", marks=pytest.mark.gemma3)])
def test_end_of_turn_comes_from_the_template(tokenizers, template, end_of_turn):
    assert AssistantMasker(tokenizers[template]).end_of_turn == end_of_turn


def strip_generation_markers(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def trl_masks(tokenizer, template, messages):
    out = tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return out["input_ids"], out["assistant_masks"]


def assert_agrees_with_trl(tokenizer, ours, trl_ids, trl_mask):
    """Same tokens; our supervised positions are TRL's minus whitespace tokens right at a reply's edges (TRL's
    training templates put the newline after the end-of-turn token, and Qwen2.5's the one after the role header,
    inside `{% generation %}`; the model never generates either: generation starts after the header and stops at
    the end-of-turn token)."""
    assert ours.input_ids == trl_ids
    supervised = [label != -100 for label in ours.labels]
    assert any(supervised)
    for position, (mine, theirs) in enumerate(zip(supervised, trl_mask)):
        if mine:
            assert theirs, (position, tokenizer.decode([trl_ids[position]]))
        elif theirs:
            assert tokenizer.decode([trl_ids[position]]).strip() == "", position
            at_edge = (position > 0 and supervised[position - 1]) or (
                position + 1 < len(supervised) and supervised[position + 1]
            )
            assert at_edge, position


@pytest.mark.parametrize("name, messages", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
@pytest.mark.parametrize("template", ["qwen2.5", GEMMA3])
def test_masks_agree_with_trl_training_templates(tokenizers, template, name, messages):
    tokenizer = tokenizers[template]
    training_template = get_training_chat_template(tokenizer)  # TRL recognises the stock template
    ours = AssistantMasker(tokenizer).encode(messages)
    assert_agrees_with_trl(tokenizer, ours, *trl_masks(tokenizer, training_template, messages))


@pytest.mark.parametrize("name, messages", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_qwen3_masks_agree_with_trl(tokenizers, name, messages):
    tokenizer = tokenizers["qwen3"]
    trl_ids, trl_mask = trl_masks(tokenizer, qwen3_training_chat_template, messages)
    if sum(m["role"] == "assistant" for m in messages) == 1:
        # One assistant turn: TRL's training template renders it exactly like the stock template
        ours = AssistantMasker(tokenizer).encode(messages)
        assert_agrees_with_trl(tokenizer, ours, trl_ids, trl_mask)
    # Several turns: TRL's template keeps the think block in every turn, so compare our method on that template
    ours = AssistantMasker(tokenizer, strip_generation_markers(qwen3_training_chat_template)).encode(messages)
    assert_agrees_with_trl(tokenizer, ours, trl_ids, trl_mask)


@pytest.mark.parametrize("template", TEMPLATES)
def test_truncation_keeps_the_start_then_drops_rows_without_supervision(tokenizers, template, tmp_path):
    tokenizer = tokenizers[template]
    messages = chat("Hi", "Hello there, friend!", "And now a long answer please.", "word " * 40)
    full = AssistantMasker(tokenizer).encode(messages)
    first_reply_end = full.spans[0][1]
    cut_in_second_reply = next(i for i, (s, _) in enumerate(full.offsets) if s >= full.spans[1][0]) + 5
    prompt_only = next(i for i, (s, _) in enumerate(full.offsets) if s >= full.spans[0][0])
    data = write_chat_jsonl([{"messages": list(messages)}], tmp_path / "chat.jsonl")
    for max_length in (cut_in_second_reply, len(full.input_ids)):
        result = load_sft_data(tokenizer, data, max_length=max_length, cache_dir=str(tmp_path / "cache"))
        stats, [row] = result.stats["train_file"], result.train
        assert (stats.kept, stats.dropped_after_truncation) == (1, 0)
        assert row["input_ids"] == full.input_ids[:max_length] and row["labels"] == full.labels[:max_length]
        assert stats.truncated == (max_length < len(full.input_ids))
        assert stats.supervised_tokens == sum(label != -100 for label in row["labels"][1:])
        runs = supervised_runs(tokenizer, row["input_ids"], row["labels"])
        expected = expected_replies(template, messages)
        assert runs[0] == expected[0] and expected[1].startswith(runs[-1])
    with pytest.raises(SFTDataError, match="no usable conversation left .*'dropped_after_truncation': 1"):
        load_sft_data(tokenizer, data, max_length=prompt_only, cache_dir=str(tmp_path / "cache"))
    assert full.offsets[prompt_only - 1][1] <= first_reply_end


def tiny_qwen3(tokenizer):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_l3gpt(tokenizer):
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32, max_position_embeddings=256,
        window_pattern="L", l3_after_layers=[0], l3_n_emb=4 * len(tokenizer), l3_k_max=16, l3_d_up=32,
    )
    model = L3GPTForCausalLM(config).eval()
    with torch.no_grad():  # output projections start at zero (nanochat): give them values, or attention is invisible
        for parameter in model.parameters():
            if parameter.ndim == 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    return model


@pytest.mark.parametrize("template, build", [("qwen3", tiny_qwen3), ("l3gpt", tiny_l3gpt)])
def test_packed_conversations_keep_their_labels_and_do_not_attend_to_each_other(tokenizers, template, build):
    tokenizer = tokenizers[template]
    masker = AssistantMasker(tokenizer)
    conversations = [chat("Hi", "Hello!"), chat("What is 2+2?", "4", system="Be brief."), chat("Bye", "See you."),
                     chat("Name a colour.", "Blue, like the sea."), chat("Ok?", "Ok.")]
    rows = [masker.encode(messages) for messages in conversations]
    dataset = Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "labels": [r.labels for r in rows]})
    packed = pack_dataset(dataset, seq_length=max(len(r.input_ids) for r in rows) + 8, strategy="bfd")
    assert 1 < len(packed) < len(rows)  # several rows, some with several conversations
    # TRL's padding-free collator, as SFTTrainer uses with packing: all rows concatenated into one sequence
    batch = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=True)(list(packed))
    assert "attention_mask" not in batch
    model = build(tokenizer)
    # use_cache=False as in training: transformers detects packing from position_ids only without a KV cache
    with torch.no_grad():
        output = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    packed_logits, start = output.logits[0], 0
    for length in [length for row in packed for length in row["seq_lengths"]]:
        segment = batch["input_ids"][0, start : start + length]
        row = next(r for r in rows if r.input_ids == segment.tolist())
        # Only each segment's first label is masked, which no loss reads (and would cross conversations)
        assert batch["labels"][0, start].item() == -100
        assert batch["labels"][0, start + 1 : start + length].tolist() == row.labels[1:]
        with torch.no_grad():
            alone = model(input_ids=segment[None], use_cache=False).logits[0]
        torch.testing.assert_close(packed_logits[start : start + length], alone, atol=1e-4, rtol=1e-4)
        start += length
    assert start == batch["input_ids"].shape[1]
    # Control: with a KV cache transformers skips the packed-sequence mask, and later segments see earlier ones
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits[0]
    first = len(packed[0]["input_ids"]) if len(packed[0]["seq_lengths"]) == 1 else packed[0]["seq_lengths"][0]
    assert not torch.allclose(leaky[first:], packed_logits[first:], atol=1e-3)


def test_inspect_marks_exactly_the_supervised_text(tmp_path, capsys, monkeypatch, assets):
    messages = chat("Hi 👋", "Hello! 😀", "2+2?", "4", system="Be brief.")
    data = write_chat_jsonl([{"messages": list(messages)}, {"messages": "not a list"}], tmp_path / "chats.jsonl")
    tokenizer = str(assets / "tokenizers" / "qwen3")
    assert inspect_cli.main(["--tokenizer", tokenizer, "--data", str(data), "--n", "5", "--plain"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== ") == 2 and f"=== {data}:2: 'messages' must be a non-empty list" in out  # with its reason
    assert re.findall(r"\[\[(.*?)\]\]", out, flags=re.S) == expected_replies("qwen3", messages)
    inspect_cli.main(["--tokenizer", tokenizer, "--data", str(data), "--plain", "--max_length", "12"])
    out = capsys.readouterr().out
    assert "✂" in out and "[[" not in out and "tokens 12 (of " in out
    inspect_cli.main(["--tokenizer", tokenizer, "--data", str(data)])  # not a terminal: no ANSI codes
    out = capsys.readouterr().out
    assert "\033[" not in out and out.count("[[") == 2
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    inspect_cli.main(["--tokenizer", tokenizer, "--data", str(data)])
    out = capsys.readouterr().out
    assert out.count(inspect_cli.GREEN) == 2 and "[[" not in out


def test_stdlib_docstring_chats_are_real_deterministic_and_maskable(tokenizers):
    chats = stdlib_docstring_chats(40, seed=5)
    assert chats == stdlib_docstring_chats(40, seed=5) and chats != stdlib_docstring_chats(40, seed=6)
    assert len({c["source"] for c in chats}) == 40
    masker = AssistantMasker(tokenizers["l3gpt"])
    for chat_ in chats:
        messages = normalize_record(chat_, chat_["source"]).messages
        module_name, _, function_name = chat_["source"].removeprefix("stdlib:").rpartition(".")
        function = getattr(importlib.import_module(module_name), function_name)
        question, answer = messages[-2]["content"], messages[-1]["content"]
        signature = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(function)))
        assert f"`{module_name}.{function_name}{signature}`" in question
        assert " ".join(answer.split()) in " ".join(inspect.getdoc(function).split())
        encoded = masker.encode(messages)
        assert supervised_runs(tokenizers["l3gpt"], encoded.input_ids, encoded.labels) == [answer + "<|im_end|>"]
    assert any(c["messages"][0]["role"] == "system" for c in chats)
    assert any(c["messages"][0]["role"] == "user" for c in chats)
    with pytest.raises(ValueError, match="documented functions"):
        stdlib_docstring_chats(100_000)


def test_stdlib_docstring_functions_carry_no_memory_addresses():
    # Ranks of a distributed run each build the chats; an address in a signature would give each rank other data
    functions = stdlib_docstring_functions()
    assert any("<object object>" in signature for _, signature, _ in functions)  # e.g. inspect.getattr_static
    assert not [name for name, signature, _ in functions if re.search(r"0x[0-9a-fA-F]{6,}", signature)]
