"""recipes/pretrain.py end to end (accelerate launch in a subprocess) and exact resume through the Trainer."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import hfl3
from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data.sources import open_corpus
from hfl3.data.streaming import DocumentSource, DocumentSplit, PackedStream
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.pretraining.builder import build_trainer
from hfl3.trainers.pretraining.trainer import DataLoaderConfig, PackedCollator, PretrainTrainer, StreamedTrainingData
from hfl3.trainers.pretraining.config import PretrainConfig


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory, repo_root):
    output_dir = tmp_path_factory.mktemp("pretrain")
    command = [
        os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch",
        "--config_file", str(repo_root / "accelerate_configs" / "cpu.yaml"),
        str(repo_root / "recipes" / "pretrain.py"), "--config", str(repo_root / "recipes" / "configs" /
                                                                     "pretrain_tiny.yaml"),
        "--output_dir", str(output_dir),
        "--core_metric_every", "15", "--core_bundle_dir", str(repo_root / "tests" / "fixtures" / "core_bundle"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=repo_root)
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
    assert results["eval_bpb"] < results["eval_before_bpb"]
    metadata = json.loads((output_dir / "metadata.json").read_text())
    digest = metadata["data"]["train_tokens_sha256"]
    assert len(digest) == 64 and metadata["versions"]["transformers"]
    assert metadata["data"]["packing"]["train"]["cropped_share"] < 0.2
    with safe_open(output_dir / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["hfl3.data"])["train_tokens_sha256"] == digest
    assert digest in (output_dir / "README.md").read_text()
    # CORE at steps 15 and 30 (hfl3.evaluate); the final one in all_results.json, metadata.json and the model-index
    assert log.count("CORE mc_animals (0-shot") == 2
    core = metadata["evaluation"]["core"]
    assert results["core_metric"] == core["core_metric"] == metadata["results"]["core_metric"]
    assert set(core["results"]) == {"mc_animals", "mc_animals_fewshot", "schema_animals", "lm_animals"}
    card = ModelCard.load(output_dir / "README.md")
    index = {(result.dataset_type, result.metric_type): result.metric_value for result in card.data.eval_results}
    assert index[("core", "core_metric")] == round(core["core_metric"], 4)
    assert "world size 1" in log and "reloaded from" in log
    plan = metadata["compute_optimal"]  # the start-up table's numbers; pretrain_tiny.yaml sizes its run by hand
    assert "compute-optimal plan" in log and (plan["max_steps"], plan["total_batch_size"]) == (30, 8 * 64)
    assert not plan["sized_by_dial"] and plan["lr_scale"] == 1.0 and plan["parameter_counts"]["l3_table"] > 0
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert isinstance(model, L3GPTForCausalLM)
    counts = model.model.l3_counts()
    assert counts.max() > 4 * counts.float().mean()  # the LZW allocation travelled with the checkpoint


REMOTE_GENERATE = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # as the model card says
ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer("def ", add_special_tokens=False)["input_ids"]])
print("TOKENS", model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist())
"""


@pytest.mark.slow
def test_upload_folder_generates_the_same_without_hfl3(recipe_run, run_without_hfl3):
    output_dir, _ = recipe_run
    result = run_without_hfl3(REMOTE_GENERATE, output_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "[y/N]" not in result.stdout + result.stderr
    remote_tokens = json.loads(result.stdout.split("TOKENS", 1)[1].strip())
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    ids = torch.tensor([[tokenizer.bos_token_id] + tokenizer("def ", add_special_tokens=False)["input_ids"]])
    local = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    assert remote_tokens == local


@pytest.fixture(scope="module")
def stream(assets):
    """Tiny Shakespeare split at blank lines, 5% held out, pieces of <= 128 characters, rows of 64 tokens."""
    shakespeare = assets / "text" / "tinyshakespeare.txt"
    tokenizer = train_tokenizer([shakespeare.read_text()[:80_000]], vocab_size=512)
    source = DocumentSource(open_corpus(str(shakespeare)), DocumentSplit(0.05, seed=0), seed=0, read_batch=32)
    return PackedStream(source, tokenizer, max_seq_len=64, document_max_chars=128, packing_buffer=64,
                        shuffle_buffer=64)


class RowRecorder(PretrainTrainer):
    """Keeps a short hash of every training row, in the order the optimizer steps consume them."""

    rows: list[str]

    def get_batch_samples(self, *args):
        batches, num_items_in_batch = super().get_batch_samples(*args)
        self.rows = getattr(self, "rows", []) + [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16]
                                                 for batch in batches for row in batch["input_ids"]]
        return batches, num_items_in_batch


def train_tiny(output_dir, stream, max_steps, resume_from=None, save_steps=None, optimizer="adamw_torch", workers=0):
    tokenizer = stream.tokenizer
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=64, window_pattern="SL", l3_after_layers=[0],
                                    l3_n_emb=4 * 512, l3_k_max=32, l3_d_up=64)
    args = PretrainConfig(
        output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4, learning_rate=5e-3,
        warmup_steps=2, logging_steps=1, eval_strategy="no", seed=0, optim=optimizer, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, dataloader_num_workers=workers,
        report_to="none",
    )
    trainer = RowRecorder(model=L3GPTForCausalLM(config), args=args, train_dataset=stream,
                          data_collator=PackedCollator(tokenizer.bos_token_id))
    trainer.train(resume_from_checkpoint=resume_from)
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}, trainer


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_consumes_exactly_the_rows_of_an_uninterrupted_run(tmp_path, stream, workers):
    """Killed after step 3 and resumed from checkpoint-3, the run consumes the rows the uninterrupted run consumed
    after step 3 (with 2 DataLoader workers: 3 batches consumed, so worker 1's stream is due first) and continues
    the chained digest of the consumed rows."""
    full, uninterrupted = train_tiny(tmp_path / "full", stream, max_steps=7, save_steps=3, workers=workers)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "data_state_rank0.safetensors").is_file()
    resumed, trainer = train_tiny(tmp_path / "resumed", stream, max_steps=7, resume_from=str(checkpoint),
                                  workers=workers)
    assert len(uninterrupted.rows) == 7 * 4 and uninterrupted.rows[:12] != uninterrupted.rows[12:24]
    assert trainer.rows == uninterrupted.rows[12:]
    assert trainer.streamed_data.progress.sha256 == uninterrupted.streamed_data.progress.sha256
    assert trainer.streamed_data.progress.batches == uninterrupted.streamed_data.progress.batches == 7
    assert [resumed[s] for s in range(4, 8)] == pytest.approx([full[s] for s in range(4, 8)], abs=1e-6)
    assert full[7] < full[1]
    if workers:
        with pytest.raises(ValueError, match="resume with the same numbers"):
            train_tiny(tmp_path / "other", stream, max_steps=7, resume_from=str(checkpoint), workers=1)


def test_the_trainer_holds_the_streamed_data_and_rows_keep_the_trainers_dataloader(tmp_path, stream):
    """`build_trainer` over a stream hands the trainer its `StreamedTrainingData` (the stream, the trainer's collator,
    the DataLoader arguments), which gives the DataLoader and takes each batch's state; over `datasets` rows there is
    none, and the DataLoader is the Trainer's. A stream with `ignore_data_skip=False` is refused before any data is
    read, whether the builder or the trainer builds the streamed data, and streamed data over another stream too."""
    import datasets

    tokenizer = stream.tokenizer
    config = L3GPTConfig.from_depth(1, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=64)
    args = PretrainConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, report_to="none",
                          dataloader_num_workers=0, max_steps=1, eval_strategy="no")
    trainer = build_trainer(L3GPTForCausalLM(config), args, stream, None, tokenizer=tokenizer)
    data = trainer.streamed_data
    assert isinstance(data, StreamedTrainingData) and data.stream is stream and data.collator is trainer.data_collator
    assert data.config == DataLoaderConfig(train_batch_size=3, dataloader_pin_memory=args.dataloader_pin_memory)
    assert data.progress is None and data.summary() is None
    batch = next(iter(trainer.get_train_dataloader()))
    assert "data_state" in batch and data.progress.batches == 0
    data.consume(batch)
    assert "data_state" not in batch and data.progress.batches == 1 and batch["input_ids"].shape == (3, 64)
    assert data.summary()["ranks"][0]["sha256"] == data.progress.sha256
    rows = datasets.Dataset.from_dict({"input_ids": batch["input_ids"].tolist()})
    plain = build_trainer(L3GPTForCausalLM(config), args, rows, None, tokenizer=tokenizer)
    assert plain.streamed_data is None and "data_state" not in next(iter(plain.get_train_dataloader()))

    refused = PretrainConfig(output_dir=str(tmp_path / "skip"), ignore_data_skip=False, report_to="none", max_steps=1,
                             eval_strategy="no")
    with pytest.raises(ValueError, match="set ignore_data_skip=True"):
        build_trainer(L3GPTForCausalLM(config), refused, stream, None, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="set ignore_data_skip=True"):
        PretrainTrainer(model=L3GPTForCausalLM(config), args=refused, train_dataset=stream,
                        data_collator=PackedCollator(tokenizer.bos_token_id))
    with pytest.raises(ValueError, match="another stream"):
        PretrainTrainer(model=L3GPTForCausalLM(config), args=args, train_dataset=stream,
                        streamed_data=StreamedTrainingData(rows, PackedCollator(tokenizer.bos_token_id),
                                                           DataLoaderConfig(train_batch_size=3)))


def test_adamw_decays_only_matrices(tmp_path, stream):
    _, trainer = train_tiny(tmp_path / "decay", stream, max_steps=1)
    groups = trainer.optimizer.param_groups
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
    assert groups[1]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == len(list(trainer.model.parameters()))
    assert hfl3.__version__


def test_optim_selects_the_optimizer_and_muon_takes_the_group_lrs(tmp_path, stream, pretrain_recipe):
    """`--optim muon` (the Trainer's own flag) builds MuonAdamW with the `*_lr` fields, recorded as `use_muon` beside
    the `optim` that transformers validated; any other `--optim` the Trainer's optimizer, decaying only matrices."""
    from hfl3.optim import MuonAdamW
    from hfl3.trainers.cli.arguments import parse_recipe_args

    _, args, _ = parse_recipe_args(pretrain_recipe.make_parser(), [
        "--output_dir", str(tmp_path), "--eval_strategy", "no", "--optim", "muon", "--matrix_lr", "0.05",
        "--embedding_lr", "0.1", "--l3_table_lr", "0.2"])
    assert args.use_muon and args.optim == "adamw_torch"
    assert {key: args.to_dict()[key] for key in ("optim", "use_muon", "matrix_lr")} == {
        "optim": "adamw_torch", "use_muon": True, "matrix_lr": 0.05}
    assert PretrainConfig(**{**args.to_dict(), "hub_token": None}).use_muon  # the record rebuilds the same arguments
    with pytest.raises(ValueError, match="use_muon=True with optim=sgd"):
        PretrainConfig(output_dir=str(tmp_path), eval_strategy="no", optim="sgd", use_muon=True)
    tokenizer = stream.tokenizer
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                                    max_position_embeddings=64, l3_after_layers=[0], l3_k_max=8))
    optimizer = PretrainTrainer(model=model, args=args).create_optimizer()
    scale = (model.config.hidden_size / 768) ** -0.5
    lrs = {group["name"]: group["lr"] for group in optimizer.param_groups}
    assert isinstance(optimizer, MuonAdamW)
    assert lrs["matrix"] == 0.05 and lrs["embedding"] == pytest.approx(0.1 * scale)
    assert lrs["l3_table"] == pytest.approx(0.2 * scale) and lrs["unembedding"] == pytest.approx(0.004 * scale)
    sgd = PretrainConfig(output_dir=str(tmp_path), eval_strategy="no", optim="sgd", weight_decay=0.1)
    optimizer = PretrainTrainer(model=model, args=sgd).create_optimizer()
    assert type(optimizer) is torch.optim.SGD
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert all(p.ndim >= 2 for p in optimizer.param_groups[0]["params"])
