"""recipes/pretrain.py end to end (accelerate launch in a subprocess) and exact resume through the Trainer."""

import json
import os
import subprocess
import sys

import datasets
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hfl3
from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data import text
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.pretrain import L3GPTTrainer, PackedCollator, PretrainConfig


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, repo_root):
    output_dir = tmp_path_factory.mktemp("pretrain")
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
        "--config_file", str(repo_root / "accelerate_configs" / "cpu.yaml"), "--num_cpu_threads_per_process", "2",
        str(repo_root / "recipes" / "pretrain.py"), "--config", str(repo_root / "recipes" / "configs" /
                                                                     "pretrain_tiny.yaml"),
        "--output_dir", str(output_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=repo_root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return output_dir, result.stdout + result.stderr


@pytest.mark.slow
def test_recipe_writes_a_complete_folder_and_learns(recipe_run):
    output_dir, log = recipe_run
    for name in ["model.safetensors", "config.json", "modeling_l3gpt.py", "configuration_l3gpt.py",
                 "allocation.py", "tokenizer.json", "tokenizer_config.json", "metadata.json", "README.md",
                 "all_results.json", "loss.png"]:
        assert (output_dir / name).is_file(), name
    assert not (output_dir / "training_args.bin").exists()
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["eval_bpb"] < results["initial_eval_bpb"]
    metadata = json.loads((output_dir / "metadata.json").read_text())
    digest = metadata["data"]["train_tokens_sha256"]
    assert len(digest) == 64 and metadata["versions"]["transformers"]
    assert metadata["data"]["packing"]["train"]["cropped_share"] < 0.2
    with safe_open(output_dir / "model.safetensors", "pt") as f:
        assert f.metadata()["hfl3_train_tokens_sha256"] == digest
    assert digest in (output_dir / "README.md").read_text()
    assert "world size 1" in log and "reloaded from" in log
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert isinstance(model, L3GPTForCausalLM)
    counts = model.model.l3_counts()
    assert counts.max() > 4 * counts.float().mean()  # the LZW allocation travelled with the checkpoint


REMOTE_GENERATE = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer("def ", add_special_tokens=False)["input_ids"]])
print("TOKENS", model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist())
"""


@pytest.mark.slow
def test_upload_folder_generates_the_same_without_hfl3(recipe_run, run_without_hfl3):
    output_dir, _ = recipe_run
    result = run_without_hfl3(REMOTE_GENERATE, output_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    remote_tokens = json.loads(result.stdout.split("TOKENS", 1)[1].strip())
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer("def ", add_special_tokens=False)["input_ids"]])
    local = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    assert remote_tokens == local


@pytest.fixture(scope="module")
def packed_rows(assets):
    shakespeare = (assets / "text" / "tinyshakespeare.txt").read_text()[:80_000]
    tokenizer = train_tokenizer([shakespeare], vocab_size=512)
    corpus = datasets.Dataset.from_dict({"text": [shakespeare], "source": ["shakespeare"]})
    tokens = text.tokenize_documents(text.chunk_documents(corpus, 128), tokenizer)
    packed, _ = text.pack_best_fit(tokens, max_seq_len=64)
    return tokenizer, packed.select(range(64))


def train_tiny(output_dir, packed_rows, max_steps, resume_from=None, save_steps=None, optimizer="adamw"):
    tokenizer, rows = packed_rows
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=64, window_pattern="SL", l3_after_layers=[0],
                                    l3_n_emb=4 * 512, l3_k_max=32, l3_d_up=64)
    args = PretrainConfig(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=5e-3,
        warmup_steps=2, logging_steps=1, eval_strategy="no", seed=0, optimizer=optimizer, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, dataloader_num_workers=0,
    )
    trainer = L3GPTTrainer(model=L3GPTForCausalLM(config), args=args, train_dataset=rows,
                           data_collator=PackedCollator(tokenizer.bos_token_id))
    trainer.train(resume_from_checkpoint=resume_from)
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}, trainer


def test_resume_from_checkpoint_continues_identically(tmp_path, packed_rows):
    full, _ = train_tiny(tmp_path / "full", packed_rows, max_steps=8)
    _, _ = train_tiny(tmp_path / "interrupted", packed_rows, max_steps=8, save_steps=4)
    resumed, trainer = train_tiny(tmp_path / "interrupted", packed_rows, max_steps=8,
                                  resume_from=str(tmp_path / "interrupted" / "checkpoint-4"))
    assert sorted(resumed) == list(range(1, 9)) and trainer.state.global_step == 8
    fresh_steps = [5, 6, 7, 8]  # computed after the restart (1-4 come back from the checkpoint's history)
    assert [resumed[s] for s in fresh_steps] == pytest.approx([full[s] for s in fresh_steps], abs=1e-6)
    assert full[8] < full[1]


def test_adamw_decays_only_matrices(tmp_path, packed_rows):
    _, trainer = train_tiny(tmp_path / "decay", packed_rows, max_steps=1)
    groups = trainer.optimizer.param_groups
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
    assert groups[1]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == len(list(trainer.model.parameters()))
    assert hfl3.__version__
