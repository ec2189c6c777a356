"""nanochat checkpoints → L3GPT folders (nanochat/convert_nanochat_to_hf.py) and back (convert_hf_to_nanochat.py).

Checkpoints in nanochat's exact file format are built from the float64 reference of tests/nanochat_reference.py for
nanochat master (92d63d4) and its L3 fork (PR #559, b7629ef); the converted folders' logits are compared with the
reference's. Every transform of the conversion is exact on these weights (sign flips; ×8 and ÷8 as √C = 8; ×2/3 on
value embeddings that are multiples of 3·2^-10), so the float64 model and the float64 reference differ only in the
order of float64 operations (SDPA vs einsum, as in test_nanochat_core.py): 1e-10.
"""

import json
import runpy
import subprocess
import sys

import pytest
import torch
from nanochat_reference import (
    Spec, forward, random_weights, render_conversation, train_ranks, write_checkpoint,
    write_tokenizer_pickle,
)  # fmt: skip
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfl3.data.chat import read_chat_jsonl, write_chat_jsonl
from hfl3.nanochat import convert_hf_to_nanochat, convert_nanochat_to_hf
from hfl3.nanochat.convert_nanochat_to_hf import convert
from hfl3.nanochat.convert_nanochat_tokenizer import load_nanochat_encoding
from hfl3.provenance import sha256_file
from hfl3.trainers.sft.config import ChatSFTConfig
from hfl3.trainers.sft.builder import build_sft_trainer

TOLERANCE = 1e-10  # float64 op order only (module docstring)
STEP = 120
VOCAB = 500  # 491 ranks + 9 specials: padded to 512 in the model
MASTER = Spec("master", vocab=VOCAB, sequence_len=1024)  # "S" window 256: a 300-token input crosses it
FORK = Spec("l3_fork", vocab=VOCAB, sequence_len=64, l3_after_layers=[1], l3_n_emb=1500)  # window 32, 48 tokens
FORK_UNTIED = Spec("l3_fork", vocab=VOCAB, sequence_len=64, l3_after_layers=[0, 2], l3_n_emb=1200, l3_tie_kv=False)


@pytest.fixture(scope="module")
def ranks(assets):
    return train_ranks((assets / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000], 491)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, ranks):
    folder = tmp_path_factory.mktemp("nanochat") / "tokenizer"
    write_tokenizer_pickle(folder, ranks)
    return folder


def converted(tmp_path, tokenizer_dir, spec, seed=0, prefix="", **kwargs):
    """(L3GPT folder, nanochat weights, checkpoint folder) for a random nanochat model of `spec`."""
    weights = random_weights(spec, seed)
    checkpoint = write_checkpoint(tmp_path / "base_checkpoints" / "d3", weights, spec, STEP, prefix)
    return convert(checkpoint, tokenizer_dir, tmp_path / "hf", **kwargs), weights, checkpoint


def test_master_checkpoint_converts_to_equal_logits(tmp_path, tokenizer_dir):
    folder, weights, _ = converted(tmp_path, tokenizer_dir, MASTER, prefix="_orig_mod.")  # a compiled model's keys
    model = AutoModelForCausalLM.from_pretrained(folder).double().eval()
    config = model.config
    assert (config.vocab_size, config.sliding_window, config.rms_norm_eps) == (512, 257, 2.0**-23)
    ids = torch.randint(0, VOCAB, (2, 300), generator=torch.Generator().manual_seed(1))
    reference = forward(weights, MASTER, ids)
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits[..., :VOCAB], reference, rtol=TOLERANCE, atol=TOLERANCE)
    # the guard: each convention the conversion sets moves the logits far beyond the tolerance
    for change in ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, {"qk_norm_scale": 1.0},
                   {"sliding_window": 256}, {"rms_norm_eps": 1e-6}, {"use_backout": False}):
        other = AutoModelForCausalLM.from_pretrained(folder, **change).double().eval()
        with torch.no_grad():
            assert (other(ids).logits[..., :VOCAB] - reference).abs().max() > 100 * TOLERANCE, change


@pytest.mark.parametrize("spec", [FORK, FORK_UNTIED], ids=["tied", "untied"])
def test_l3_fork_checkpoint_converts_to_equal_logits(tmp_path, tokenizer_dir, spec):
    folder, weights, _ = converted(tmp_path, tokenizer_dir, spec)
    model = AutoModelForCausalLM.from_pretrained(folder).double().eval()
    config = model.config
    assert config.l3_after_layers == spec.l3_after_layers and config.l3_tie_kv == spec.l3_tie_kv
    assert config.l3_n_emb == spec.l3_n_emb + 12 and not config.use_smear_gate  # a row for each padded id
    counts = model.model.l3_counts()
    bounds = weights[f"l3_layers.{spec.l3_after_layers[0]}.bounds"]
    assert torch.equal(counts[:VOCAB], bounds[1:] - bounds[:-1]) and counts.max() > 1  # the fork's allocation
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))
    reference = forward(weights, spec, ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[..., :VOCAB], reference, rtol=TOLERANCE, atol=TOLERANCE)
        normed = AutoModelForCausalLM.from_pretrained(folder, l3_mix_input="normed").double().eval()
        assert (normed(ids).logits[..., :VOCAB] - reference).abs().max() > 100 * TOLERANCE  # the guard


REMOTE_SCRIPT = """
import json
import runpy
import subprocess
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).double().eval()
assert "hfl3" not in type(model).__module__, type(model).__module__
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
ids = torch.load(folder + "/ids.pt")
with torch.no_grad():
    torch.save(model(ids).logits, folder + "/remote_logits.pt")
chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
json.dump(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False), open(folder + "/chat.json", "w"))
"""


def test_converted_folder_loads_as_remote_code_without_hfl3(tmp_path, tokenizer_dir, ranks, run_without_hfl3):
    folder, weights, _ = converted(tmp_path, tokenizer_dir, FORK)  # its l3_mix_input lives in the shipped code
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(9))
    torch.save(ids, folder / "ids.pt")
    result = run_without_hfl3(REMOTE_SCRIPT, folder)
    assert result.returncode == 0, result.stderr[-3000:]
    logits = torch.load(folder / "remote_logits.pt")[..., :VOCAB]
    torch.testing.assert_close(logits, forward(weights, FORK, ids), rtol=TOLERANCE, atol=TOLERANCE)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert json.loads((folder / "chat.json").read_text()) == render_conversation(chat, ranks)[0]


def test_greedy_generate_follows_nanochat(tmp_path, tokenizer_dir):
    folder, weights, _ = converted(tmp_path, tokenizer_dir, MASTER, seed=3)
    model = AutoModelForCausalLM.from_pretrained(folder).double().eval()
    stop = {model.generation_config.bos_token_id, *model.generation_config.eos_token_id}
    assert model.generation_config.suppress_tokens == list(range(VOCAB, 512))  # nanochat crops its logits
    prompt = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    expected = prompt
    for _ in range(8):  # nanochat's GPT.generate at temperature 0, stopping where its Engine stops
        token = forward(weights, MASTER, expected)[:, -1].argmax(-1, keepdim=True)
        expected = torch.cat([expected, token], dim=1)
        if int(token) in stop:
            break
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated, expected)


def test_bad_checkpoints_are_refused_with_their_names(tmp_path, tokenizer_dir, capsys):
    spec = FORK
    weights = random_weights(spec)
    cases = {
        "unknown": ({**weights, "l3_lambdas": torch.ones(1)}, spec.model_config(), None,
                    r"does not know: \['l3_lambdas'\]"),
        "missing": ({k: v for k, v in weights.items() if k != "transformer.h.2.mlp.c_fc.weight"}, spec.model_config(),
                    None, r"missing: \['transformer.h.2.mlp.c_fc.weight'\]"),
        "shape": (weights, {**spec.model_config(), "n_embd": 128}, None, "shapes do not fit"),
        "vocab": (weights, {**spec.model_config(), "vocab_size": 501}, None, "tokenizer has 500 tokens"),
        "bounds": ({**weights, "l3_layers.1.bounds": torch.arange(VOCAB + 1) * 9}, spec.model_config(), None,
                   "owning 1..l3_k_max=8"),
        "version": ({k: v for k, v in weights.items() if not k.startswith("l3_")},
                    {k: v for k, v in spec.model_config().items() if not k.startswith("l3_")}, None,
                    "pass --nanochat_version"),
    }  # fmt: skip
    for name, (state, model_config, version, message) in cases.items():
        checkpoint = tmp_path / name
        write_checkpoint(checkpoint, state, spec, STEP)
        meta = json.loads((checkpoint / f"meta_{STEP:06d}.json").read_text())
        (checkpoint / f"meta_{STEP:06d}.json").write_text(json.dumps({**meta, "model_config": model_config}))
        with pytest.raises(ValueError, match=message):
            convert(checkpoint, tokenizer_dir, tmp_path / f"{name}_hf", nanochat_version=version)
        assert not (tmp_path / f"{name}_hf").exists()  # nothing half-written
    # the dense checkpoint of the last case converts once its version is named (the guard: the refusal was needed)
    assert convert(tmp_path / "version", tokenizer_dir, tmp_path / "named", nanochat_version="l3_fork").is_dir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    arguments = ["--checkpoint_dir", str(tmp_path / "version"), "--tokenizer_dir", str(tokenizer_dir)]
    capsys.readouterr()
    assert convert_nanochat_to_hf.main([*arguments, "--output_dir", str(tmp_path / "busy")]) == 2
    assert convert_nanochat_to_hf.main([*arguments, "--output_dir", str(tmp_path / "x"), "--step", "7"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "not empty" in errors[0] and "steps present: [120]" in errors[1]


def test_folder_is_portable_with_provenance(tmp_path, tokenizer_dir, monkeypatch):
    pushed = []
    monkeypatch.setattr(convert_nanochat_to_hf, "push_folder_to_hub", lambda folder, repo: pushed.append(folder))
    checkpoint = write_checkpoint(tmp_path / "chatsft_checkpoints" / "d3", random_weights(MASTER), MASTER, STEP)
    output = tmp_path / "out" / "nanochat-d3"
    assert convert_nanochat_to_hf.main(["--checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(tokenizer_dir),
                                        "--output_dir", str(output), "--push_to_hub", "--hub_model_id", "me/d3"]) == 0
    assert pushed == [output]  # the folder itself is what is uploaded
    sources = {"model_000120.pt": checkpoint / "model_000120.pt", "meta_000120.json": checkpoint / "meta_000120.json",
               "tokenizer.pkl": tokenizer_dir / "tokenizer.pkl"}
    metadata = json.loads((output / "metadata.json").read_text())
    files = metadata["nanochat_source"]["files"]
    assert {name: entry["sha256"] for name, entry in files.items()} == {n: sha256_file(p) for n, p in sources.items()}
    assert metadata["nanochat_source"]["version"] == "master" and metadata["nanochat_source"]["step"] == STEP
    with safe_open(output / "model.safetensors", "pt") as f:
        assert sha256_file(sources["model_000120.pt"]) in f.metadata()["hfl3.nanochat_source"]
    card = (output / "README.md").read_text()
    assert all(sha256_file(path) in card for path in sources.values())
    config = json.loads((output / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].endswith("L3GPTForCausalLM")
    assert (output / "modeling_l3gpt.py").is_file() and not list(tmp_path.glob("out/.*"))  # no staging left
    for path in output.rglob("*"):
        if path.suffix in (".json", ".md", ".py", ".jinja", ".txt"):
            assert str(tmp_path) not in path.read_text() and "/tmp" not in path.read_text(), path.name
    generation = json.loads((output / "generation_config.json").read_text())
    ids = AutoTokenizer.from_pretrained(output).convert_tokens_to_ids(["<|assistant_end|>", "<|bos|>"])
    assert generation["eos_token_id"] == ids and generation["pad_token_id"] == ids[1]


def test_sft_lora_trains_on_a_converted_chat_model(tmp_path, tokenizer_dir, ranks, assets, sft_recipe):
    folder, _, _ = converted(tmp_path, tokenizer_dir, MASTER, seed=5)
    records = read_chat_jsonl(assets / "chat" / "gsm8k_messages_train.jsonl")[:12]
    chats = write_chat_jsonl([{"messages": list(r.messages)} for r in records], tmp_path / "chats.jsonl")
    args = ChatSFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=4, max_length=256,
        learning_rate=1e-2, eval_strategy="no", load_best_model_at_end=False, save_strategy="no", report_to="none",
        disable_tqdm=True,
    )  # fmt: skip
    model_args = sft_recipe.SFTModelArguments(model_name_or_path=str(folder), lora_r=4, lora_alpha=8, lora_dropout=0.0)
    run = build_sft_trainer(sft_recipe.SFTScriptArguments(train_file=str(chats)), args, model_args)
    trainer, data = run.trainer, run.data
    assert data.provenance["end_of_turn"] == "<|assistant_end|>"
    rendered = [render_conversation(list(record.messages), ranks) for record in records]
    expected = [(ids[:256], mask[:256]) for ids, mask in rendered if any(mask[1:256])]  # kept: a reply token left
    assert 0 < len(expected) < len(records)  # the guard: truncation dropped some, the rest must match exactly
    rows = [(row["input_ids"], [int(label != -100) for label in row["labels"]]) for row in data.train]
    assert rows == expected  # nanochat's rendering and loss mask, truncated
    trainer.train()
    lora_b = [p for name, p in trainer.model.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: the adapters moved
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_round_trip_back_to_nanochat_files(tmp_path, tokenizer_dir):
    folder, _, checkpoint = converted(tmp_path, tokenizer_dir, MASTER, seed=6)
    base = tmp_path / "nanochat_base"
    assert convert_hf_to_nanochat.main(["--model_dir", str(folder), "--nanochat_base_dir", str(base),
                                        "--source", "sft"]) == 0
    exported = torch.load(base / "chatsft_checkpoints" / "d3" / f"model_{STEP:06d}.pt", weights_only=True)
    original = torch.load(checkpoint / f"model_{STEP:06d}.pt", weights_only=True)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():  # float32 values (bf16 embeddings upcast exactly): bit for bit
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], tensor.float()), name
    meta = json.loads((base / "chatsft_checkpoints" / "d3" / f"meta_{STEP:06d}.json").read_text())
    assert meta["model_config"] == MASTER.model_config() and meta["hfl3_export"]["eps_change"] == 0.0
    assert load_nanochat_encoding(base / "tokenizer") == load_nanochat_encoding(tokenizer_dir)
    lengths = torch.load(base / "tokenizer" / "token_bytes.pt", weights_only=True)
    assert lengths.dtype == torch.int32 and lengths.shape == (VOCAB,) and lengths[-9:].sum() == 0
    with pytest.raises(FileExistsError, match="exist"):  # never overwrites a checkpoint
        convert_hf_to_nanochat.export(folder, base, "sft")


def test_export_of_an_hfl3_model_and_refusals(tmp_path, tokenizer_dir):
    folder, _, _ = converted(tmp_path, tokenizer_dir, MASTER, seed=7)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # as if trained further in hfl3, with hfl3's default epsilon
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    model.config.rms_norm_eps = 1e-6
    trained = tmp_path / "trained"
    model.save_pretrained(trained)
    AutoTokenizer.from_pretrained(folder).save_pretrained(trained)
    result = convert_hf_to_nanochat.export(trained, tmp_path / "base", "base", model_tag="mine", step=5)
    assert 0 < result["eps_change"] < 1e-5  # reported, not hidden
    state = torch.load(tmp_path / "base" / "base_checkpoints" / "mine" / "model_000005.pt", weights_only=True)
    ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(8))
    reloaded = AutoModelForCausalLM.from_pretrained(trained, rms_norm_eps=2.0**-23).double().eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits[..., :VOCAB], forward({k: v.double() for k, v in state.items()},
                                   MASTER, ids), rtol=TOLERANCE, atol=TOLERANCE)  # fmt: skip
    for change, message in (({"l3_after_layers": [1], "l3_n_emb": 1024}, "l3_after_layers=\\[1\\]"),
                            ({"sliding_window": 300}, "sliding_window=300"), ({"qk_norm_scale": 1.0}, "qk_norm_scale")):
        other = tmp_path / f"other_{len(message)}"
        AutoModelForCausalLM.from_pretrained(folder, **change).save_pretrained(other)
        AutoTokenizer.from_pretrained(folder).save_pretrained(other)
        with pytest.raises(ValueError, match=message):
            convert_hf_to_nanochat.export(other, tmp_path / "refused", "base")
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("module", ["hfl3.nanochat.convert_nanochat_to_hf", "hfl3.nanochat.convert_hf_to_nanochat"])
def test_command_names_its_module(module, monkeypatch, capsys):
    # run as `python -m`, the module's `__name__` is "__main__": usage, model card and metadata name the module. In
    # process, as `python -m` runs it (runpy.run_module with alter_sys): a launch would add ~4 s of imports
    monkeypatch.setattr(sys, "argv", ["-m", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {module} ")
