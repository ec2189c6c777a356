"""The chat stage after pretraining: full-parameter SFT (`--use_peft false`) of any causal LM, MuonAdamW in SFT
(`--optim muon`) with the settings and optimizer state of the base's pretraining run (nanochat's chat SFT), and the
provenance chain from the corpus to the chat model."""

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.data.chat import write_chat_jsonl
from hfl3.generation import answer_prompts
from hfl3.optim import create_muon_optimizer
from hfl3.optim.state_file import load_optimizer_state, read_header, save_optimizer_state
from hfl3.provenance import read_chain
from recipe_setup import recipe_main, set_up_recipe
from hfl3.trainers.pretraining.config import PretrainConfig
from hfl3.trainers.sft import inheritance as sft_inheritance
from hfl3.trainers.sft.builder import build_sft_trainer
from hfl3.trainers.sft.inheritance import decide_from_base

PROMPT = "What is 2 + 3?"


def tiny_l3gpt(vocab_size: int, hidden_layers: int = 2) -> L3GPTForCausalLM:
    torch.manual_seed(0)
    return L3GPTForCausalLM(L3GPTConfig.from_depth(hidden_layers, vocab_size=vocab_size, aspect_ratio=32,
                                                   head_dim=32, max_position_embeddings=128, l3_after_layers=[0],
                                                   l3_k_max=8, l3_d_up=32))


def train_steps(model, optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        ids = torch.randint(model.config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_an_optimizer_state_round_trips_by_name_and_keeps_the_new_runs_settings(tmp_path):
    model = tiny_l3gpt(256)
    args = PretrainConfig(output_dir=str(tmp_path), optim="muon", report_to="none", max_steps=10)
    optimizer = create_muon_optimizer(model, args)
    train_steps(model, optimizer)
    path = save_optimizer_state(optimizer, model, tmp_path / "optimizer.safetensors")
    assert read_header(path)["optimizer"] == "MuonAdamW"
    fresh = create_muon_optimizer(model, args, matrix_lr=0.5)  # another run's settings
    fresh.param_groups.reverse()  # and another group order: the state is matched by name
    assert load_optimizer_state(fresh, model, path) == sum(len(g["params"]) for g in optimizer.param_groups)
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for key, value in optimizer.state[parameter].items():
                assert torch.equal(fresh.state[parameter][key], value), key
    matrices = next(g for g in fresh.param_groups if g["name"] == "matrix")
    assert matrices["lr"] == 0.5 and matrices["step"] == 0  # this run's LR, and its schedules start over
    with pytest.raises(ValueError, match="has shape"):  # another model's shapes
        load_optimizer_state(create_muon_optimizer(tiny_l3gpt(320), args), tiny_l3gpt(320), path)
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="holds MuonAdamW's state, and this run's optimizer is AdamW"):
        load_optimizer_state(adamw, model, path)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    short = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                           {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]}
             for a in range(6) for b in range(4)]
    return write_chat_jsonl(short, tmp_path_factory.mktemp("chats") / "train.jsonl")


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, assets):
    folder = tmp_path_factory.mktemp("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, pretrain_recipe, repo_root):
    """A tiny L3GPT pretrained by the recipe with Muon: its folder keeps the optimizer state."""
    output = tmp_path_factory.mktemp("pretrained") / "out"
    recipe_main(pretrain_recipe, [
        "--config", str(repo_root / "recipes" / "configs" / "pretrain_tiny.yaml"), "--output_dir", str(output),
        "--optim", "muon", "--max_steps", "4", "--tokenizer_train_chars", "100000", "--l3_sample_tokens", "20000",
        "--max_eval_rows", "4", "--eval_strategy", "no", "--disable_tqdm", "true", "--report_to", "none",
        "--dataloader_num_workers", "0", "--total_batch_size", "1024"])
    return output


def sft(sft_recipe, base, train, output, *extra):
    return recipe_main(sft_recipe, [
        "--config", "recipes/configs/sft_tiny.yaml", "--model_name_or_path", str(base), "--train_file", str(train),
        "--output_dir", str(output), "--use_peft", "false", "--max_steps", "3", "--sample_prompts", PROMPT,
        "--max_new_tokens", "6", *extra])[0]


@pytest.mark.slow
@pytest.mark.parametrize("base", ["l3gpt", "qwen3"])
def test_full_sft_trains_every_weight_and_writes_a_complete_model_folder(tmp_path, base, chats, qwen3_folder,
                                                                         pretrained, sft_recipe, monkeypatch,
                                                                         repo_root):
    monkeypatch.chdir(repo_root)
    folder = pretrained if base == "l3gpt" else qwen3_folder
    before = load_file(folder / "model.safetensors")
    sft(sft_recipe, folder, chats, tmp_path / "out", "--learning_rate", "1e-3")
    out = tmp_path / "out"
    assert not (out / "adapter_config.json").exists()
    after = load_file(out / "model.safetensors")
    tied = {"lm_head.weight"} if base == "qwen3" else set()
    assert set(after) == set(before) - tied
    parameters = {name for name, _ in AutoModelForCausalLM.from_pretrained(folder).named_parameters()}
    unchanged = [name for name in parameters & set(after) if torch.equal(after[name], before[name])]
    assert not unchanged, unchanged  # every weight trained (buffers, such as L3's bounds, stay)
    if base == "l3gpt":
        assert (out / "modeling_l3gpt.py").is_file()  # remote code: loads without hfl3
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    samples = json.loads((out / "samples.json").read_text())
    reloaded = answer_prompts(model, tokenizer, [PROMPT], 6)
    assert [s["answer"] for s in samples] == [s["answer"] for s in reloaded]  # the folder is the trained model
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["lora"] is None and metadata["training_args"]["learning_rate"] == 1e-3
    if base == "l3gpt":  # the provenance chain runs from the chat model back to the pretraining corpus
        chain, pretrain_metadata = read_chain(out), json.loads((folder / "metadata.json").read_text())
        assert [link["kind"] for link in chain] == ["full SFT model", "pretrained base"]
        assert chain[1]["git_commit"] == pretrain_metadata["git_commit"]
        assert chain[1]["data"]["train_tokens_sha256"] == pretrain_metadata["data"]["train_tokens_sha256"]
        assert str(tmp_path) not in json.dumps(chain) and str(folder) not in json.dumps(chain)


@pytest.mark.slow
def test_muon_sft_inherits_the_pretraining_run_and_warm_starts_its_optimizer(tmp_path, chats, pretrained,
                                                                             sft_recipe, monkeypatch, repo_root,
                                                                             caplog):
    monkeypatch.chdir(repo_root)
    pretrain_metadata = json.loads((pretrained / "metadata.json").read_text())
    script, args, model, setup = set_up_recipe(sft_recipe, [
        "--config", "recipes/configs/sft_tiny.yaml", "--model_name_or_path", str(pretrained), "--train_file",
        str(chats), "--output_dir", str(tmp_path / "out"), "--use_peft", "false", "--optim", "muon",
        "--max_steps", "2", "--matrix_lr", "0.01"])
    assert setup.optimizer_state == pretrained / "optimizer" / "optimizer.safetensors"
    # vLLM loads every top-level *.safetensors of a model folder as weights: the state must not be one of them (it was,
    # and `vllm serve` of a pretraining output failed on "KeyError: 'lm_head.weight/exp_avg'")
    assert [path.name for path in pretrained.glob("*.safetensors")] == ["model.safetensors"]
    inherited = {name: value for name, (value, _) in setup.settings.items()}
    assert "max_length" not in inherited  # given by sft_tiny.yaml
    assert "matrix_lr" not in inherited  # given on the command line
    assert inherited["embedding_lr"] == pretrain_metadata["training_args"]["embedding_lr"]
    assert inherited["batch_lr_scale"] == pretrain_metadata["compute_optimal"]["lr_scale"]
    assert "gradient_accumulation_steps" not in inherited  # the batch is the config's own (rows and length given)
    whole, _ = decide_from_base(model, args, frozenset())  # nothing given: the base run's batch as a whole
    pretrain_args = pretrain_metadata["training_args"]
    assert whole["max_length"][0] == pretrain_args["max_length"] and whole["per_device_train_batch_size"][0] == \
        pretrain_args["per_device_train_batch_size"]
    assert whole["gradient_accumulation_steps"][0] * pretrain_args["per_device_train_batch_size"] * \
        pretrain_args["max_length"] == pretrain_metadata["compute_optimal"]["total_batch_size"]
    assert "compute_optimal.total_batch_size" in whole["gradient_accumulation_steps"][1]
    with caplog.at_level(logging.INFO, logger="hfl3"):
        run = build_sft_trainer(script, args, model, setup)
    assert "embedding_lr = " in caplog.text and "training_args.embedding_lr" in caplog.text  # logged with its source
    trainer = run.trainer
    optimizer = trainer.create_optimizer()
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["matrix"]["kind"] == "muon" and groups["l3_table"]["kind"] == "adamw"
    # the warm start: every parameter's state is the pretraining run's (names as pretraining saved them)
    saved = load_file(pretrained / "optimizer" / "optimizer.safetensors")
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            for key, value in optimizer.state[parameter].items():
                assert torch.equal(value.cpu().to(saved[f"{names[id(parameter)]}/{key}"].dtype),
                                   saved[f"{names[id(parameter)]}/{key}"]), (names[id(parameter)], key)
    assert groups["matrix"]["lr"] == pytest.approx(0.01 * args.batch_lr_scale * args.init_lr_frac)


def refusal(sft_recipe, capsys, *arguments) -> str:
    """The line the SFT recipe's checks end with (exit status 2, before any work)."""
    with pytest.raises(SystemExit) as exit_info:
        set_up_recipe(sft_recipe, arguments)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_warm_start_that_cannot_act_is_one_line_and_exit_2(tmp_path, chats, qwen3_folder, pretrained, sft_recipe,
                                                             capsys, monkeypatch, repo_root):
    monkeypatch.chdir(repo_root)
    common = ["--config", "recipes/configs/sft_tiny.yaml", "--train_file", str(chats)]
    line = refusal(sft_recipe, capsys, *common, "--model_name_or_path", str(qwen3_folder), "--output_dir",
                   str(tmp_path / "a"), "--use_peft", "false", "--load_optimizer", "true")
    assert line.endswith("has no optimizer/optimizer.safetensors (recipes/pretrain.py writes one with its final "
                         "model); pass --load_optimizer false to start the optimizer fresh")
    line = refusal(sft_recipe, capsys, *common, "--model_name_or_path", str(pretrained), "--output_dir",
                   str(tmp_path / "b"), "--use_peft", "false", "--load_optimizer", "true")  # AdamW over a Muon state
    assert "holds MuonAdamW's state, and this run's optimizer is AdamW" in line
    line = refusal(sft_recipe, capsys, *common, "--model_name_or_path", str(pretrained), "--output_dir",
                   str(tmp_path / "c"), "--optim", "muon")
    assert "--optim muon with LoRA" in line
    assert not any((tmp_path / name).exists() for name in "abc")  # nothing written


def muon_sft_setup(sft_recipe, base, chats, output, *extra):
    """The SFT recipe's parsed arguments and `RunSetup` for every weight with Muon on `base`."""
    return set_up_recipe(sft_recipe, [
        "--config", "recipes/configs/sft_tiny.yaml", "--model_name_or_path", str(base), "--train_file", str(chats),
        "--output_dir", str(output), "--use_peft", "false", "--optim", "muon", "--max_steps", "2", *extra])


@pytest.mark.slow
def test_muon_sft_on_a_base_muon_did_not_pretrain_derives_fine_tuning_lrs_from_the_learning_rate(
        tmp_path, chats, qwen3_folder, sft_recipe, monkeypatch, repo_root, caplog):
    monkeypatch.chdir(repo_root)
    script, args, model, setup = muon_sft_setup(sft_recipe, qwen3_folder, chats, tmp_path / "a")
    hidden_size = 32  # qwen3_folder's width
    settings, _ = decide_from_base(model, args, frozenset())  # nothing given: a full fine-tuning's LR, TRL's 2e-5
    derived = {name: value for name, (value, _) in settings.items()}
    assert derived["learning_rate"] == 2e-5
    assert derived["matrix_lr"] == pytest.approx(0.2 * hidden_size ** 0.5 * 2e-5)  # Muon's update at AdamW's RMS
    assert [derived[name] for name in ("embedding_lr", "unembedding_lr", "scalar_lr", "smear_lr")] == [2e-5] * 4
    assert "l3_table_lr" not in derived and "value_embedding_lr" not in derived  # they follow embedding_lr
    assert "--learning_rate 2e-05" in settings["matrix_lr"][1]
    derived = {name: value for name, (value, _) in setup.settings.items()}  # sft_tiny.yaml gives --learning_rate
    learning_rate = args.learning_rate
    assert "learning_rate" not in derived and derived["embedding_lr"] == learning_rate
    assert derived["matrix_lr"] == pytest.approx(0.2 * hidden_size ** 0.5 * learning_rate)
    with caplog.at_level(logging.INFO):
        run = build_sft_trainer(script, args, model, setup)
        groups = {group["name"]: group for group in run.trainer.create_optimizer().param_groups}
    # what trained the model, in its metadata.json (python -m hfl3.provenance show prints it)
    assert run.metadata["optimizer"] == {"name": "MuonAdamW", "weight_decay": args.weight_decay,
                                         "learning_rates": {name: group["lr"] for name, group in groups.items()},
                                         "from_learning_rate": learning_rate}
    assert "matrix_lr = " in caplog.text and "GroupLearningRates.for_fine_tuning" in caplog.text  # with its source
    assert "is not used" not in caplog.text  # the LR is used: the group LRs come from it
    assert groups["matrix"]["lr"] == pytest.approx(derived["matrix_lr"] * args.init_lr_frac)
    assert groups["unembedding"]["lr"] == pytest.approx(learning_rate * (hidden_size / 768) ** -0.5 * args.init_lr_frac)
    # given values win: --learning_rate is the rule's input, a given group LR is kept
    _, _, _, setup = muon_sft_setup(sft_recipe, qwen3_folder, chats, tmp_path / "b", "--learning_rate", "1e-4",
                                    "--scalar_lr", "0.01")
    derived = {name: value for name, (value, _) in setup.settings.items()}
    assert "scalar_lr" not in derived and derived["matrix_lr"] == pytest.approx(0.2 * hidden_size ** 0.5 * 1e-4)


@pytest.mark.slow
def test_muon_sft_inherits_group_lrs_only_from_a_base_that_muon_pretrained(tmp_path, chats, pretrained, sft_recipe,
                                                                           monkeypatch, repo_root, capsys):
    monkeypatch.chdir(repo_root)
    adamw_base = tmp_path / "adamw_base"  # the same folder, as if pretrained with --optim adamw_torch
    shutil.copytree(pretrained, adamw_base, ignore=shutil.ignore_patterns("optimizer"))
    metadata = json.loads((adamw_base / "metadata.json").read_text())
    metadata["training_args"]["use_muon"] = False
    (adamw_base / "metadata.json").write_text(json.dumps(metadata))
    _, args, _, setup = muon_sft_setup(sft_recipe, adamw_base, chats, tmp_path / "a")
    hidden_size = metadata["model"]["hidden_size"]
    assert setup.settings["matrix_lr"][0] == pytest.approx(0.2 * hidden_size ** 0.5 * args.learning_rate)  # not 0.02
    assert "pretrained by recipes/pretrain.py without Muon" in setup.settings["matrix_lr"][1]
    assert "batch_lr_scale" not in setup.settings
    # a base whose config gives no hidden size: refused until the group LRs are given
    monkeypatch.setattr(sft_inheritance, "base_hidden_size", lambda *arguments: None)
    line = refusal(sft_recipe, capsys, "--config", "recipes/configs/sft_tiny.yaml", "--train_file", str(chats),
                   "--model_name_or_path", str(adamw_base), "--output_dir", str(tmp_path / "b"), "--use_peft",
                   "false", "--optim", "muon")
    assert line.endswith("its group LRs are derived from --learning_rate and its hidden_size "
                         "(GroupLearningRates.for_fine_tuning), which its config does not give; pass --matrix_lr (and "
                         "--embedding_lr, --unembedding_lr, --scalar_lr)")
    muon_sft_setup(sft_recipe, adamw_base, chats, tmp_path / "c", "--matrix_lr", "0.001")  # given: no hidden size needed
