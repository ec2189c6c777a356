"""A diverging run stops at the first non-finite loss, gradient norm or parameter (`hfl3.trainers.metrics.
NonFiniteFlags`, read by the trainers' hooks), naming the step, with nothing non-finite saved and the last good
checkpoint the newest."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import TrainerCallback

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data.chat import write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.metrics import NonFiniteTrainingError
from hfl3.trainers.pretraining.trainer import PackedCollator, PretrainTrainer
from hfl3.trainers.pretraining.config import PretrainConfig
from hfl3.trainers.sft.trainer import ChatSFTTrainer
from hfl3.trainers.sft.config import ChatSFTConfig

LORA = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
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
