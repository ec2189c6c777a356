"""A recipe's log (`hfl3.trainers.cli.recipe_log`): another library's warning repeated at every step is shown once with a
count at the end, in both recipes; hfl3's own warnings all show; no credential reaches a log line."""

import logging
import warnings

import bitsandbytes as bnb
import pytest
import torch
from bitsandbytes.nn import Int8Params
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hfl3.data.chat import write_chat_jsonl
from hfl3.trainers.cli.exits import run_recipe
from hfl3.trainers.cli.recipe_log import recipe_log

CAST = "MatMul8bitLt: inputs will be cast from torch.float32 to float16 during quantization"
REPEATED = "a warning shown once above was repeated {count} more times: bitsandbytes.autograd._functions: " + CAST


def int8_steps(steps: int) -> None:
    """`steps` forwards of a bitsandbytes int8 layer on float32 inputs: each logs `CAST` (its inference path)."""
    layer = bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False, threshold=6.0)
    layer.weight = Int8Params(torch.randn(32, 64), requires_grad=False, has_fp16_weights=False)
    layer.eval()
    for _ in range(steps):
        layer(torch.randn(4, 64))


def shown(caplog, text: str) -> int:
    return sum(record.getMessage() == text for record in caplog.records)


def test_a_warning_another_library_repeats_is_shown_once_then_counted(caplog):
    with caplog.at_level(logging.INFO):
        int8_steps(3)
        assert shown(caplog, CAST) == 3  # the guard: bitsandbytes logs it at every forward
        caplog.clear()
        with recipe_log():
            int8_steps(50)
            for step in range(3):  # hfl3's own lines all show
                logging.getLogger("hfl3.trainers.test").warning("step %d: a warning of hfl3's", step)
            for step in range(4):  # a Python warning from one line, its text changing with the step
                warnings.warn(f"step {step}: a library's warning", UserWarning, stacklevel=1)
        assert shown(caplog, CAST) == 1 and REPEATED.format(count=49) in caplog.text
        assert sum("a warning of hfl3's" in record.getMessage() for record in caplog.records) == 3
        assert sum(record.name == "py.warnings" for record in caplog.records) == 1
        assert "repeated 3 more times: py.warnings:" in caplog.text
        caplog.clear()
        int8_steps(2)  # the filter is gone with the block
    assert shown(caplog, CAST) == 2


def test_no_credential_reaches_a_log_line(caplog):
    with caplog.at_level(logging.INFO), recipe_log() as log:
        log.secrets = ("s3cr3t-of-another-hub",)
        logging.getLogger("huggingface_hub.test").warning("pushing with token %s", "s3cr3t-of-another-hub")
        logging.getLogger("hfl3.test").info("token hf_%s", "Zq7Xw3Vb" * 4)
    assert "s3cr3t" not in caplog.text and "Zq7Xw3Vb" not in caplog.text
    assert caplog.text.count("<redacted>") == 2


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory, assets):
    folder = tmp_path_factory.mktemp("sft_inputs")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_chat_jsonl([{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2."}]}],
                     folder / "train.jsonl")
    return folder


@pytest.mark.parametrize("recipe", ["pretrain", "sft_lora"])
def test_every_recipe_shows_a_repeated_warning_once_with_its_count(recipe, pretrain_recipe, sft_recipe, sft_inputs,
                                                                   repo_root, tmp_path, caplog):
    module = {"pretrain": pretrain_recipe, "sft_lora": sft_recipe}[recipe]
    arguments = {"pretrain": ["--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml")],
                 "sft_lora": ["--config", str(repo_root / "recipes" / "configs" / "sft_tiny.yaml"),
                              "--model_name_or_path", str(sft_inputs), "--train_file",
                              str(sft_inputs / "train.jsonl")]}[recipe]
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exit_info:
        run_recipe(module.make_parser(), lambda *parsed, given: int8_steps(20),  # the recipe's run: 20 int8 steps
                   [*arguments, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 0
    assert shown(caplog, CAST) == 1 and REPEATED.format(count=19) in caplog.text
