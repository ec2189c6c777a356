"""ChatCORE (hfl3.evaluate.chat_tasks, chat_generation, chatcore, chatcore_cli) on the fixture rows of each task
(tests/fixtures/chatcore: real ARC, MMLU and HumanEval rows; GSM8K rows from the GSM8K chat fixture, see its README).

nanochat's numbers themselves are checked by tests/test_chatcore_parity.py (nanochat's code, where a checkout is);
here: the data path (shuffle, subsets, errors), the answer checks, the calculator and its forcing, batched scoring and
generation against one problem at a time, the command line with an adapter, and what it records in an hfl3 folder.
"""

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from hfl3.evaluate import chatcore_cli
from hfl3.evaluate.chat_generation import (
    TOOL_TOKENS, CalculatorTool, calculate, generate_completions, greedy_config, letter_logits, prompt_ids,
    stop_token_ids,
)  # fmt: skip
from hfl3.evaluate.chat_tasks import (
    TASKS, data_problem, final_answer, gsm8k_number, gsm8k_reference, humaneval_program, load_problems,
    render_multiple_choice,
)  # fmt: skip
from hfl3.evaluate.chatcore import chatcore_eval_results, evaluate_chatcore
from hfl3.evaluate.execution import run_python

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def data_dir(assets):
    return assets / "chatcore"


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, assets):
    """A tiny random Qwen3 with the real Qwen3 tokenizer and chat template, saved as a folder."""
    folder = tmp_path_factory.mktemp("qwen3_tiny")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_problems_are_nanochats_shuffled_subset(data_dir):
    rows = [json.loads(line) for line in (data_dir / "allenai/ai2_arc/ARC-Easy/test.jsonl").read_text().splitlines()]
    order = np.random.default_rng(42).permutation(len(rows))  # nanochat's HubDataset.shuffle(42)
    problems = load_problems("ARC-Easy", data_dir, max_problems=5)
    assert [p.prompt for p in problems] == [render_multiple_choice(rows[i]["question"], rows[i]["choices"]["label"],
                                                                   rows[i]["choices"]["text"]) for i in order[:5]]
    everything = load_problems("ARC-Easy", data_dir)
    assert len(everything) == len(rows) and everything[:5] == problems
    # the rows' own letters: five choices, and digits instead of letters
    assert {p.letters for p in everything} >= {("A", "B", "C", "D", "E"), ("1", "2", "3", "4")}
    first = rows[order[0]]
    assert problems[0].prompt == ("Multiple Choice question: " + first["question"] + "\n" + "".join(
        f"- {c}={letter}\n" for c, letter in zip(first["choices"]["text"], first["choices"]["label"]))
        + "\nRespond only with the letter of the correct answer.")
    mmlu = load_problems("MMLU", data_dir)
    assert all(p.letters == ("A", "B", "C", "D") and p.answer in p.letters for p in mmlu)


def test_missing_or_bad_data_is_one_line(tmp_path, data_dir, monkeypatch):
    message = data_problem(["GSM8K", "HumanEval"], tmp_path)
    assert "\n" not in message and "hf download openai/gsm8k --repo-type dataset --include 'main/test-*'" in message
    assert "openai/openai_humaneval" in message and f"--local-dir {tmp_path}/openai/gsm8k" in message
    assert data_problem(list(TASKS), data_dir) is None
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    assert "downloads are off" in data_problem(["MMLU"], None) and "--data_dir DATA_DIR" in data_problem(["MMLU"], None)
    bad = tmp_path / "openai" / "gsm8k" / "main"
    bad.mkdir(parents=True)
    (bad / "test.jsonl").write_text(json.dumps({"question": "q", "solution": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="GSM8K: .* has no column answer"):
        load_problems("GSM8K", tmp_path)
    arc = tmp_path / "allenai" / "ai2_arc" / "ARC-Easy"
    arc.mkdir(parents=True)
    (arc / "test.jsonl").write_text(json.dumps({"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]},
                                                "answerKey": "C"}) + "\n")
    with pytest.raises(ValueError, match="shuffled row 0: answerKey 'C' is not one of its labels"):
        load_problems("ARC-Easy", tmp_path)


def test_answer_checks():
    assert gsm8k_number("so 1,234 in all.\n#### 1,234") == "1234" and gsm8k_number("no marker 12") is None
    assert gsm8k_reference("2 + 3 = <<2+3=5>>5 so #### 5") == "5"
    assert gsm8k_number("#### -3.5 and #### 7") == "-3.5"  # the first marker, as nanochat's regex search
    assert final_answer("<think>\n#### 1\n</think>\n\n#### 2") == "\n\n#### 2" and final_answer("#### 3") == "#### 3"


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(data_dir):
    rows = [json.loads(line) for line in
            (data_dir / "openai/openai_humaneval/openai_humaneval/test.jsonl").read_text().splitlines()]
    for row in rows[:4]:
        fenced = f"Here it is:\n```python\n{row['prompt']}{row['canonical_solution']}\n```\nDone."
        assert run_python(humaneval_program(row, fenced)).success, row["task_id"]
        body = row["prompt"] + "    return None\n"
        result = run_python(humaneval_program(row, body))
        assert not result.success and result.error, row["task_id"]


def test_calculator():
    cases = {"16 - 3 - 4": 9, "3/2": 1.5, "1,000 + 1": 1001, "7 // 2": 3, "-(4 - 10)": 6, "'strawberry'.count('r')": 3,
             "2 ** 8": None, "1/0": None, "len('abc')": None, "'x'.__class__": None, "import os": None,
             "'a'.center(10000000000).count('a')": None, "__import__('os')": None}
    assert {expression: calculate(expression) for expression in cases} == cases


def test_calculator_tokens_are_forced(assets):
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    tokenizer.add_special_tokens({"additional_special_tokens": list(TOOL_TOKENS)})
    tool = CalculatorTool.for_tokenizer(tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in TOOL_TOKENS}
    expression = tokenizer("12*3", add_special_tokens=False)["input_ids"]
    script = [ids["<|python_start|>"], *expression, ids["<|python_end|>"]]  # what the model "chooses"
    processor = tool.processor(prompt_length=2, batch_size=2)
    rows = torch.tensor([[5, 6], [5, 6]])
    chosen = []
    for step in range(len(script) + 5):
        scores = torch.zeros(2, len(tokenizer))
        scores[:, script[step] if step < len(script) else 7] = 1.0  # row 1 follows the same script
        scores = processor(rows, scores)
        chosen.append(scores.argmax(-1))
        rows = torch.cat([rows, chosen[-1][:, None]], dim=1)
    expected = [ids["<|output_start|>"], *tokenizer("36", add_special_tokens=False)["input_ids"],
                ids["<|output_end|>"], 7]  # then the model's own choice again
    assert rows[0, 2 + len(script):].tolist()[:len(expected)] == rows[1, 2 + len(script):].tolist()[:len(expected)] \
        == expected
    assert tool.calls == 2 and CalculatorTool.for_tokenizer(AutoTokenizer.from_pretrained(
        assets / "tokenizers" / "qwen3")) is None  # no tool tokens, no tool


def test_batched_scoring_and_generation_equal_one_at_a_time(tiny_chat_model, data_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    problems = load_problems("MMLU", data_dir)
    rows = prompt_ids(tokenizer, [p.prompt for p in problems])
    assert len({len(row) for row in rows}) > 3  # prompts of different lengths: padding matters
    letters = [tokenizer.convert_tokens_to_ids(list(p.letters)) for p in problems]
    batched = letter_logits(model, rows, letters, tokenizer.pad_token_id)
    with torch.no_grad():
        alone = [model(torch.tensor([row])).logits[0, -1, ids].tolist() for row, ids in zip(rows, letters)]
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(alone), rtol=1e-4, atol=1e-4)
    gsm8k = prompt_ids(tokenizer, [p.prompt for p in load_problems("GSM8K", data_dir, 5)])
    stops = stop_token_ids(model, tokenizer)
    together = generate_completions(model, tokenizer, gsm8k, max_new_tokens=12, batch_size=5, stop_ids=stops,
                                    tool=None, pad_token_id=tokenizer.pad_token_id)
    config = greedy_config(model, max_new_tokens=12, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    for row, (reply, cut) in zip(gsm8k, together):
        single = model.generate(torch.tensor([row]), generation_config=config)[0, len(row):].tolist()
        assert reply == [t for t in single if t not in stops][:len(reply)] and cut == (len(reply) == 12)


def test_evaluate_chatcore_and_its_results(tiny_chat_model, data_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model)
    problems = {name: load_problems(name, data_dir, 4) for name in TASKS}
    model.train()
    results = evaluate_chatcore(model, tokenizer, problems, max_new_tokens=8, batch_size=3)
    assert model.training  # put back as it was
    assert [task.name for task in results.tasks] == list(TASKS)
    centered = [(t.accuracy - t.baseline) / (1 - t.baseline) for t in results.tasks]
    assert results.chatcore == pytest.approx(sum(centered) / 5) and results.chatcore_cat == pytest.approx(
        sum(centered[:3]) / 3)
    assert all(len(t.passed) == 4 and t.accuracy == sum(t.passed) / 4 for t in results.tasks)
    assert results.tasks[3].cut_at_max_new_tokens + results.tasks[4].cut_at_max_new_tokens > 0
    metrics = results.metrics("eval_")
    assert set(metrics) == {"eval_chatcore_metric", "eval_chatcore_cat", *(f"eval_chatcore/{n}" for n in TASKS)}
    partial = evaluate_chatcore(model, tokenizer, {"GSM8K": problems["GSM8K"]}, max_new_tokens=4)
    assert partial.chatcore is None and partial.chatcore_cat is None and "needs all five" in partial.table()
    entries = chatcore_eval_results(results.summary())
    assert entries[0].metric_type == "chatcore_metric" and [e.dataset_name for e in entries[1:]] == list(TASKS)


def test_command_line_with_an_adapter_records_in_the_hfl3_folder(tiny_chat_model, data_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from hfl3.provenance import build_metadata, stamp_folder

    base = AutoModelForCausalLM.from_pretrained(tiny_chat_model)
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
                   ).save_pretrained(adapter)
    stamp_folder(adapter, build_metadata(kind="test adapter"), {"title": "adapter", "library_name": "peft"})
    output = tmp_path / "chatcore.json"
    args = ["--model_name_or_path", str(tiny_chat_model), "--adapter", str(adapter), "--data_dir", str(data_dir),
            "--max_cat", "3", "--max_sample", "2", "--max_new_tokens", "6", "--dtype", "float32",
            "--output_json", str(output)]
    written = chatcore_cli.main(args)
    printed = capsys.readouterr().out
    assert "ChatCORE" in printed and "HumanEval" in printed and written["chatcore"] is not None
    saved = json.loads(output.read_text())
    assert saved["tasks"]["ARC-Easy"]["problems"] == 3 and saved["tasks"]["GSM8K"]["problems"] == 2
    assert str(tmp_path) not in output.read_text()  # no local path
    metadata = json.loads((adapter / "metadata.json").read_text())
    assert metadata["kind"] == "test adapter" and metadata["evaluation"]["chatcore"]["chatcore"] == saved["chatcore"]
    card = (adapter / "README.md").read_text()
    assert "model-index" in card and "chatcore_metric" in card and "allenai/ai2_arc" in card
    again = chatcore_cli.main(args)  # a second evaluation replaces the first in the card
    assert math.isclose(again["chatcore"], written["chatcore"])
    assert (adapter / "README.md").read_text().count("chatcore_metric") == card.count("chatcore_metric")


def test_command_line_refuses_in_one_line(tiny_chat_model, tmp_path, capsys):
    for args, expected in ((["--tasks", "ARC"], "--tasks ARC: expected"),
                           (["--max_problems", "0"], "--max_problems 0: expected"),
                           (["--data_dir", str(tmp_path)], "has no copy of ARC-Easy")):
        with pytest.raises(SystemExit) as exit_info:
            chatcore_cli.main(["--model_name_or_path", str(tiny_chat_model), *args])
        assert exit_info.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_two_processes_take_their_shares_and_equal_one(tiny_chat_model, data_dir, tmp_path):
    """`torchrun --nproc_per_node 2 -m hfl3.evaluate chatcore`: each rank takes every other problem (the tasks' counts
    are odd: the shares differ), the outcomes are summed, rank 0 writes what one process computes alone."""
    import os
    import subprocess
    import sys

    common = ["--model_name_or_path", str(tiny_chat_model), "--data_dir", str(data_dir), "--max_cat", "5",
              "--max_sample", "3", "--max_new_tokens", "6", "--dtype", "float32", "--batch_size", "2", "--use_cpu"]
    alone = chatcore_cli.main([*common, "--output_json", str(tmp_path / "one.json")])
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    result = subprocess.run([torchrun, "--nproc_per_node", "2", "-m", "hfl3.evaluate", "chatcore", *common,
                             "--output_json", str(tmp_path / "two.json")], capture_output=True, text=True,
                            timeout=500, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["settings"]["num_processes"] == 2 and alone["settings"]["num_processes"] == 1
    for name in TASKS:
        mine, theirs = alone["tasks"][name], two["tasks"][name]
        assert (theirs["problems"], theirs["passed"], theirs["cut_at_max_new_tokens"]) == (
            mine["problems"], mine["passed"], mine["cut_at_max_new_tokens"]), name
    assert two["chatcore"] == pytest.approx(alone["chatcore"])
