"""Bad inputs and bad arguments (issue 15, items 2, 7 and 8): each gets its exact error, naming the fix, before any
data work, or a counted skip; a diverging run stops at the first non-finite loss, gradient norm or parameter, naming
the step, with nothing non-finite saved."""

import codecs
import importlib.util
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
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import load_file
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from hfl3 import L3GPTConfig, L3GPTForCausalLM, fp8
from hfl3.data import sources, streaming
from hfl3.data.chat import InvalidChatRecord, write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.tokenization import train_tokenizer
from hfl3.trainers.guards import NonFiniteTrainingError, check_vocabulary_fits
from hfl3.trainers.launch import parse_recipe_args
from hfl3.trainers.pretrain import L3GPTTrainer, PackedCollator, PretrainConfig
from hfl3.trainers.sft import HFL3SFTTrainer, SFTLoRAConfig

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


# ---- pretraining files --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("files", [["notes.md", "README.md"], ["BOOK.TXT"], ["a.md", "b.TXT"]])
def test_a_folder_without_readable_files_says_which_suffixes_are_read(tmp_path, files):
    for name in files:
        (tmp_path / name).write_text("some text\n")
    found = ", ".join(sorted({Path(name).suffix for name in files}))
    with pytest.raises(FileNotFoundError, match=r"matches no file: a --dataset entry reads \.txt, \.py, \.jsonl, "
                                                rf"\.json, \.parquet files \(suffixes are case-sensitive\).*holds "
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
                                      shuffle_shards=False, passes=2)
    batches = list(source.batches())
    assert [t for texts, _, _ in batches for t in texts] == unique + unique  # every pass drops the same repeats
    assert sum(skipped["duplicates"] for _, skipped, _ in batches) == 2 * 10
    for k in (3, 9, 14):  # resume mid-shard after batch k: the repeats before it are remembered by replaying
        assert list(source.batches(position=batches[k][2])) == batches[k + 1:]
    kept_all = streaming.DocumentSource(source.corpus, read_batch=4, shuffle_shards=False, passes=1, deduplicate=False)
    assert [t for texts, _, _ in kept_all.batches() for t in texts] == documents


def test_the_stream_counts_repeats_and_its_fingerprint_names_the_filter(tmp_path, shakespeare_paragraphs, tokenizer):
    (tmp_path / "book.txt").write_text("\n\n".join(shakespeare_paragraphs[:50] * 2))
    source = streaming.DocumentSource(sources.open_corpus(str(tmp_path / "book.txt")), read_batch=8, passes=1)
    packed = streaming.PackedStream(source, tokenizer, max_seq_len=64, shuffle_buffer=0)
    _, _, counts = packed.materialize(10_000)
    assert counts == {"documents": 50, "held_out": 0, "duplicates": 50}
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
    trainer = L3GPTTrainer(model=L3GPTForCausalLM(config), args=args,
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
    args = SFTLoRAConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_length=48,
                         eval_strategy="no", load_best_model_at_end=False, save_strategy="no", logging_steps=2,
                         report_to="none", disable_tqdm=True)
    trainer = HFL3SFTTrainer(model=L3GPTForCausalLM(config), args=args, train_dataset=data.train,
                             processing_class=tokenizer, peft_config=LORA)
    lora_b = lambda model: next(p for name, p in model.named_parameters() if "lora_B" in name)  # noqa: E731
    trainer.add_callback(Poison(3, lora_b))
    with pytest.raises(NonFiniteTrainingError, match="diverged at step 3: the loss and the gradient norm became NaN"):
        trainer.train()
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [2]


@pytest.mark.slow
def test_a_diverging_launch_exits_non_zero_and_keeps_the_last_good_checkpoint(repo_root, tmp_path):
    output_dir = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu.yaml",
         "recipes/pretrain.py", "--config", "recipes/configs/pretrain_tiny.yaml", "--learning_rate", "1e30",
         "--max_steps", "8", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2",
         "--output_dir", str(output_dir)],
        capture_output=True, text=True, timeout=600, cwd=repo_root,
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
