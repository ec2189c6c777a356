"""Every path and name a recipe is given is checked before any work, by the checks its `main` runs first
(`hfl3.trainers.cli.setup`, `hfl3.trainers.cli.arguments`, `hfl3.trainers.cli.inputs`): a mistyped one is one line naming the
argument, the value and what was expected, exit status 2, with nothing written; a Hub id is looked up once with a
short timeout, or in the local cache offline. A model or tokenizer folder must hold what the argument needs (a readable
`config.json`, whole weights, a tokenizer, a chat template for SFT): each problem one line naming the file and the fix,
before any data is read. Once the model is loaded, the token ids the data will feed must fit its embeddings."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2  # huggingface_hub's HTTP client: builds the answers its errors come from
import huggingface_hub
import pytest
import torch
from datasets import Dataset
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import hf_raise_for_status
from recipe_setup import set_up_recipe
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hfl3.data.chat import write_chat_jsonl
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.trainers.cli import inputs as recipe_inputs


def load_recipe(repo_root, name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", repo_root / "recipes" / f"{name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


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
        recipe_inputs.check_pretrained("model_name_or_path", "nobody/x", recipe_inputs.MODEL, recipe_inputs.MODEL_FILES,
                                       "v2")
    else:
        with pytest.raises(ValueError) as error:
            recipe_inputs.check_pretrained("model_name_or_path", "nobody/x", recipe_inputs.MODEL,
                                           recipe_inputs.MODEL_FILES, "v2")
        assert str(error.value) == message
    assert calls == [("nobody/x", "v2", recipe_inputs.HUB_TIMEOUT_S)] and recipe_inputs.HUB_TIMEOUT_S <= 10


def test_a_hub_id_offline_is_looked_up_in_the_local_cache(tmp_path, monkeypatch):
    commit = "0" * 40
    snapshot = tmp_path / "models--hfl3-test--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--hfl3-test--tiny" / "refs").mkdir()
    (tmp_path / "models--hfl3-test--tiny" / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    assert hub_constants.is_offline_mode()
    recipe_inputs.check_pretrained("model_name_or_path", "hfl3-test/tiny", recipe_inputs.MODEL,
                                   recipe_inputs.MODEL_FILES)
    with pytest.raises(ValueError, match="with no copy of the Hub model hfl3-test/tiny in the local cache"):
        recipe_inputs.check_pretrained("tokenizer_name_or_path", "hfl3-test/tiny", recipe_inputs.TOKENIZER,
                                       recipe_inputs.TOKENIZER_FILES)


# ---- model and tokenizer folders -------------------------------------------------------------------------------------

SAVE_AGAIN = "restore it from where the folder came from, or save the folder again with save_pretrained"
NO_TEMPLATE = ("the tokenizer has no chat template, which hfl3 renders every record with to mask it (hfl3.data.masks); "
               "pass --chat_template_path FILE.jinja, or a tokenizer with one")


@pytest.fixture(scope="module")
def valid(tmp_path_factory, assets) -> Path:
    """`model/`: a tiny Qwen3 with Qwen3's tokenizer and chat template; `sharded/`: the same in 20 kB shards;
    `tokenizer/`: the tokenizer alone; `template.jinja`; `train.jsonl`."""
    folder = tmp_path_factory.mktemp("valid")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    model.save_pretrained(folder / "model")
    model.save_pretrained(folder / "sharded", max_shard_size="20KB")
    for name in ("model", "sharded", "tokenizer"):
        tokenizer.save_pretrained(folder / name)
    (folder / "template.jinja").write_text(tokenizer.chat_template)
    write_chat_jsonl([{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]}],
                     folder / "train.jsonl")
    return folder


def truncate(path: Path, by: int) -> dict:
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - by)
    return {"size": size, "cut": size - by}


def remove(*paths: Path) -> dict:
    for path in paths:
        path.unlink()
    return {}


BROKEN = [  # (case, the folder copied, how it is broken, extra arguments, the exact message; {folder}: the copy)
    ("config.json is not JSON", "model", lambda f: (f / "config.json").write_text('{"model_type": "qwen3",') and {},
     [], "--model_name_or_path {folder}: config.json is not valid JSON (Expecting property name enclosed in double "
     f"quotes: line 1 column 24 (char 23)); {SAVE_AGAIN}"),
    ("no weights", "model", lambda f: remove(f / "model.safetensors"), [],
     "--model_name_or_path {folder}: the folder holds no weights (model.safetensors, model.safetensors.index.json, "
     f"pytorch_model.bin, pytorch_model.bin.index.json); expected {MODEL}"),
    ("weights cut short", "model", lambda f: truncate(f / "model.safetensors", 100), [],
     "--model_name_or_path {folder}: model.safetensors truncated: its tensors end at byte {size}, the file has {cut}; "
     f"{SAVE_AGAIN}"),
    ("weights cut inside the header", "model", lambda f: truncate(f / "model.safetensors", f.joinpath(
        "model.safetensors").stat().st_size - 8), [], "--model_name_or_path {folder}: model.safetensors truncated "
     f"inside its header (8 bytes, header of {{header}}); {SAVE_AGAIN}"),
    ("a shard the index names is missing", "sharded", lambda f: remove(f / "model-00002-of-00003.safetensors"), [],
     "--model_name_or_path {folder}: model-00002-of-00003.safetensors missing (named by model.safetensors.index.json); "
     f"{SAVE_AGAIN}"),
    ("a shard cut short", "sharded", lambda f: truncate(f / "model-00003-of-00003.safetensors", 1), [],
     "--model_name_or_path {folder}: model-00003-of-00003.safetensors truncated: its tensors end at byte {size}, the "
     f"file has {{cut}}; {SAVE_AGAIN}"),
    ("no tokenizer", "model", lambda f: remove(f / "tokenizer.json", f / "tokenizer_config.json",
                                               f / "chat_template.jinja"), [],
     "--model_name_or_path {folder}: the folder holds no tokenizer (tokenizer.json or tokenizer_config.json); pass "
     "--tokenizer_name_or_path, or save the tokenizer into the folder (tokenizer.save_pretrained)"),
    ("no chat template", "model", lambda f: remove(f / "chat_template.jinja"), [],
     f"--model_name_or_path {{folder}}: {NO_TEMPLATE}"),
    ("tokenizer_config.json is not JSON", "model", lambda f: (f / "tokenizer_config.json").write_text('{"bos') and {},
     [], "--model_name_or_path {folder}: tokenizer_config.json is not valid JSON (Unterminated string starting at: "
     f"line 1 column 2 (char 1)); {SAVE_AGAIN}"),
    ("a tokenizer given without a chat template", "tokenizer", lambda f: remove(f / "chat_template.jinja"),
     ["--tokenizer_name_or_path", "{folder}"], f"--tokenizer_name_or_path {{folder}}: {NO_TEMPLATE}"),
    ("a tokenizer given whose tokenizer.json is cut short", "tokenizer",
     lambda f: truncate(f / "tokenizer.json", 1000),
     ["--tokenizer_name_or_path", "{folder}"], "--tokenizer_name_or_path {folder}: tokenizer.json is cut short (its "
     f"JSON object is not closed); {SAVE_AGAIN}"),
]


def header_length(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("case, copied, breaking, extra, message", BROKEN, ids=[case[0] for case in BROKEN])
def test_a_broken_folder_is_one_line_before_any_data_is_read(sft_recipe, valid, tmp_path, capsys, case, copied,
                                                             breaking, extra, message):
    folder = tmp_path / copied
    shutil.copytree(valid / copied, folder)
    header = header_length(folder / "model.safetensors") if (folder / "model.safetensors").is_file() else None
    values = breaking(folder) or {}
    model = folder if copied != "tokenizer" else valid / "model"
    arguments = ["--model_name_or_path", str(model), "--train_file", str(valid / "train.jsonl"),
                 "--output_dir", str(tmp_path / "out"), *[a.replace("{folder}", str(folder)) for a in extra]]
    with pytest.raises(SystemExit) as exit_info:
        set_up_recipe(sft_recipe, arguments)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: ")
    assert error.split(": error: ", 1)[1] == message.format(folder=folder, header=header, **values)
    assert not (tmp_path / "out").exists()


def test_the_valid_folders_pass(sft_recipe, pretrain_recipe, valid, tmp_path, repo_root):
    """The guard of the table above: the folders it breaks pass the checks whole, and a folder without a chat
    template passes with `--chat_template_path`."""
    data = ["--train_file", str(valid / "train.jsonl"), "--output_dir", str(tmp_path / "out")]
    for folder in ("model", "sharded"):
        set_up_recipe(sft_recipe, ["--model_name_or_path", str(valid / folder), *data])
    no_template = tmp_path / "no_template"
    shutil.copytree(valid / "model", no_template)
    (no_template / "chat_template.jinja").unlink()
    set_up_recipe(sft_recipe, ["--model_name_or_path", str(no_template), *data,
                               "--chat_template_path", str(valid / "template.jinja")])
    set_up_recipe(pretrain_recipe, [
        "--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml"), "--tokenizer_name_or_path",
        str(no_template), "--output_dir", str(tmp_path / "pretrain")])  # pretraining renders no template


def test_a_pretraining_tokenizer_that_is_not_json_is_one_line(pretrain_recipe, valid, tmp_path, repo_root, capsys):
    folder = tmp_path / "tokenizer"
    shutil.copytree(valid / "tokenizer", folder)
    (folder / "tokenizer_config.json").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        set_up_recipe(pretrain_recipe, [
            "--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml"), "--tokenizer_name_or_path",
            str(folder), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].split(": error: ", 1)[1] == (
        f"--tokenizer_name_or_path {folder}: tokenizer_config.json is not valid JSON (Expecting value: line 1 column 1 "
        f"(char 0)); {SAVE_AGAIN}")
    assert not (tmp_path / "out").exists()


# ---- the tokenizer fits the model ------------------------------------------------------------------------------------

def test_a_tokenizer_larger_than_the_embeddings_is_refused(assets):
    fits = recipe_inputs.check_vocabulary_fits  # run by the SFT builder once the model is loaded
    qwen3 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    config = Qwen3Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=rf"has {len(qwen3)} tokens .* has 1000 embedding rows: token ids >= 1000 "
                                         r"have no embedding\. Use the model's own tokenizer"):
        fits(qwen3, Qwen3ForCausalLM(config))
    fits(qwen3, Qwen3ForCausalLM(Qwen3Config(**{**config.to_dict(), "vocab_size": len(qwen3)})))
    # with the data to be fed: only ids that occur (and the pad id: Qwen3's is 151643) must have a row
    with pytest.raises(ValueError, match=r"the data hold token id 151643 .* has 1000 embedding rows"):
        fits(qwen3, Qwen3ForCausalLM(config), [Dataset.from_dict({"input_ids": [[5, 999]]})])
