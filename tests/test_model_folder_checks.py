"""A local model or tokenizer folder is checked when the recipe's arguments are checked, before any data is read: a
`config.json` that is not JSON, no weights or weights cut short (headers only), no tokenizer, a tokenizer without the
chat template hfl3's masks need, tokenizer files that are not JSON; each ends the recipe with one line naming the
file and the fix, exit status 2, and nothing written."""

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hfl3.data.chat import write_chat_jsonl
from recipe_setup import set_up_recipe

SAVE_AGAIN = "restore it from where the folder came from, or save the folder again with save_pretrained"
MODEL = "a model folder (config.json and weights, as save_pretrained writes them) or a Hub model id"
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
