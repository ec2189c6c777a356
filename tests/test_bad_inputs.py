"""Bad inputs and bad arguments: each gets its exact error, naming the fix, before any data work (a mistyped path
or name: one line naming the argument, the value and what was expected, exit status 2), or a counted skip; a
diverging run stops at the first non-finite loss, gradient norm or parameter, naming the step, with nothing
non-finite saved."""

import codecs
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import httpx2  # huggingface_hub's HTTP client: builds the answers its errors come from
import huggingface_hub
import numpy as np
import pytest
import torch
from datasets import Dataset
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import hf_raise_for_status
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from hfl3 import L3GPTConfig, L3GPTForCausalLM, fp8
from hfl3.data import sources, streaming
from hfl3.data.chat import InvalidChatRecord, write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.tokenization import train_tokenizer
from hfl3.trainers import arguments as recipe_arguments
from hfl3.trainers.guards import NonFiniteTrainingError, check_vocabulary_fits
from hfl3.trainers.arguments import parse_recipe_args
from hfl3.trainers.pretrain import PretrainTrainer, PackedCollator, PretrainConfig
from hfl3.trainers.sft import ChatSFTTrainer, ChatSFTConfig
from recipe_setup import set_up_recipe

BOM = codecs.BOM_UTF8
LORA = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
S, U, A = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!"})


def line(messages, record_id="x") -> bytes:
    return json.dumps({"id": record_id, "messages": messages}).encode() + b"\n"


@pytest.fixture(scope="module")
def qwen3(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")


# ---- chat records -------------------------------------------------------------------------------------------------

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


def test_a_tokenizer_larger_than_the_embeddings_is_refused(qwen3):
    config = Qwen3Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=rf"has {len(qwen3)} tokens .* has 1000 embedding rows: token ids >= 1000 "
                                         r"have no embedding\. Use the model's own tokenizer"):
        check_vocabulary_fits(qwen3, Qwen3ForCausalLM(config))
    check_vocabulary_fits(qwen3, Qwen3ForCausalLM(Qwen3Config(**{**config.to_dict(), "vocab_size": len(qwen3)})))
    # with the data to be fed: only ids that occur (and the pad id: Qwen3's is 151643) must have a row
    with pytest.raises(ValueError, match=r"the data hold token id 151643 .* has 1000 embedding rows"):
        check_vocabulary_fits(qwen3, Qwen3ForCausalLM(config), [Dataset.from_dict({"input_ids": [[5, 999]]})])


# ---- arguments ----------------------------------------------------------------------------------------------------

def load_recipe(repo_root, name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", repo_root / "recipes" / f"{name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


ARGUMENT_ERRORS = [  # (recipe, arguments, what the one message says)
    ("pretrain", ["--learning_rate", "0"], "learning_rate=0.0: expected a positive learning rate (0 trains nothing"),
    ("pretrain", ["--learning_rate", "-0.01"], "learning_rate=-0.01: expected a positive learning rate"),
    ("pretrain", ["--max_steps", "0"], "max_steps=0: expected a positive number of optimizer steps, or -1"),
    ("sft_lora", ["--learning_rate", "0"], "learning_rate=0.0: expected a positive learning rate"),
    ("sft_lora", ["--learning_rate", "-0.01"], "learning_rate=-0.01: expected a positive learning rate"),
    ("sft_lora", ["--max_steps", "0"], "max_steps=0: expected a positive number of optimizer steps"),
    ("sft_lora", ["--max_steps", "-5"], "max_steps=-5: expected a positive number of optimizer steps"),
    ("sft_lora", ["--num_train_epochs", "0"], "num_train_epochs=0.0 with max_steps=-1 trains nothing"),
]


@pytest.mark.parametrize("name, arguments, message", ARGUMENT_ERRORS)
def test_a_bad_training_argument_is_refused_while_parsing(repo_root, capsys, monkeypatch, name, arguments, message):
    monkeypatch.chdir(repo_root)
    config = ["--config", f"recipes/configs/{'pretrain_tiny' if name == 'pretrain' else 'sft_tiny'}.yaml"]
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_args(load_recipe(repo_root, name).make_parser(), config + arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


# ---- paths and names typed into a recipe ----------------------------------------------------------------------

JSONL = 'a chat JSONL file (one {"messages": [...]} per line, or {"text": ...}; gzip-compressed too)'
MODEL = "a model folder (config.json and weights, as save_pretrained writes them) or a Hub model id"
TOKENIZER = ("a tokenizer folder (tokenizer.json or tokenizer_config.json, as save_pretrained writes them) or a Hub "
             "id")
CORPUS = ("stdlib, a text/.jsonl/.json/.parquet file, a folder or glob of them, or a datasets name (Hub id or "
          "folder)")
RESUME = "a checkpoint-N folder, or latest (the newest complete checkpoint in --output_dir)"
NOT_EMPTY = ("not empty (old.txt); pass --resume_from_checkpoint latest to continue its run, --overwrite_output_dir to "
             "replace it when this run finishes, or another --output_dir")
INPUT_ERRORS = [  # (recipe, arguments after valid ones, the exact message); {tmp}: a folder of valid inputs
    ("sft_lora", ["--train_file", "/nonexistent.jsonl"],
     f"--train_file /nonexistent.jsonl: no such file; expected {JSONL}"),
    ("sft_lora", ["--eval_file", "{tmp}"], f"--eval_file {{tmp}}: is a folder; expected {JSONL}"),
    ("sft_lora", ["--model_name_or_path", "/nonexistent_model"],
     f"--model_name_or_path /nonexistent_model: no such folder; expected {MODEL}"),
    ("sft_lora", ["--model_name_or_path", "{tmp}/tokenizer"],
     f"--model_name_or_path {{tmp}}/tokenizer: the folder holds no config.json; expected {MODEL}"),
    ("sft_lora", ["--model_name_or_path", "{tmp}/train.jsonl"],
     f"--model_name_or_path {{tmp}}/train.jsonl: is a file; expected {MODEL}"),
    ("sft_lora", ["--model_name_or_path", "nobody/no-such-model"],
     "--model_name_or_path nobody/no-such-model: no such file or folder, and HF_HUB_OFFLINE=1 with no copy of the Hub "
     f"model nobody/no-such-model in the local cache; expected {MODEL}"),
    ("sft_lora", ["--gguf_file", "model.Q8_0.gguf"],
     "--gguf_file {tmp}/model/model.Q8_0.gguf: no such file; expected a GGUF file inside --model_name_or_path"),
    ("sft_lora", ["--tokenizer_name_or_path", "/nope"],
     f"--tokenizer_name_or_path /nope: no such folder; expected {TOKENIZER}"),
    ("sft_lora", ["--chat_template_path", "{tmp}/template.txt"], "--chat_template_path {tmp}/template.txt: not a "
     ".jinja or .j2 file; expected a Jinja chat template file (applied before tokenization)"),
    ("sft_lora", ["--chat_template_path", "/nope.jinja"], "--chat_template_path /nope.jinja: no such file; expected a "
     "Jinja chat template file (applied before tokenization)"),
    ("sft_lora", ["--resume_from_checkpoint", "{tmp}/out/checkpoint-9"],
     f"--resume_from_checkpoint {{tmp}}/out/checkpoint-9: no such folder; expected {RESUME}"),
    ("sft_lora", ["--output_dir", "{tmp}/train.jsonl"],
     "--output_dir {tmp}/train.jsonl: is a file; expected a folder (created if missing)"),
    ("sft_lora", ["--output_dir", "{tmp}/full"], f"--output_dir {{tmp}}/full: {NOT_EMPTY}"),
    ("sft_lora", ["--push_to_hub"], "--push_to_hub needs --hub_model_id USER/NAME"),
    ("sft_lora", ["--push_to_hub", "--hub_model_id", "me/my adapter"],
     "--hub_model_id me/my adapter: not a Hub repository id; expected USER/NAME"),
    ("sft_lora", ["--push_to_hub", "--hub_model_id", "me/adapter"], "--push_to_hub: HF_HUB_OFFLINE=1 is set, so the "
     "upload that ends the run would fail; unset it, or drop --push_to_hub and upload the output folder later"),
    ("sft_lora", ["--base_model_hub_id", "me/base model"], "--base_model_hub_id me/base model: not a Hub repository "
     "id; expected USER/NAME, the Hub repository of --model_name_or_path"),
    ("sft_lora", ["--stdlib_chats", "4"], "give exactly one of --dataset_name, --train_file and --stdlib_chats"),
    ("pretrain", ["--dataset", "/nonexistent_dir"],
     f"--dataset /nonexistent_dir: no such file or folder; expected {CORPUS}"),
    ("pretrain", ["--dataset", "stdlib,{tmp}/novel.txt"],
     f"--dataset stdlib,{{tmp}}/novel.txt (entry {{tmp}}/novel.txt): no such file or folder; expected {CORPUS}"),
    ("pretrain", ["--dataset", "{tmp}/*.parquet"],
     f"--dataset {{tmp}}/*.parquet: the pattern matches no file; expected {CORPUS}"),
    ("pretrain", ["--dataset", "nobody/no-such-dataset"], "--dataset nobody/no-such-dataset: no such file or folder, "
     "and HF_HUB_OFFLINE=1 with no copy of the Hub dataset nobody/no-such-dataset in the local cache; expected "
     f"{CORPUS}"),
    ("pretrain", ["--eval_dataset", "/nope.txt"],
     f"--eval_dataset /nope.txt: no such file or folder; expected {CORPUS}"),
    ("pretrain", ["--tokenizer_name_or_path", "/nope"], f"--tokenizer_name_or_path /nope: no such folder; expected "
     f"{TOKENIZER}"),
    ("pretrain", ["--tokenizer_name_or_path", "{tmp}/full"], "--tokenizer_name_or_path {tmp}/full: the folder holds "
     f"no tokenizer.json or tokenizer_config.json; expected {TOKENIZER}"),
    ("pretrain", ["--resume_from_checkpoint", "/nope/checkpoint-4"],
     f"--resume_from_checkpoint /nope/checkpoint-4: no such folder; expected {RESUME}"),
    ("pretrain", ["--output_dir", "{tmp}/full"], f"--output_dir {{tmp}}/full: {NOT_EMPTY}"),
]


@pytest.fixture(scope="module")
def valid_inputs(tmp_path_factory, assets) -> Path:
    """A folder with what the recipes accept: `model/` (a tiny Qwen3 with Qwen3's tokenizer), `tokenizer/` (Qwen3's),
    `train.jsonl`, `hub_style/` (a dataset folder with train and test splits); and what they refuse: `template.txt`
    (a chat template with the wrong suffix), `full/` (a non-empty output folder)."""
    folder = tmp_path_factory.mktemp("inputs")
    config = Qwen3Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    Qwen3ForCausalLM(config).save_pretrained(folder / "model")
    for name in ("model", "tokenizer"):  # the model's folder holds its tokenizer, as save_pretrained writes them
        AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3").save_pretrained(folder / name)
    write_chat_jsonl(stdlib_docstring_chats(2, seed=0), folder / "train.jsonl")
    (folder / "template.txt").write_text("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    (folder / "full").mkdir()
    (folder / "full" / "old.txt").write_text("a finished run")
    (folder / "hub_style").mkdir()  # a dataset folder as the Hub lays it out: one parquet file per split
    for split in ("train", "test"):
        Dataset.from_list(stdlib_docstring_chats(2, seed=0)).to_parquet(str(folder / "hub_style" / f"{split}.parquet"))
    return folder


def parse_error(repo_root, capsys, name: str, arguments: list[str]) -> str:
    """Parse and check `arguments` as the recipe's `__main__` does; return the message of the error it must end with."""
    with pytest.raises(SystemExit) as exit_info:
        set_up_recipe(load_recipe(repo_root, name), arguments)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()  # argparse's usage line, then the one error line
    assert usage.startswith("usage: ")
    return error.split(": error: ", 1)[1]


@pytest.mark.parametrize("name, arguments, message", INPUT_ERRORS)
def test_a_mistyped_path_or_name_is_one_line_before_any_work(repo_root, valid_inputs, capsys, name, arguments,
                                                             message):
    valid = {"sft_lora": ["--model_name_or_path", "{tmp}/model", "--train_file", "{tmp}/train.jsonl"],
             "pretrain": []}[name] + ["--output_dir", "{tmp}/out"]
    arguments = [argument.replace("{tmp}", str(valid_inputs)) for argument in valid + arguments]
    assert parse_error(repo_root, capsys, name, arguments) == message.replace("{tmp}", str(valid_inputs))
    assert not (valid_inputs / "out").exists()  # nothing written


SFT_DATASET = ("a datasets name: a Hub dataset id, a local folder of data files, or a .json/.jsonl/.parquet/.arrow "
               "file")
DATASET_ERRORS = [  # (arguments after --model_name_or_path and --output_dir, the exact message)
    (["--dataset_name", "/nonexistent_dir"], f"--dataset_name /nonexistent_dir: no such file or folder; expected "
                                             f"{SFT_DATASET}"),
    (["--dataset_name", "{tmp}/template.txt"], "--dataset_name {tmp}/template.txt: not a .json/.jsonl/.parquet/.arrow "
                                               f"file; expected {SFT_DATASET}"),
    (["--dataset_name", "{tmp}/full"], "--dataset_name {tmp}/full: the folder holds no .json/.jsonl/.parquet/.arrow "
                                       f"file; expected {SFT_DATASET}"),
    (["--dataset_name", "nobody/no-such-dataset"], "--dataset_name nobody/no-such-dataset: no such file or folder, and "
     "HF_HUB_OFFLINE=1 with no copy of the Hub dataset nobody/no-such-dataset in the local cache; expected "
     f"{SFT_DATASET}"),
    (["--dataset_name", "{tmp}/hub_style", "--dataset_test_split", "validation"], "--dataset_test_split validation: "
     "--dataset_name {tmp}/hub_style has no such split; it has test, train"),
    (["--dataset_name", "{tmp}/hub_style", "--dataset_train_split", "all"], "--dataset_train_split all: "
     "--dataset_name {tmp}/hub_style has no such split; it has test, train"),
    (["--dataset_name", "{tmp}/hub_style", "--dataset_test_split", "test", "--val_split", "0.1"],
     "give at most one of --dataset_test_split, --val_split and --eval_file (got --dataset_test_split and "
     "--val_split)"),
    (["--dataset_name", "{tmp}/hub_style", "--train_file", "{tmp}/train.jsonl"],
     "give exactly one of --dataset_name, --train_file and --stdlib_chats"),
    (["--train_file", "{tmp}/train.jsonl", "--dataset_config", "all"], "--dataset_config needs --dataset_name"),
]


@pytest.mark.parametrize("arguments, message", DATASET_ERRORS)
def test_a_mistyped_dataset_or_split_is_one_line_before_any_work(repo_root, valid_inputs, capsys, arguments,
                                                                 message):
    arguments = ["--model_name_or_path", "{tmp}/model", "--output_dir", "{tmp}/out", *arguments]
    arguments = [argument.replace("{tmp}", str(valid_inputs)) for argument in arguments]
    assert parse_error(repo_root, capsys, "sft_lora", arguments) == message.replace("{tmp}", str(valid_inputs))
    assert not (valid_inputs / "out").exists()


def test_the_valid_inputs_pass(repo_root, valid_inputs):
    """The guard of the table above: its valid arguments pass the checks, so each case fails on its own argument."""
    sft = set_up_recipe(load_recipe(repo_root, "sft_lora"), [
        "--model_name_or_path", str(valid_inputs / "model"), "--train_file", str(valid_inputs / "train.jsonl"),
        "--tokenizer_name_or_path", str(valid_inputs / "tokenizer"), "--output_dir", str(valid_inputs / "out"),
        "--val_split", "0.25", "--resume_from_checkpoint", "latest"])
    assert sft[2].model_name_or_path == str(valid_inputs / "model")
    hub_style = set_up_recipe(load_recipe(repo_root, "sft_lora"), [
        "--model_name_or_path", str(valid_inputs / "model"), "--dataset_name", str(valid_inputs / "hub_style"),
        "--dataset_test_split", "test", "--output_dir", str(valid_inputs / "out")])
    assert hub_style[0].dataset_test_split == "test" and hub_style[3].evaluation.on_start
    # `latest` with no checkpoint yet is a fresh run, resolved before the step-0 evaluation is decided
    assert sft[3].output.resume_checkpoint is None and sft[3].evaluation.on_start
    pretrain = set_up_recipe(load_recipe(repo_root, "pretrain"), [
        "--dataset", f"stdlib,{valid_inputs}/*.jsonl", "--tokenizer_name_or_path", str(valid_inputs / "tokenizer"),
        "--output_dir", str(valid_inputs / "out")])
    assert pretrain[0].dataset.endswith("*.jsonl")


def test_the_first_typo_of_a_new_user_exits_2_without_a_traceback(repo_root, valid_inputs, tmp_path):
    run = subprocess.run(
        [sys.executable, "recipes/sft_lora.py", "--model_name_or_path", str(valid_inputs / "model"), "--train_file",
         "/nonexistent.jsonl", "--output_dir", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=repo_root, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1] == f"sft_lora.py: error: --train_file /nonexistent.jsonl: no such file; " \
                                          f"expected {JSONL}"
    assert not (tmp_path / "out").exists()


def test_a_push_needs_a_hub_id_for_a_local_base_before_training(repo_root, valid_inputs, capsys, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    arguments = ["--model_name_or_path", str(valid_inputs / "model"), "--train_file", str(valid_inputs / "train.jsonl"),
                 "--output_dir", str(valid_inputs / "out"), "--push_to_hub", "--hub_model_id", "me/adapter"]
    assert parse_error(repo_root, capsys, "sft_lora", arguments) == (
        f"--push_to_hub: the base model {valid_inputs / 'model'} is a local folder with no Hub id in its "
        "metadata.json; pass --base_model_hub_id USER/NAME (its Hub repository), which the pushed "
        "adapter_config.json and model card name")


def hub_answer(status: int, error_code: str | None = None):
    """What `HfApi.model_info` raises for an HTTP answer (huggingface_hub's own `hf_raise_for_status`)."""
    request = httpx2.Request("GET", "https://huggingface.co/api/models/nobody/x")
    response = httpx2.Response(status, request=request, headers={"X-Error-Code": error_code} if error_code else {})
    try:
        hf_raise_for_status(response)
    except Exception as error:  # noqa: BLE001 (the error to replay)
        return error
    raise AssertionError(f"HTTP {status} raised nothing")


HUB_ANSWERS = [  # (case, what model_info raises or None, the message or None when accepted)
    ("found", None, None),
    ("gated: the loader explains access", hub_answer(401, "GatedRepo"), None),
    ("server error: the loader retries", hub_answer(503), None),
    ("not on the Hub", hub_answer(404, "RepoNotFound"), "--model_name_or_path nobody/x: no such file or folder, and "
     f"no model nobody/x on the Hub (a private one needs `hf auth login`); expected {MODEL}"),
    ("no such revision", hub_answer(404, "RevisionNotFound"), "--model_name_or_path nobody/x: the Hub model has no "
     f"revision 'v2'; expected {MODEL}"),
    ("unreachable", ConnectionError("[Errno -2] Name or service not known"), "--model_name_or_path nobody/x: no such "
     "file or folder, and the Hub could not be reached within 10 s to look it up (ConnectionError; with "
     f"HF_HUB_OFFLINE=1 only the local cache is searched); expected {MODEL}"),
]


@pytest.mark.parametrize("case, raised, message", HUB_ANSWERS, ids=[c[0] for c in HUB_ANSWERS])
def test_a_hub_id_online_is_looked_up_once_with_a_short_timeout(monkeypatch, tmp_path, case, raised, message):
    calls = []

    class FakeApi:
        def model_info(self, repo_id, *, revision=None, timeout=None):
            calls.append((repo_id, revision, timeout))
            if raised is not None:
                raise raised

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    if message is None:
        recipe_arguments.check_pretrained("model_name_or_path", "nobody/x", recipe_arguments.MODEL, recipe_arguments.MODEL_FILES, "v2")
    else:
        with pytest.raises(ValueError) as error:
            recipe_arguments.check_pretrained("model_name_or_path", "nobody/x", recipe_arguments.MODEL, recipe_arguments.MODEL_FILES, "v2")
        assert str(error.value) == message
    assert calls == [("nobody/x", "v2", recipe_arguments.HUB_TIMEOUT_S)] and recipe_arguments.HUB_TIMEOUT_S <= 10


def test_a_hub_id_offline_is_looked_up_in_the_local_cache(tmp_path, monkeypatch):
    commit = "0" * 40
    snapshot = tmp_path / "models--hfl3-test--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--hfl3-test--tiny" / "refs").mkdir()
    (tmp_path / "models--hfl3-test--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    assert hub_constants.is_offline_mode()
    recipe_arguments.check_pretrained("model_name_or_path", "hfl3-test/tiny", recipe_arguments.MODEL, recipe_arguments.MODEL_FILES)
    with pytest.raises(ValueError, match="with no copy of the Hub model hfl3-test/tiny in the local cache"):
        recipe_arguments.check_pretrained("tokenizer_name_or_path", "hfl3-test/tiny", recipe_arguments.TOKENIZER, recipe_arguments.TOKENIZER_FILES)


# ---- pretraining files --------------------------------------------------------------------------------------------

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


def test_repeated_documents_are_dropped_per_shard_and_resume_exactly(tmp_path, shakespeare_paragraphs):
    unique = shakespeare_paragraphs[:40]
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


def test_the_stream_counts_repeats_and_its_fingerprint_names_the_filter(tmp_path, shakespeare_paragraphs, tokenizer):
    (tmp_path / "book.txt").write_text("\n\n".join(shakespeare_paragraphs[:50] * 2))
    source = streaming.DocumentSource(sources.open_corpus(str(tmp_path / "book.txt")), read_batch=8, epochs=1)
    packed = streaming.PackedStream(source, tokenizer, max_seq_len=64, shuffle_buffer=0)
    _, _, counts = packed.materialize(10_000)
    assert counts == {"documents": 50, "held_out": 0, "duplicates": 50, "missing_text": 0, "empty_text": 0}
    assert packed.fingerprint()["deduplicate"] == "within shards"


def test_no_converted_layer_under_fp8_is_a_warning(caplog):
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(2, vocab_size=512, aspect_ratio=32, head_dim=32))
    with caplog.at_level("WARNING", logger="hfl3.fp8.linear"):
        fp8.convert_to_float8_training(model)
    assert "FP8 tensorwise converted no layer of this model, so it trains in high precision" in caplog.text
    assert "use a larger model or drop --fp8" in caplog.text


# ---- NaN / inf guard ----------------------------------------------------------------------------------------------

SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def shakespeare_paragraphs(assets) -> list[str]:
    """Distinct paragraphs (no blank line inside), in order."""
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:100_000]
    return list(dict.fromkeys(p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()))


@pytest.fixture(scope="module")
def tokenizer(assets):
    return train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]], 512)


class Poison(TrainerCallback):
    """Fill a parameter with NaN when step `step` begins (the loss of that step is NaN) or, `after=True`, once it
    ended (before the Trainer logs or saves it)."""

    def __init__(self, step: int, pick, after: bool = False):
        self.step, self.pick, self.after = step, pick, after

    def _poison(self, state, model, step):
        if step == self.step:
            with torch.no_grad():
                self.pick(model).fill_(math.nan)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if not self.after:
            self._poison(state, model, state.global_step + 1)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.after:
            self._poison(state, model, state.global_step)


def assert_all_saved_tensors_finite(folder: Path) -> int:
    files = sorted(folder.rglob("*.safetensors")) + sorted(folder.rglob("optimizer.pt"))
    for file in files:
        tensors = load_file(file) if file.suffix == ".safetensors" else \
            [v for s in torch.load(file, weights_only=True)["state"].values() for v in s.values()]
        values = tensors.values() if isinstance(tensors, dict) else tensors
        assert all(torch.isfinite(t).all() for t in values if t.is_floating_point()), file
    return len(files)


GUARD_CASES = [  # (case, poisoned step, after the step, save_steps, first bad step and what, checkpoints left)
    ("loss, seen at the next save", 4, False, 3, "at step 4: the loss and the gradient norm became NaN or infinite; "
     "stopped at step 6", ["checkpoint-3"]),
    ("parameter, seen before its save", 3, True, 3, "at step 3: a parameter became NaN or infinite; stopped at "
     "step 3", []),
]


@pytest.mark.parametrize("case, step, after, save_steps, message, checkpoints", GUARD_CASES,
                         ids=[c[0] for c in GUARD_CASES])
def test_pretraining_stops_at_the_first_non_finite_step(tmp_path, tokenizer, shakespeare_paragraphs, case, step,
                                                        after, save_steps, message, checkpoints):
    ids = tokenizer("\n\n".join(shakespeare_paragraphs), add_special_tokens=False)["input_ids"]
    rows = [[tokenizer.bos_token_id, *ids[i : i + SEQ_LEN - 1]] for i in range(0, 40 * SEQ_LEN, SEQ_LEN - 1)]
    config = L3GPTConfig.from_depth(1, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=SEQ_LEN, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    args = PretrainConfig(output_dir=str(tmp_path), max_steps=9, per_device_train_batch_size=BATCH, logging_steps=100,
                          eval_strategy="no", save_strategy="steps", save_steps=save_steps, report_to="none",
                          disable_tqdm=True, learning_rate=1e-3, warmup_steps=1)
    trainer = PretrainTrainer(model=L3GPTForCausalLM(config), args=args,
                           train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                           data_collator=PackedCollator(tokenizer.bos_token_id),
                           callbacks=[Poison(step, lambda model: model.lm_head.weight, after)])
    with pytest.raises(NonFiniteTrainingError, match=message) as error:
        trainer.train()
    newest = f"the newest checkpoint is {checkpoints[-1]}" if checkpoints else "no checkpoint was saved"
    assert newest in str(error.value) and "Lower --learning_rate (now 0.001)" in str(error.value)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == checkpoints
    assert assert_all_saved_tensors_finite(tmp_path) == 2 * len(checkpoints)
    assert all(math.isfinite(entry.get("loss", 0.0)) for entry in trainer.state.log_history)


def test_sft_stops_at_the_first_non_finite_loss(tmp_path, tokenizer):
    data = load_sft_data(tokenizer, write_chat_jsonl(stdlib_docstring_chats(16, seed=0), tmp_path / "d.jsonl"),
                         max_length=48)
    config = L3GPTConfig.from_depth(1, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=64)
    args = ChatSFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_length=48,
                         eval_strategy="no", load_best_model_at_end=False, save_strategy="no", logging_steps=2,
                         report_to="none", disable_tqdm=True)
    trainer = ChatSFTTrainer(model=L3GPTForCausalLM(config), args=args, train_dataset=data.train,
                             processing_class=tokenizer, peft_config=LORA)
    lora_b = lambda model: next(p for name, p in model.named_parameters() if "lora_B" in name)  # noqa: E731
    trainer.add_callback(Poison(3, lora_b))
    with pytest.raises(NonFiniteTrainingError, match="diverged at step 3: the loss and the gradient norm became NaN"):
        trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [2]


@pytest.mark.slow
def test_a_diverging_launch_exits_non_zero_and_keeps_the_last_good_checkpoint(repo_root, tmp_path):
    output_dir = tmp_path / "run"
    run = subprocess.run(  # started by Python: the one-process accelerate launch is tests/test_pretrain_recipe.py's
        [sys.executable, "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", "--learning_rate",
         "1e30", "--max_steps", "8", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2",
         "--output_dir", str(output_dir)],
        capture_output=True, text=True, cwd=repo_root,  # a hang: pytest-timeout
    )
    assert run.returncode != 0
    error = next(line for line in run.stderr.splitlines() if "pretrain.py: error: " in line)
    assert "training diverged at step 3: the loss and the gradient norm became NaN or infinite" in error
    assert "the newest checkpoint is checkpoint-2" in error
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (output_dir / "model.safetensors").exists()
    assert assert_all_saved_tensors_finite(output_dir) == 3  # the weights, the optimizer and the data stream state
    assert "'loss': 'nan'" not in run.stdout + run.stderr and "'loss': '0'" not in run.stdout + run.stderr
    assert np.isfinite(json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
                       ["log_history"][-1]["loss"])
