"""Crash safety of output folders and checkpoints (docs/design.md, decision 13).

The launching test kills `recipes/pretrain.py` with SIGKILL (through `tests/fault_launch.py`) mid-step, mid-checkpoint
and mid-final-save, resumes each time with `--resume_from_checkpoint latest`, and compares the result with an
uninterrupted run. The other tests exercise each mechanism in process, without launching.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data.sources import open_corpus
from hfl3.data.streaming import DocumentSource, DocumentSplit, PackedStream
from hfl3.provenance import portable, stamp_folder
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.outputs import (
    STAGING,
    commit_folder,
    latest_checkpoint,
    prepare_output_dir,
)
from hfl3.trainers.cli.exits import run_recipe
from hfl3.trainers.pretraining.trainer import PretrainTrainer, PackedCollator
from hfl3.trainers.pretraining.config import PretrainConfig

# No evaluation: what is checked is what the kills leave and the weights the resumptions reach
TINY = ["--max_steps", "12", "--save_strategy", "steps", "--save_steps", "4", "--logging_steps", "2",
        "--tokenizer_train_chars", "100000", "--l3_sample_tokens", "20000", "--eval_strategy", "no"]


def launch(repo_root, output_dir, *extra, kill=None, timeout=None):
    """The recipe in a process of its own, killed where `kill` says (tests/fault_launch.py). Started by Python, not
    `accelerate launch`: a one-process launch only adds a parent that waits (tests/test_pretrain_recipe.py runs the
    recipe through it), and its start (a second interpreter importing accelerate and torch) costs ~5 s of CPU time.
    `timeout` (s): None for the first launch (a hang: pytest-timeout), then derived from the first one's time."""
    command = [
        sys.executable, str(repo_root / "tests" / "fault_launch.py"), str(repo_root / "recipes" / "pretrain.py"),
        "--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml"), "--output_dir", str(output_dir),
        *TINY, *extra,
    ]
    env = {**os.environ, "HFL3_KILL": kill or ""}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=repo_root, env=env)


def snapshot(folder):
    """{name: (bytes, mtime_ns)} of the files directly in `folder`."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}


def tree(folder, pattern):
    """{relative path: bytes} of every file under the subfolders of `folder` matching `pattern`."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for sub in folder.glob(pattern) for p in sub.rglob("*")
            if p.is_file()}


@pytest.mark.slow
def test_killed_three_times_the_run_resumes_to_the_uninterrupted_weights(tmp_path, repo_root):
    reference = tmp_path / "reference"
    started = time.monotonic()
    result = launch(repo_root, reference)
    assert result.returncode == 0, result.stderr[-4000:]
    limit = 10 * (time.monotonic() - started)  # each later launch runs at most the same steps: 10x this one's time
    # the reference folder is complete and holds no pickle, token or local path
    for name in ["model.safetensors", "tokenizer.json", "metadata.json", "README.md", "all_results.json"]:
        assert (reference / name).is_file(), name
    assert not list(reference.rglob("training_args.bin")) and not (reference / STAGING).exists()
    for name in ["metadata.json", "README.md", "checkpoint-12/trainer_state.json"]:
        assert str(tmp_path) not in (reference / name).read_text(), name

    # A new run over the finished folder (--overwrite_output_dir), killed mid-step: the old folder is untouched, its
    # checkpoints included; the new run's checkpoints are staged apart, where a kill cannot mix the two runs
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before, old_checkpoints = snapshot(run), tree(run, "checkpoint-*")
    result = launch(repo_root, run, "--overwrite_output_dir", kill="step:6", timeout=limit)
    assert result.returncode != 0
    assert snapshot(run) == before  # old code wrote the new tokenizer into output_dir before training
    assert tree(run, "checkpoint-*") == old_checkpoints  # old code deleted them once the new run had one
    assert sorted(p.name for p in (run / STAGING / "run").glob("checkpoint-*")) == ["checkpoint-4"]

    # Killed mid-checkpoint (optimizer.pt of checkpoint-8 written empty): checkpoint-8 never appears
    again = ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"]
    result = launch(repo_root, run, *again, kill="save:checkpoint-8/optimizer.pt", timeout=limit)
    assert result.returncode != 0 and "Resuming" not in result.stderr[-200:]
    assert not (run / STAGING / "run" / "checkpoint-8").exists()
    assert (run / STAGING / "checkpoints" / "checkpoint-8").is_dir()
    assert tree(run, "checkpoint-*") == old_checkpoints

    # Killed mid-final-save (the staged model.safetensors written): the old folder is still whole
    result = launch(repo_root, run, *again, kill="save:final/model.safetensors", timeout=limit)
    assert result.returncode != 0
    assert "skipping checkpoint-8: interrupted while saving" in result.stderr
    assert snapshot(run) == before and tree(run, "checkpoint-*") == old_checkpoints

    result = launch(repo_root, run, "--overwrite_output_dir", "--resume_from_checkpoint", "true", timeout=limit)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not (run / STAGING).exists()
    new_checkpoints = tree(run, "checkpoint-*")  # the new run's three, moved in by the commit
    assert sorted({name.split("/")[0] for name in new_checkpoints}) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    assert new_checkpoints != old_checkpoints
    resumed, uninterrupted = load_file(run / "model.safetensors"), load_file(reference / "model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    # train_loss over the whole run (12 steps), not the 0 steps of the last launch
    results = [json.loads((folder / "all_results.json").read_text()) for folder in (run, reference)]
    assert results[0]["train_loss"] == pytest.approx(results[1]["train_loss"], rel=1e-6)
    assert results[0]["train_steps_per_second"] < 10 * results[1]["train_steps_per_second"]
    metadata = json.loads((run / "metadata.json").read_text())
    assert metadata["data"]["train_tokens_sha256"] == json.loads(
        (reference / "metadata.json").read_text())["data"]["train_tokens_sha256"]


def test_a_non_empty_output_dir_is_refused_before_any_work(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"old")
    args = PretrainConfig(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(FileExistsError, match="--resume_from_checkpoint latest to continue.*--overwrite_output_dir"):
        prepare_output_dir(args)
    args.overwrite_output_dir = True
    folder = prepare_output_dir(args)
    assert folder.resume_checkpoint is None and folder.replacing and folder.run_dir == tmp_path / STAGING / "run"
    assert (tmp_path / "model.safetensors").read_bytes() == b"old"
    empty = tmp_path / "fresh"
    (empty / STAGING / "work").mkdir(parents=True)  # leftovers of a run killed before its first checkpoint
    folder = prepare_output_dir(PretrainConfig(output_dir=str(empty), report_to="none"))
    assert folder.resume_checkpoint is None and not folder.replacing


@pytest.mark.parametrize("folder", ["/proc/hfl3-output", "/sys/hfl3-output", "/proc/hfl3/out"])
def test_an_output_dir_that_cannot_be_written_is_refused_before_any_work(folder, pretrain_recipe, repo_root, capsys,
                                                                         monkeypatch):
    """A probe file is created and removed where the folder would go: `os.access` says yes for /proc and /sys to
    root, and such a run once read the corpus and trained the tokenizer, then died saving."""
    monkeypatch.setattr(os, "access", lambda *arguments, **options: True)  # what root is told: it must not count
    opened = []
    monkeypatch.setattr(pretrain_recipe, "build_pretraining", lambda *arguments: opened.append(arguments))
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(pretrain_recipe.make_parser(), pretrain_recipe.main, [
            "--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml"), "--output_dir", folder])
    assert exit_info.value.code == 2 and not opened
    line = capsys.readouterr().err.strip().splitlines()[-1]
    top = "/" + folder.split("/")[1]
    assert line.split(": error: ", 1)[1].startswith(f"--output_dir {folder}: {top} is not writable (a probe file could "
                           "not be created there: "), line
    assert line.endswith("); expected a folder this user can create and write")


def test_the_write_probe_leaves_nothing_behind(tmp_path):
    for folder in (tmp_path / "exists", tmp_path / "new" / "deeper"):
        (tmp_path / "exists").mkdir(exist_ok=True)
        prepare_output_dir(PretrainConfig(output_dir=str(folder), report_to="none"))
    assert [p.name for p in tmp_path.iterdir()] == ["exists"] and not any((tmp_path / "exists").iterdir())


def test_latest_skips_incomplete_checkpoints_with_a_warning(tmp_path, caplog):
    for step, files in [(2, {"trainer_state.json": "{}", "optimizer.pt": "x"}),
                        (4, {"trainer_state.json": "{}", "optimizer.pt": ""}),  # killed mid-save by the old code
                        (6, {"optimizer.pt": "x"})]:
        (tmp_path / f"checkpoint-{step}").mkdir()
        for name, text in files.items():
            (tmp_path / f"checkpoint-{step}" / name).write_text(text)
    (tmp_path / STAGING / "checkpoints" / "checkpoint-8").mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    assert "checkpoint-8: interrupted" in caplog.text and "empty file(s) optimizer.pt" in caplog.text
    assert "checkpoint-6: trainer_state.json unreadable" in caplog.text
    args = PretrainConfig(output_dir=str(tmp_path), resume_from_checkpoint="latest", report_to="none")
    assert prepare_output_dir(args).resume_checkpoint == str(tmp_path / "checkpoint-2")
    assert args.resume_from_checkpoint == "latest"  # what was asked stays; the folder carries what it resolved to
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        prepare_output_dir(PretrainConfig(output_dir=str(tmp_path), resume_from_checkpoint=str(tmp_path /
                                                                                                  "checkpoint-4")))


def test_commit_replaces_the_folder_weights_last_and_finishes_after_a_kill(tmp_path, monkeypatch):
    folder, staged = tmp_path / "out", tmp_path / "out" / STAGING / "final"
    staged.mkdir(parents=True)
    for name in ["model.safetensors", "metadata.json", "stale.safetensors", "keep.txt"]:
        (folder / name).write_text("old")
    for name in ["model.safetensors", "metadata.json", "README.md"]:
        (staged / name).write_text("new")
    order = []
    rename = type(staged).rename
    monkeypatch.setattr(type(staged), "rename", lambda self, target: (order.append((self.name, str(target))),
                                                                      rename(self, target))[1])
    commit_folder(staged, folder)
    moves_in = [name for name, target in order if STAGING not in target]
    assert moves_in[-1] == "model.safetensors" and order[0][0] in ("model.safetensors", "stale.safetensors")
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "model.safetensors": "new", "metadata.json": "new", "README.md": "new", "keep.txt": "old"}

    # a kill after the old files left and before the new weights arrived: prepare_output_dir finishes the commit
    staged.mkdir(parents=True)
    (staged / "model.safetensors").write_text("newer")
    (staged / ".complete").touch()
    prepare_output_dir(PretrainConfig(output_dir=str(folder), overwrite_output_dir=True, report_to="none"))
    assert (folder / "model.safetensors").read_text() == "newer" and not (folder / STAGING).exists()


def test_outputs_hold_no_token_and_no_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    secret = "hf_" + "a1B2" * 9
    metadata = {"training_args": {"hub_token": secret, "output_dir": str(tmp_path / "outputs" / "demo"),
                                  "logging_dir": "/tmp/elsewhere/runs"},
                "data": {"files_sha256": {str(tmp_path / "train.jsonl"): "ab" * 32}, "note": f"token {secret}"},
                "base_model": {"name_or_path": "Qwen/Qwen3-0.6B"}}
    cleaned = portable(metadata)
    assert cleaned["training_args"] == {"output_dir": "outputs/demo", "logging_dir": "runs"}
    assert cleaned["data"] == {"files_sha256": {"train.jsonl": "ab" * 32}, "note": "token <redacted>"}
    folder = tmp_path / "outputs" / "demo"
    folder.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, folder / "adapter_model.safetensors")
    stamp_folder(folder, metadata, {"title": "t", "extra_markdown": f"from_pretrained({str(folder)!r})",
                                    "base_model": "Qwen/Qwen3-0.6B"})
    for name in ["metadata.json", "README.md", "adapter_model.safetensors"]:
        data = (folder / name).read_bytes()
        assert str(tmp_path).encode() not in data and secret.encode() not in data and b"/tmp/" not in data, name
    assert "base_model: Qwen/Qwen3-0.6B" in (folder / "README.md").read_text()


@pytest.fixture(scope="module")
def stream(assets):
    text = assets / "text" / "tinyshakespeare.txt"
    tokenizer = train_tokenizer([text.read_text()[:60_000]], vocab_size=384)
    source = DocumentSource(open_corpus(str(text)), DocumentSplit(0.05, seed=0), seed=0, read_batch=32)
    return PackedStream(source, tokenizer, max_seq_len=32, document_max_chars=64, packing_buffer=32,
                        shuffle_buffer=32)


def tiny_trainer(output_dir, stream, depth=1, **kwargs):
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(depth, vocab_size=len(stream.tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=32, window_pattern="L")
    args = PretrainConfig(**{"output_dir": str(output_dir), "per_device_train_batch_size": 2, "learning_rate": 5e-3,
                             "logging_steps": 1, "eval_strategy": "no", "seed": 0, "disable_tqdm": True,
                             "report_to": "none", "save_strategy": "steps", **kwargs})
    return PretrainTrainer(model=L3GPTForCausalLM(config), args=args, train_dataset=stream,
                        processing_class=stream.tokenizer, data_collator=PackedCollator(stream.tokenizer.bos_token_id))


def test_resume_reports_the_whole_run_and_refuses_another_model(tmp_path, stream):
    full = tiny_trainer(tmp_path / "full", stream, max_steps=4, save_steps=2).train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not (checkpoint / "training_args.bin").exists() and (checkpoint / "tokenizer.json").is_file()
    resumed = tiny_trainer(tmp_path / "full", stream, max_steps=4, save_steps=2).train(str(checkpoint))
    assert resumed.metrics["train_loss"] == pytest.approx(full.metrics["train_loss"], rel=1e-5)
    assert resumed.global_step == 4
    # from the last checkpoint: nothing to train (transformers 5.23 would run a 5th step on a stream)
    finished = tiny_trainer(tmp_path / "full", stream, max_steps=4, save_steps=2)
    metrics = finished.train("latest").metrics
    assert metrics["train_loss"] == pytest.approx(full.metrics["train_loss"], rel=1e-5)
    assert finished.state.num_input_tokens_seen == 4 * 2 * 32
    with pytest.raises(ValueError, match=r"belongs to another run.*num_hidden_layers: 1 \(checkpoint\) vs 2"):
        tiny_trainer(tmp_path / "full", stream, depth=2, max_steps=4, save_steps=2).train("latest")


def test_sft_saves_no_token_and_resume_refuses_other_data(tmp_path, stream):
    from peft import LoraConfig
    from test_sft_recipe import chats, tiny_l3gpt

    from hfl3.data.chat import write_chat_jsonl
    from hfl3.data.sft import load_sft_data
    from hfl3.provenance import build_metadata
    from hfl3.trainers.sft.trainer import ChatSFTTrainer
    from hfl3.trainers.sft.config import ChatSFTConfig

    lora = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tokenizer, secret = stream.tokenizer, "hf_" + "Z9y8" * 9

    def trainer_on(answer_word, seed):
        data = load_sft_data(tokenizer, write_chat_jsonl(chats(answer_word, 8, seed=seed), tmp_path / f"{seed}.jsonl"),
                             max_length=64)
        args = ChatSFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2,
                             eval_strategy="no", load_best_model_at_end=False, save_strategy="steps", save_steps=2,
                             max_length=64, hub_token=secret, report_to="none", disable_tqdm=True, seed=0)
        return ChatSFTTrainer(model=tiny_l3gpt(tokenizer), args=args, train_dataset=data.train,
                              processing_class=tokenizer, peft_config=lora,
                              provenance=build_metadata(data=data.provenance, training_args=args.to_dict()))

    trainer_on("good", 0).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "metadata.json").is_file() and (checkpoint / "adapter_model.safetensors").is_file()
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert not [p for p in files if p.name == "training_args.bin"]  # a pickle holding hub_token
    assert not [p for p in files if secret.encode() in p.read_bytes()]
    with pytest.raises(ValueError, match="belongs to another run.*data.train_records_sha256"):
        trainer_on("night", 1).train("latest")
