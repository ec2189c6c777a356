"""recipes/sft_lora.py end to end (accelerate launch in a subprocess), ChatSFTTrainer's loss and eval metrics, and
adapters that load the standard way (`AutoPeftModelForCausalLM` from any working directory; Hub ids when pushed)."""

import fnmatch
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from huggingface_hub import constants as hub_constants
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from trl import get_peft_config

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data.chat import read_chat_jsonl, write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.models.l3gpt.linear_cross_entropy import CHUNK_BYTES
from hfl3.provenance import sha256_file, sha256_records
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.cli.arguments import parse_recipe_args
from hfl3.trainers.sft.builder import build_sft_trainer
from hfl3.trainers.outputs import base_model_hub_id, local_base_model
from hfl3.trainers.sft.trainer import ChatSFTTrainer
from hfl3.trainers.sft.config import ChatSFTConfig
from recipe_setup import parse_and_set_up, recipe_main

WORDS = "the king and queen of love shall die good night sweet prince my lord what is this".split()


def chats(answer_word: str, n: int, seed: int) -> list[dict]:
    """Short chats whose every answer repeats `answer_word`; the questions vary."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        question = " ".join(WORDS[i] for i in torch.randint(len(WORDS), (6,), generator=rng).tolist())
        out.append({"messages": [{"role": "user", "content": question + "?"},
                                 {"role": "assistant", "content": " ".join([answer_word] * 8)}]})
    return out


def as_if_pretrained(model):
    """L3GPT zero-initialises its output projections (nanochat), so LoRA on q/v of a fresh model gets no gradient;
    give every all-zero matrix small random values, as a pretrained model would have."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2 and not parameter.any():
                parameter.normal_(0.0, 0.02)
    return model


@pytest.fixture(scope="module")
def l3gpt_folder(tmp_path_factory, assets):
    folder = tmp_path_factory.mktemp("l3gpt_base")
    tokenizer = train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:60_000]], vocab_size=512)
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32, max_position_embeddings=128,
        window_pattern="L", l3_after_layers=[0], l3_n_emb=4 * len(tokenizer), l3_k_max=16, l3_d_up=32,
    )
    as_if_pretrained(L3GPTForCausalLM(config)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, repo_root, l3gpt_folder):
    work = tmp_path_factory.mktemp("sft")
    train = write_chat_jsonl(chats("good", 24, seed=0), work / "train.jsonl")
    # Crafted so that training on "good" answers makes the "die" answers ever less likely: eval loss must rise
    evaluation = write_chat_jsonl(chats("die", 8, seed=1), work / "eval.jsonl")
    base_sha = sha256_file(l3gpt_folder / "model.safetensors")
    output_dir = work / "out"
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
        "--config_file", str(repo_root / "accelerate_configs" / "cpu.yaml"),
        str(repo_root / "recipes" / "sft_lora.py"),
        "--config", str(repo_root / "recipes" / "configs" / "sft_tiny.yaml"),
        "--model_name_or_path", str(l3gpt_folder), "--train_file", str(train), "--eval_file", str(evaluation),
        "--num_train_epochs", "12", "--early_stopping_patience", "2", "--merge",
        "--sample_prompts", "what is this?", "--max_new_tokens", "6", "--output_dir", str(output_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=repo_root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return output_dir, train, evaluation, base_sha, result.stdout + result.stderr


@pytest.mark.slow
def test_recipe_writes_a_complete_loadable_folder(recipe_run, l3gpt_folder):
    output_dir, _, _, base_sha, log = recipe_run
    for name in ["adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
                 "metadata.json", "all_results.json", "trainer_state.json", "loss.png", "README.md", "samples.json",
                 "merged/model.safetensors", "merged/config.json", "merged/tokenizer.json", "merged/metadata.json",
                 "merged/README.md"]:
        assert (output_dir / name).is_file(), name
    assert sha256_file(l3gpt_folder / "model.safetensors") == base_sha  # the base checkpoint is untouched
    base = AutoModelForCausalLM.from_pretrained(l3gpt_folder)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    model = PeftModel.from_pretrained(base, output_dir)
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert lora and all(("q_proj" in k or "v_proj" in k) for k in lora)
    assert all(v.abs().sum() > 0 for k, v in lora.items() if "lora_B" in k)  # B starts at zero: the adapter moved
    for name, tensor in model.get_base_model().state_dict().items():
        key = name.replace(".base_layer", "")
        if "lora_" not in name:
            assert torch.equal(tensor, original[key]), name
    merged = AutoModelForCausalLM.from_pretrained(output_dir / "merged")
    assert isinstance(merged, L3GPTForCausalLM)
    tokens = AutoTokenizer.from_pretrained(output_dir)("what is this?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, model(input_ids=tokens).logits, atol=1e-4, rtol=1e-4)
        base_logits = AutoModelForCausalLM.from_pretrained(l3gpt_folder)(tokens).logits
        assert not torch.allclose(merged(tokens).logits, base_logits)
    samples = json.loads((output_dir / "samples.json").read_text())
    assert samples[0]["prompt"] == "what is this?" and "Q: what is this?" in log


@pytest.mark.slow
def test_recipe_early_stops_at_the_expected_evaluation_and_keeps_the_best(recipe_run):
    output_dir, *_ = recipe_run
    state = json.loads((output_dir / "trainer_state.json").read_text())
    history = state["log_history"]
    end_of_training = next(i for i, e in enumerate(history) if "train_runtime" in e)
    evals = [e for e in history[:end_of_training] if "eval_loss" in e]  # the recipe evaluates once more after
    losses = [e["eval_loss"] for e in evals]
    # EarlyStoppingCallback's rule with patience 2: stop at the 2nd evaluation in a row without a new best. The
    # step-0 evaluation (`eval_on_start`) never sets the Trainer's best metric, so the rule starts after it.
    assert evals[0]["step"] == 0
    best, bad, expected_stop = math.inf, 0, None
    for index, loss in enumerate(losses[1:], start=1):
        bad = 0 if loss < best else bad + 1
        best = min(best, loss)
        if bad >= 2:
            expected_stop = index
            break
    assert expected_stop is not None and len(evals) == expected_stop + 1 < 12, losses
    assert all(math.isclose(e["eval_perplexity"], math.exp(e["eval_loss"]), rel_tol=1e-9) for e in evals)
    best_index = min(range(1, len(losses)), key=losses.__getitem__)  # checkpoints start after step 0
    best_step = evals[best_index]["step"]
    assert state["best_model_checkpoint"] == f"checkpoint-{best_step}"  # no local path in the output folder
    best_adapter = load_file(output_dir / state["best_model_checkpoint"] / "adapter_model.safetensors")
    final_adapter = load_file(output_dir / "adapter_model.safetensors")
    assert best_adapter.keys() == final_adapter.keys()
    assert all(torch.equal(best_adapter[k], final_adapter[k]) for k in best_adapter)
    results = json.loads((output_dir / "all_results.json").read_text())
    assert math.isclose(results["eval_loss"], losses[best_index], rel_tol=1e-6)  # the final evaluation: the best
    assert "eval_before_loss" in results and results["global_step"] == evals[-1]["step"]


@pytest.mark.slow
def test_recipe_provenance_in_metadata_safetensors_and_card(recipe_run, l3gpt_folder):
    output_dir, train, evaluation, _, _ = recipe_run
    metadata = json.loads((output_dir / "metadata.json").read_text())
    data = metadata["data"]
    assert data["train_records_sha256"] == sha256_records([list(r.messages) for r in read_chat_jsonl(train)])
    assert data["eval_records_sha256"] == sha256_records([list(r.messages) for r in read_chat_jsonl(evaluation)])
    assert data["files_sha256"][train.name] == hashlib.sha256(train.read_bytes()).hexdigest()  # no local path
    assert data["counts"]["train_file"]["read"] == 24 and data["counts"]["train_file"]["kept"] == 24
    assert data["counts"]["eval_file"]["kept"] == 8
    config = json.loads((l3gpt_folder / "config.json").read_text())
    assert metadata["base_model"]["name_or_path"] == l3gpt_folder.name
    # the one local path of the outputs: PEFT resolves a relative base against the working directory
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(l3gpt_folder.resolve())
    for name in ["metadata.json", "README.md", "adapter_model.safetensors", "all_results.json", "trainer_state.json",
                 "merged/metadata.json", "merged/README.md", "merged/model.safetensors"]:
        assert str(output_dir.parent.parent).encode() not in (output_dir / name).read_bytes(), name
    assert not list(output_dir.rglob("training_args.bin"))
    assert metadata["base_model"]["model_type"] == config["model_type"] == "l3gpt"
    assert len(metadata["base_model"]["config_sha256"]) == 64
    assert metadata["lora"]["r"] == 4 and sorted(metadata["lora"]["target_modules"]) == ["q_proj", "v_proj"]
    assert metadata["training_args"]["early_stopping_patience"] == 2
    assert {"hfl3", "torch", "transformers", "trl", "peft"} <= set(metadata["versions"])
    assert "git_commit" in metadata and metadata["results"]["eval_loss"] > 0
    for file in [output_dir / "adapter_model.safetensors", output_dir / "merged" / "model.safetensors"]:
        with safe_open(file, "pt") as f:
            header = f.metadata()
        assert json.loads(header["hfl3.data"])["train_records_sha256"] == data["train_records_sha256"]
        assert json.loads(header["hfl3.versions"]) == metadata["versions"]
    loaded_from = {}
    for card in [output_dir / "README.md", output_dir / "merged" / "README.md"]:
        text = card.read_text()
        assert data["train_records_sha256"] in text and metadata["versions"]["trl"] in text
        assert "_hfl3_staging" not in text  # the card names where the folder was committed, not where it was staged
        loaded_from[card.parent.name] = re.findall(r"from_pretrained\(\s*['\"]([^'\"]+)['\"]", text)
    assert loaded_from["merged"] and all(name.endswith("merged") for name in loaded_from["merged"])
    assert "library_name: peft" in (output_dir / "README.md").read_text()


def tiny_qwen3(tokenizer):
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config)


def tiny_gemma3(tokenizer):
    """Gemma 3 text model with a logit softcap small enough to bite (the stock config has none)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=16,
        final_logit_softcapping=0.5, pad_token_id=tokenizer.pad_token_id,
    )
    return Gemma3ForCausalLM(config)


def tiny_l3gpt(tokenizer):
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(
        2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32, max_position_embeddings=256,
        window_pattern="L", l3_after_layers=[0], l3_n_emb=4 * len(tokenizer), l3_k_max=16, l3_d_up=32,
    )
    return as_if_pretrained(L3GPTForCausalLM(config))


@pytest.fixture(scope="module")
def tokenizers(assets, gemma3_tokenizer, l3gpt_folder):
    return {"qwen3": AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3"),
            "gemma3": gemma3_tokenizer,
            "l3gpt": AutoTokenizer.from_pretrained(l3gpt_folder)}


def lora(r: int = 4, alpha: int = 8) -> LoraConfig:
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")


def make_trainer(tmp_path, tokenizer, build, packing=False):
    data_file = write_chat_jsonl(chats("good", 6, seed=0) + chats("night", 6, seed=2), tmp_path / "d.jsonl")
    data = load_sft_data(tokenizer, data_file, val_split=0.5, seed=0, max_length=64)
    args = ChatSFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, per_device_eval_batch_size=2,
                         max_length=64, packing=packing, report_to="none", disable_tqdm=True, seed=0)
    return ChatSFTTrainer(model=build(tokenizer), args=args, train_dataset=data.train, eval_dataset=data.eval,
                          processing_class=tokenizer, peft_config=lora()), data


@pytest.mark.parametrize("name, build", [
    ("qwen3", tiny_qwen3), pytest.param("gemma3", tiny_gemma3, marks=pytest.mark.gemma3), ("l3gpt", tiny_l3gpt)])
@pytest.mark.parametrize("packing", [False, True])
def test_compact_loss_equals_trl_loss_and_gradients(tmp_path, tokenizers, largest_tensor, name, build, packing):
    trainer, _ = make_trainer(tmp_path, tokenizers[name], build, packing)
    assert trainer.compact_loss
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert ("attention_mask" in batch) != packing
    model = trainer.model
    with torch.no_grad():  # the plain path: full logits, softcap, transformers' loss_function
        plain = model.eval()(**batch, num_items_in_batch=torch.tensor(37)).loss
    model.train()
    results = []
    for compact in (True, False):
        trainer.compact_loss = compact
        model.zero_grad()
        with largest_tensor() as largest:
            loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(37))
            loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads, largest.numel))
    (ours, our_grads, our_largest), (trl, trl_grads, _) = results
    torch.testing.assert_close(ours, trl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
    vocab = model.get_output_embeddings().weight.shape[0]
    # One chunk of float32 logits at most (or the embedding matrix), never (batch, supervised columns, vocab)
    assert our_largest <= max(CHUNK_BYTES // 4, vocab * model.config.hidden_size)
    assert our_grads.keys() == trl_grads.keys()
    for key in our_grads:
        torch.testing.assert_close(our_grads[key], trl_grads[key], rtol=1e-4, atol=1e-7)
    assert all(grad.abs().sum() > 0 for key, grad in our_grads.items() if "lora_B" in key)  # A gets 0: B starts at 0


def reference_eval_loss(model, dataset) -> float:
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for row in dataset:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1]
            nll += F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum").item()
            tokens += (labels != -100).sum().item()
    return nll / tokens


def test_eval_loss_is_token_weighted_and_perplexity_its_exp(tmp_path, tokenizers):
    trainer, data = make_trainer(tmp_path, tokenizers["l3gpt"], tiny_l3gpt)
    metrics = trainer.evaluate(metric_key_prefix="check")
    expected = reference_eval_loss(trainer.model.eval(), data.eval)
    assert math.isclose(metrics["check_loss"], expected, rel_tol=1e-5)
    assert math.isclose(metrics["check_perplexity"], math.exp(expected), rel_tol=1e-5)
    assert metrics["check_supervised_tokens"] == sum(sum(x != -100 for x in r[1:]) for r in data.eval["labels"])


@pytest.mark.parametrize("packing", [False, True])
def test_training_metrics_survive_a_last_partial_batch(tmp_path, tokenizers, packing):
    # 7 training rows in batches of 3: the last batch of the epoch holds 1 row, where accelerate's gather_for_metrics
    # cuts what it gathers to 1 element (it broke the per-rank [correct, count] pair of the accuracy)
    tokenizer = tokenizers["l3gpt"]
    data_file = write_chat_jsonl(chats("good", 5, seed=0) + chats("night", 5, seed=2), tmp_path / "d.jsonl")
    data = load_sft_data(tokenizer, data_file, val_split=0.3, seed=0, max_length=64)
    args = ChatSFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, num_train_epochs=1,
                         eval_strategy="no", load_best_model_at_end=False, save_strategy="no", max_length=64,
                         packing=packing, logging_steps=1, report_to="none", disable_tqdm=True, seed=0)
    trainer = ChatSFTTrainer(model=tiny_l3gpt(tokenizer), args=args, train_dataset=data.train,
                             processing_class=tokenizer, peft_config=lora(alpha=16))
    rows = trainer.train_dataset
    assert len(rows) % 3 == 1
    trainer.train()
    logged_tokens = [entry["num_tokens"] for entry in trainer.state.log_history if "num_tokens" in entry]
    assert logged_tokens[-1] == sum(len(ids) for ids in rows["input_ids"])  # cumulative, as TRL logs it
    accuracies = [entry["mean_token_accuracy"] for entry in trainer.state.log_history if "mean_token_accuracy" in entry]
    assert len(accuracies) == math.ceil(len(rows) / 3) and all(0 <= a <= 1 for a in accuracies)


@pytest.mark.parametrize("count_tokens", [False, True])
def test_sft_logs_its_throughput_when_the_trainer_counts_input_tokens(tmp_path, tokenizers, count_tokens):
    """SFT keeps its logs' keys (TRL's `num_tokens`, the accuracy, transformers' session `train_tokens_per_second`)
    and adds `tok_per_sec` to a training log when input tokens are counted (`--include_num_input_tokens_seen`; off
    by default: transformers' count reads the device after every micro-batch), and the peak memory at the end."""
    from hfl3.trainers.metrics import ThroughputConfig

    tokenizer = tokenizers["l3gpt"]
    data_file = write_chat_jsonl(chats("good", 5, seed=0) + chats("night", 5, seed=2), tmp_path / "d.jsonl")
    data = load_sft_data(tokenizer, data_file, val_split=0.3, seed=0, max_length=64)
    args = ChatSFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, num_train_epochs=1,
                         eval_strategy="no", load_best_model_at_end=False, save_strategy="no", max_length=64,
                         logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
                         include_num_input_tokens_seen=count_tokens)
    trainer = ChatSFTTrainer(model=tiny_l3gpt(tokenizer), args=args, train_dataset=data.train,
                             processing_class=tokenizer, peft_config=lora(alpha=16),
                             throughput=ThroughputConfig(warmup_steps=0))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all("num_tokens" in e and "mean_token_accuracy" in e for e in logged)
    assert [("tok_per_sec" in e, "train_tokens_per_second" in e) for e in logged] == \
        [(False, count_tokens)] + [(count_tokens, count_tokens)] * 2  # the first log opens the window
    assert all(e["tok_per_sec"] > 0 for e in logged if "tok_per_sec" in e) and not any("mfu" in e for e in logged)
    assert trainer.state.log_history[-1].keys() == {"step", "peak_memory_gb"}


@pytest.mark.parametrize("max_length, warned", [(128, False), (256, True)])
def test_max_length_beyond_the_trained_positions_is_warned(tmp_path, l3gpt_folder, caplog, sft_recipe, max_length,
                                                            warned):
    data_file = write_chat_jsonl(chats("good", 8, seed=0), tmp_path / "d.jsonl")
    args = ChatSFTConfig(output_dir=str(tmp_path / "out"), max_length=max_length, report_to="none")
    with caplog.at_level("WARNING", logger="hfl3.trainers.sft.builder"):
        trainer = build_sft_trainer(
            sft_recipe.SFTScriptArguments(train_file=str(data_file), val_split=0.25), args,
            sft_recipe.SFTModelArguments(model_name_or_path=str(l3gpt_folder), lora_r=4)).trainer
    assert trainer.model.config.max_position_embeddings == 128
    assert ("exceeds the base model's max_position_embeddings 128" in caplog.text) == warned


@pytest.mark.parametrize("packing", [False, True])
def test_finished_rows_skip_trls_preparation_unless_packed(tmp_path, tokenizers, packing):
    trainer, data = make_trainer(tmp_path, tokenizers["l3gpt"], tiny_l3gpt, packing)
    # unpacked, TRL would truncate the truncated rows again and keep every one of them: two copies for nothing
    assert (trainer.train_dataset is data.train) != packing and (trainer.eval_dataset is data.eval) != packing
    assert trainer.args.dataset_kwargs == (None if packing else {"skip_prepare_dataset": True})
    assert ("seq_lengths" in trainer.train_dataset.column_names) == packing  # TRL's packing ran


def test_datasets_without_labels_are_refused(tmp_path, tokenizers):
    rows = Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    args = ChatSFTConfig(output_dir=str(tmp_path), eval_strategy="no", load_best_model_at_end=False)
    with pytest.raises(ValueError, match="train_dataset has input_ids but no labels"):
        ChatSFTTrainer(model=tiny_l3gpt(tokenizers["l3gpt"]), args=args, train_dataset=rows,
                       processing_class=tokenizers["l3gpt"])


def test_cpu_defaults_differ_from_trl_where_documented(tmp_path, sft_recipe):
    args = ChatSFTConfig(output_dir=str(tmp_path))
    assert (args.bf16, args.activation_checkpointing, args.gradient_checkpointing) == (False, False, False)
    assert args.load_best_model_at_end and args.metric_for_best_model == "eval_loss" and args.learning_rate == 2e-4
    model_args = sft_recipe.SFTModelArguments
    assert model_args().lora_target_modules == ["q_proj", "v_proj"]
    assert get_peft_config(model_args(lora_target_modules=["o_proj"])).target_modules == {"o_proj"}
    assert get_peft_config(model_args(lora_target_modules=["all-linear"])).target_modules == "all-linear"


def run_recipe(recipe, caplog, *arguments: str) -> tuple[dict, object]:
    """`recipes/sft_lora.py ARGUMENTS` in this process (as its `__main__` does); returns the results and the args."""
    with caplog.at_level("INFO", logger="hfl3"):  # the arguments are checked first in main (hfl3.trainers.cli.setup)
        results, (_, args, _) = recipe_main(recipe, [*arguments, "--disable_tqdm", "true"])
        return results, args


def test_the_plainest_command_trains_without_evaluation(tmp_path, l3gpt_folder, sft_recipe, caplog):
    train = write_chat_jsonl(chats("good", 8, seed=0), tmp_path / "train.jsonl")
    results, args = run_recipe(sft_recipe, caplog, "--model_name_or_path", str(l3gpt_folder), "--train_file",
                               str(train), "--output_dir", str(tmp_path / "out"), "--num_train_epochs", "1")
    assert "no --dataset_test_split, --val_split or --eval_file: training without evaluation" in caplog.text
    assert (args.eval_strategy, args.load_best_model_at_end, args.eval_on_start) == ("no", False, False)
    assert results["global_step"] == 1 and results["train_loss"] > 0 and "eval_loss" not in results
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()


def test_eval_strategy_steps_alone_saves_at_every_evaluation_and_keeps_the_best(tmp_path, l3gpt_folder, sft_recipe,
                                                                                caplog):
    train = write_chat_jsonl(chats("good", 12, seed=0), tmp_path / "train.jsonl")
    results, args = run_recipe(sft_recipe, caplog, "--model_name_or_path", str(l3gpt_folder), "--train_file",
                               str(train), "--val_split", "0.25", "--output_dir", str(tmp_path / "out"),
                               "--eval_strategy", "steps", "--eval_steps", "2", "--max_steps", "4",
                               "--per_device_train_batch_size", "3", "--learning_rate", "1e-2")
    assert (args.save_strategy, args.save_steps, args.load_best_model_at_end) == ("steps", 2, True)
    evaluated = [e["step"] for e in json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
                 if "eval_loss" in e]
    assert evaluated[:3] == [0, 2, 4]
    assert results["best_model_checkpoint"].endswith(("checkpoint-2", "checkpoint-4"))


def test_best_model_selection_is_left_off_where_the_checkpoints_cannot_follow_the_evaluations(tmp_path, caplog):
    with caplog.at_level("INFO", logger="hfl3"):  # a full fine-tuning with evaluation and --save_strategy no
        args = ChatSFTConfig(output_dir=str(tmp_path), save_strategy="no")
    assert (args.eval_strategy, args.load_best_model_at_end) == ("epoch", False)
    assert "no best-model selection" in caplog.text and "--save_strategy no with --eval_strategy epoch" in caplog.text
    args = ChatSFTConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=10, save_steps=15)
    assert args.load_best_model_at_end is False  # 15 is no multiple of 10
    assert ChatSFTConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5).load_best_model_at_end


def test_a_refusal_involving_a_value_hfl3_chose_says_so_and_names_the_flag(tmp_path, sft_recipe, capsys):
    base = ["--model_name_or_path", "m", "--train_file", "t.jsonl", "--output_dir", str(tmp_path / "out")]
    capsys.readouterr()
    with pytest.raises(SystemExit):  # --save_steps alone saves by steps; evaluation is by epoch by default
        parse_recipe_args(sft_recipe.make_parser(), [*base, "--load_best_model_at_end", "true", "--save_steps", "7"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "requires the save and eval strategy to match" in line
    assert "eval_strategy=epoch is hfl3's default with evaluation data, not a value you gave; --eval_strategy changes " \
           "it" in line and "save_strategy=steps is hfl3's choice for a --save_steps given alone" in line
    assert "load_best_model_at_end=True is" not in line  # given: the user's own
    with pytest.raises(ValueError) as error:  # early stopping against a best-model selection hfl3 left off
        parse_and_set_up(sft_recipe, [*base, "--val_split", "0.25", "--save_strategy", "no",
                                      "--early_stopping_patience", "2"])
    assert "and --load_best_model_at_end true (" in str(error.value)
    assert str(error.value).endswith("load_best_model_at_end=False is hfl3's default where no checkpoint follows every "
                                     "evaluation, not a value you gave; --load_best_model_at_end changes it)")


def test_evaluation_asked_for_without_evaluation_data_is_refused(tmp_path, sft_recipe):
    for flags in (["--eval_strategy", "epoch"], ["--load_best_model_at_end", "true"],
                  ["--early_stopping_patience", "2"]):
        with pytest.raises(ValueError, match="needs"):  # by the checks, before the model or data is looked at
            parse_and_set_up(sft_recipe, ["--model_name_or_path", "m", "--train_file", "t.jsonl", "--output_dir",
                                          str(tmp_path), *flags])


# ---- adapters load the standard way -----------------------------------------------------------------------------

HUB_BASE = "hfl3-test/tiny-l3gpt"
TINY = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2", "--lora_r", "4",
        "--lora_alpha", "32", "--lora_dropout", "0", "--max_length", "64", "--report_to", "none", "--disable_tqdm",
        "true", "--dataloader_num_workers", "0"]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, assets):
    folder = tmp_path_factory.mktemp("qwen3_base")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    tiny_qwen3(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, l3gpt_folder):
    """A Hugging Face cache holding the tiny L3GPT as the Hub model `HUB_BASE`, laid out as a download leaves it."""
    cache = tmp_path_factory.mktemp("hub_cache")
    repo, commit = cache / f"models--{HUB_BASE.replace('/', '--')}", hashlib.sha1(HUB_BASE.encode()).hexdigest()
    shutil.copytree(l3gpt_folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return cache


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, l3gpt_folder, qwen3_folder, hub_cache, sft_recipe):
    """`(work, {name: (base, adapter folder, input_ids)})`: one adapter per base (a local L3GPT, a local Qwen3, the
    L3GPT as a Hub model in the cache) trained by the recipe from the working directory `work`, `--output_dir`
    relative to it; `input_ids` of a question in the base's tokenizer."""
    work = tmp_path_factory.mktemp("work")
    write_chat_jsonl(chats("good", 8, seed=0), work / "train.jsonl")
    trained = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        patch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
        for name, base in [("l3gpt", str(l3gpt_folder)), ("qwen3", str(qwen3_folder)), ("l3gpt_hub", HUB_BASE)]:
            recipe_main(sft_recipe, [
                "--model_name_or_path", base, "--train_file", "train.jsonl", "--output_dir", f"adapters/{name}", *TINY])
            ids = AutoTokenizer.from_pretrained(base)("what is this?", return_tensors="pt")["input_ids"]
            trained[name] = (base, work / "adapters" / name, ids)
    return work, trained


def card_snippet(card: str) -> str:
    """The first Python block of a model card."""
    return card.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("name", ["l3gpt", "qwen3", "l3gpt_hub"])
def test_the_adapter_loads_the_standard_way_from_any_working_directory(adapters, hub_cache, tmp_path, monkeypatch,
                                                                       name):
    work, trained = adapters
    base, adapter, ids = trained[name]
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        HUB_BASE if name == "l3gpt_hub" else str(Path(base).resolve()))
    with torch.no_grad():
        for directory in (work, tmp_path):  # where the recipe ran, and anywhere else
            monkeypatch.chdir(directory)
            auto = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
            manual = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
            assert_same_weights(auto, manual)
        with auto.disable_adapter():
            base_logits = auto(input_ids=ids).logits
        # the adapter acts: its logits move by far more than float32 round-off (~1e-7 relative)
        assert (auto(input_ids=ids).logits - base_logits).abs().max() > 1e-3 * base_logits.abs().max()
        monkeypatch.chdir(work)  # the card names the adapter as the recipe's --output_dir was given
        snippet = card_snippet((adapter / "README.md").read_text())
        assert f"AutoPeftModelForCausalLM.from_pretrained('adapters/{name}')" in snippet
        namespace = {}
        exec(snippet, namespace)
        assert_same_weights(namespace["model"], auto)


def assert_same_weights(model, reference):
    """Every tensor (base weights, LoRA A and B) equal bit for bit: both were read from the same files."""
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys() and any("lora_B" in key for key in state)
    assert all(torch.equal(state[key], expected[key]) for key in state)


def test_a_local_adapter_holds_no_other_local_path(adapters, tmp_path_factory):
    _, trained = adapters
    root = str(tmp_path_factory.getbasetemp()).encode()
    for name, (base, adapter, _) in trained.items():
        files = [p for p in adapter.rglob("*") if p.is_file() and not p.relative_to(adapter).parts[0].startswith(
            "checkpoint-")]  # a checkpoint's trainer_state.json needs its own path to resume
        assert {p.name for p in files} >= {"adapter_config.json", "adapter_model.safetensors", "README.md",
                                           "metadata.json", "all_results.json", "trainer_state.json"}
        for file in files:
            data = file.read_bytes()
            if file.name == "adapter_config.json" and name != "l3gpt_hub":
                data = data.replace(json.dumps(str(Path(base).resolve())).encode(), b'"BASE"')
            assert root not in data and b"/tmp/" not in data, (name, file.name)


@pytest.mark.slow
def test_without_hfl3_the_l3gpt_adapter_loads_with_trust_remote_code(adapters, run_without_hfl3):
    _, adapter, _ = adapters[1]["l3gpt"]
    run = run_without_hfl3("""
        import sys
        from peft import AutoPeftModelForCausalLM
        model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
        print(type(model).__name__, type(model.get_base_model()).__name__)
    """, adapter)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["PeftModelForCausalLM", "L3GPTForCausalLM"]


def test_the_base_hub_id_comes_from_the_flag_the_name_or_the_base_folder(tmp_path, hub_cache, monkeypatch):
    base = tmp_path / "outputs" / "pretrain"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps({"model_type": "l3gpt"}))
    assert base_model_hub_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert base_model_hub_id(str(base)) is None and base_model_hub_id(str(base), "me/base") == "me/base"
    (base / "metadata.json").write_text(json.dumps({"training_args": {"hub_model_id": "me/l3gpt-tiny"}}))
    assert base_model_hub_id(str(base)) == "me/l3gpt-tiny"
    snapshot = next((hub_cache / f"models--{HUB_BASE.replace('/', '--')}" / "snapshots").iterdir())
    assert base_model_hub_id(str(snapshot)) == HUB_BASE
    monkeypatch.chdir(tmp_path)
    assert local_base_model("outputs/pretrain") == str(base.resolve()) and local_base_model(HUB_BASE) == HUB_BASE


def test_what_is_pushed_names_the_base_by_its_hub_id_and_holds_no_local_path(tmp_path, l3gpt_folder, sft_recipe,
                                                                             monkeypatch):
    uploads, looked_up = [], []

    class FakeApi:  # the Hub API boundary: what upload_folder would send
        def __init__(self, token=None):
            pass

        def model_info(self, repo_id, *, revision=None, timeout=None):
            looked_up.append(repo_id)

        def create_repo(self, repo_id, private=None, exist_ok=False):
            pass

        def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns):
            files = {p.relative_to(folder_path).as_posix(): p.read_bytes() for p in Path(folder_path).rglob("*")
                     if p.is_file()}
            uploads.append((repo_id, {k: v for k, v in files.items()
                                      if not any(fnmatch.fnmatch(k, pattern) for pattern in ignore_patterns)}))
            return f"https://huggingface.co/{repo_id}/commit/1"

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    output_dir = tmp_path / "out"
    train = write_chat_jsonl(chats("good", 8, seed=0), tmp_path / "train.jsonl")
    results, _ = recipe_main(sft_recipe, [
        "--model_name_or_path", str(l3gpt_folder), "--train_file", str(train), "--val_split", "0.25",
        "--output_dir", str(output_dir), "--push_to_hub", "--hub_model_id", "me/tiny-adapter",
        "--base_model_hub_id", "me/tiny-l3gpt", *TINY])
    assert looked_up == ["me/tiny-l3gpt"]  # checked once, by the checks main runs first
    assert results["best_model_checkpoint"]  # a local path, which the pushed results must not hold
    [(repo_id, files)] = uploads
    assert repo_id == "me/tiny-adapter" and not (output_dir / "_hfl3_staging").exists()
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "metadata.json", "all_results.json",
            "trainer_state.json", "tokenizer.json"} <= set(files) and not [k for k in files if "checkpoint-" in k]
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == "me/tiny-l3gpt"
    for name, data in files.items():
        assert str(tmp_path).encode() not in data and str(l3gpt_folder).encode() not in data, name
        assert b"/tmp/" not in data, name
    card = files["README.md"].decode()
    assert "base_model: me/tiny-l3gpt" in card and "LoRA adapter of `me/tiny-l3gpt`" in card
    assert "AutoPeftModelForCausalLM.from_pretrained('me/tiny-adapter')" in card_snippet(card)
    local = json.loads((output_dir / "adapter_config.json").read_text())
    assert local["base_model_name_or_path"] == str(l3gpt_folder.resolve())  # the local copy still loads here
