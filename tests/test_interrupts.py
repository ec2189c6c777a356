"""Interrupts never cost data: a run that replaces another run's folder (`--overwrite_output_dir`), stopped by Ctrl-C
(SIGINT) or killed (SIGKILL), leaves every file of the old folder as it was, its own checkpoints where the next start
finds them, and (Ctrl-C) one line saying what was saved and how to continue, exit status 130, no traceback."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hfl3.data.chat import write_chat_jsonl
from hfl3.trainers.outputs import STAGING


def tree(folder):
    """{relative path: bytes} of every file under `folder`, its staging area left out."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and STAGING not in p.relative_to(folder).parts}


@pytest.fixture(scope="module")
def base(tmp_path_factory, assets):
    folder = tmp_path_factory.mktemp("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=True)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                           {"role": "assistant", "content": f"{a + b}."}]} for a in range(8) for b in range(8)]
    return folder, write_chat_jsonl(chats, folder / "chats.jsonl")


def command(repo_root, base, output_dir, *extra):
    folder, chats = base
    return [sys.executable, str(repo_root / "recipes" / "sft_lora.py"), "--config",
            str(repo_root / "recipes" / "configs" / "sft_tiny.yaml"), "--model_name_or_path", str(folder),
            "--train_file", str(chats), "--output_dir", str(output_dir), "--per_device_train_batch_size", "2",
            "--save_steps", "1", "--num_train_epochs", "1", *extra]


def steps(run_dir) -> list[int]:
    return sorted(int(path.name.split("-")[1]) for path in run_dir.glob("checkpoint-*"))


@contextlib.contextmanager
def sigint_raises():
    """Inside: SIGINT raises KeyboardInterrupt in the processes started, as in a command run from a terminal. A test
    run started in the background by a non-interactive shell (`make test &` in a script, `nohup`) ignores SIGINT, and
    a child inherits an ignored signal: the recipe then never saw the Ctrl-C and ran to its end (exit 0)."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:  # a Python handler here is the default disposition in a child once it has exec'd
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_and_stop(repo_root, base, output_dir, sig, step: int, *extra, patience_s: float):
    """Start the recipe, send `sig` once its run folder holds the checkpoint of `step` or a later one; return (exit
    code, stderr). By step, not by count: sft_tiny.yaml keeps 2 checkpoints (`save_total_limit`), and a count of 3
    was seen only in the instant between a save and the rotation, or never (the run then ended before the signal).
    `patience_s` bounds each wait (for the checkpoint, then for the end): derived from a whole run's time. Its stderr
    goes to a file: a pipe nobody reads while it trains could fill and stop it."""
    run_dir = output_dir / STAGING / "run"
    log = output_dir.with_name(f"{output_dir.name}.{sig.name}.log")
    with sigint_raises(), log.open("w") as stderr:
        process = subprocess.Popen(command(repo_root, base, output_dir, *extra), cwd=repo_root, stderr=stderr,
                                   stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + patience_s
    while not [s for s in steps(run_dir) if s >= step] and process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no checkpoint of step {step} or later within {patience_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    process.send_signal(sig)
    try:
        process.wait(timeout=patience_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, log.read_text()


@pytest.mark.slow
def test_an_interrupted_overwrite_keeps_the_old_folder_and_resumes_its_own_checkpoints(tmp_path, repo_root, base):
    output_dir = tmp_path / "out"
    started = time.monotonic()
    old = subprocess.run(command(repo_root, base, output_dir, "--max_steps", "2"), cwd=repo_root, capture_output=True,
                         text=True)  # a hang: pytest-timeout
    assert old.returncode == 0, old.stderr[-3000:]
    # Each later wait is for a start, a load and a few steps: a whole 2-step run's time, here and now, 10 times over
    patience_s = 10 * (time.monotonic() - started)
    before = tree(output_dir)
    assert {"checkpoint-1/adapter_model.safetensors", "checkpoint-2/trainer_state.json",
            "adapter_model.safetensors"} <= set(before)

    code, stderr = start_and_stop(repo_root, base, output_dir, signal.SIGINT, 2, "--overwrite_output_dir",
                                  patience_s=patience_s)
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sft_lora.py: error: interrupted; the newest checkpoint is checkpoint-")
    assert last.endswith("'s own files are as they were before this run): add --overwrite_output_dir "
                         "--resume_from_checkpoint latest to continue from it")
    assert tree(output_dir) == before  # byte for byte: the old run's checkpoint-2 included
    staged = steps(output_dir / STAGING / "run")
    assert staged[-1] >= 2

    again = ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"]
    code, stderr = start_and_stop(repo_root, base, output_dir, signal.SIGKILL, staged[-1] + 1, *again,
                                  patience_s=patience_s)
    assert code == -signal.SIGKILL
    assert tree(output_dir) == before
    staged = steps(output_dir / STAGING / "run")

    finish = subprocess.run(command(repo_root, base, output_dir, *again, "--max_steps", str(staged[-1] + 1)),
                            cwd=repo_root, capture_output=True, text=True, timeout=patience_s)
    assert finish.returncode == 0, finish.stderr[-3000:]
    assert f"resuming from checkpoint-{staged[-1]}" in finish.stderr  # its own newest checkpoint
    after = tree(output_dir)
    assert not (output_dir / STAGING).exists()
    assert f"checkpoint-{staged[-1] + 1}/trainer_state.json" in after  # the new run's, moved in by its commit
    old_adapters = {name: data for name, data in before.items() if name.endswith("adapter_model.safetensors")}
    assert not any(after.get(name) == data for name, data in old_adapters.items())  # the old run's are replaced
