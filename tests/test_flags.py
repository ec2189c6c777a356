"""Every field of both recipes' argument classes, inherited ones included, is accounted for (`hfl3.trainers.cli.flags`):
honoured, refused in one line with exit status 2 when the arguments are checked, or not applicable; a field that acts
only with another setting is refused without it; `--hub_revision` sends the push to its branch; one regular
expression in `--lora_target_modules` is TRL's and PEFT's."""

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import constants as hub_constants
from peft import get_peft_model
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM, TrainingArguments
from transformers.utils import is_liger_kernel_available
from trl import ModelConfig, SFTConfig, get_peft_config

from hfl3.data.chat import write_chat_jsonl
from hfl3.provenance import push_folder_to_hub
from hfl3.trainers.cli import flag_checks
from hfl3.trainers.cli import flags
from hfl3.errors import InputError
from hfl3.provenance.portable import is_secret
from hfl3.trainers.cli.arguments import launch_arguments, parse_recipe_args, parsed_secrets
from hfl3.trainers.cli.exits import recipe_exits
from hfl3.trainers.outputs import OutputConfig, RunOutputs
from hfl3.trainers.sft.builder import build_sft_trainer
from recipe_setup import set_up_recipe

CONFIGS = {"pretrain": "pretrain_tiny.yaml", "sft_lora": "sft_tiny.yaml"}
TINY_QWEN3 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, assets) -> Path:
    """`model/`: a tiny Qwen3 with Qwen3's tokenizer (and chat template); `train.jsonl`: two chats."""
    folder = tmp_path_factory.mktemp("flags")
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), **TINY_QWEN3)).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    write_chat_jsonl([{"messages": [{"role": "user", "content": f"{a} + 1?"},
                                    {"role": "assistant", "content": f"{a + 1}."}]} for a in range(4)],
                     folder / "train.jsonl")
    return folder


def recipe_arguments(recipe: str, repo_root: Path, inputs: Path, output: Path, config: dict | None = None) -> list:
    """The recipe's tiny config (with `config`'s values over it, in a YAML file next to `output`), a valid model and
    data for SFT, and `--output_dir output`."""
    path = repo_root / "recipes" / "configs" / CONFIGS[recipe]
    if config:
        values = {**yaml.safe_load(path.read_text()), **config}
        path = output.parent / "config.yaml"
        path.write_text(yaml.safe_dump(values))
    model = ["--model_name_or_path", str(inputs / "model"), "--train_file", str(inputs / "train.jsonl")]
    return ["--config", str(path), *(model if recipe == "sft_lora" else []), "--output_dir", str(output)]


def parse_error(recipe_module, arguments: list, capsys) -> str:
    """The one error line the recipe's parser or its checks end with (exit status 2, after argparse's usage line)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        set_up_recipe(recipe_module, arguments)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: ")
    return error.split(": error: ", 1)[1]


@pytest.fixture(scope="module")
def recipes(sft_recipe, pretrain_recipe):
    return {"pretrain": pretrain_recipe, "sft_lora": sft_recipe}


@pytest.mark.parametrize("recipe", flags.RECIPES)
def test_every_field_of_the_installed_classes_is_in_exactly_one_list(recipes, recipe):
    classes = recipes[recipe].make_parser().dataclass_types
    fields = {field.name for cls in classes for field in dataclasses.fields(cls)}
    upstream = (TrainingArguments, SFTConfig, ModelConfig) if recipe == "sft_lora" else (TrainingArguments,)
    assert {field.name for base in upstream for field in dataclasses.fields(base)} <= fields  # inherited ones too
    tables = (flags.HONOURED[recipe], flags.REFUSED[recipe], flags.NOT_APPLICABLE[recipe])
    placed = Counter(name for table in tables for name in table)
    assert sorted(fields - set(placed)) == [], "in no list: each field must be honoured, refused or not applicable"
    assert sorted(name for name, count in placed.items() if count > 1) == [], "in two lists"
    assert sorted(set(placed) - fields) == [], "a row for a field the classes do not have"
    assert set(flags.NEEDS[recipe]) <= set(flags.HONOURED[recipe])


REFUSED_CASES = [  # (recipe, field, a value that is refused, as the one line shows it)
    ("pretrain", "num_train_epochs", 2, "2"),
    ("pretrain", "ignore_data_skip", False, "False"),
    ("pretrain", "data_seed", 3, "3"),
    ("pretrain", "train_sampling_strategy", "sequential", "sequential"),
    ("pretrain", "dataloader_in_order", False, "False"),
    ("pretrain", "auto_find_batch_size", True, "True"),
    ("pretrain", "eval_do_concat_batches", False, "False"),
    ("pretrain", "include_for_metrics", ["inputs"], "inputs"),
    ("pretrain", "batch_eval_metrics", True, "True"),
    ("pretrain", "use_liger_kernel", True, "True"),
    ("pretrain", "liger_kernel_config", {"rope": True}, '{"rope": true}'),
    ("sft_lora", "lora_task_type", "SEQ_CLS", "SEQ_CLS"),
    *[(recipe, field, value, shown) for recipe in flags.RECIPES for field, value, shown in [
        ("hub_strategy", "all_checkpoints", "all_checkpoints"), ("label_names", ["input_ids"], "input_ids"),
        ("parallelism_config", {"cp_size": 2}, '{"cp_size": 2}'), ("enable_jit_checkpoint", True, "True"),
        ("do_train", False, "False"), ("do_eval", True, "True"), ("do_predict", True, "True")]],
]
# PretrainConfig refuses it itself, as it does when built in Python
OWN_MESSAGE = {("pretrain", "auto_find_batch_size"): "auto_find_batch_size=True is not supported by the pretraining "
               "recipe; set a smaller --per_device_train_batch_size (gradient accumulation keeps --total_batch_size)"}


def test_every_refused_field_has_a_case():
    assert {(recipe, field) for recipe, field, _, _ in REFUSED_CASES} == {
        (recipe, field) for recipe in flags.RECIPES for field in flags.REFUSED[recipe]}


@pytest.mark.parametrize("recipe, field, value, shown", REFUSED_CASES, ids=[f"{c[0]}-{c[1]}" for c in REFUSED_CASES])
def test_a_refused_flag_given_ends_the_recipe_in_one_line_before_any_work(recipes, repo_root, inputs, tmp_path,
                                                                          capsys, recipe, field, value, shown):
    output = tmp_path / "out"
    arguments = recipe_arguments(recipe, repo_root, inputs, output, {field: value})
    expected = OWN_MESSAGE.get((recipe, field), f"--{field} {shown}: {flags.REFUSED[recipe][field].reason}")
    assert parse_error(recipes[recipe], arguments, capsys) == expected
    assert not output.exists()
    accepted = flags.REFUSED[recipe][field].accepted
    if accepted:  # given with what the recipe does anyway, it passes
        arguments = recipe_arguments(recipe, repo_root, inputs, output, {field: accepted[0]})
        set_up_recipe(recipes[recipe], arguments)


NEEDS_CASES = [  # (recipe, arguments refused, the one line, arguments that let them act)
    ("pretrain", ["--matrix_lr", "0.05"], "--matrix_lr 0.05: acts only with --optim muon; add it, or leave "
     "--matrix_lr out", ["--optim", "muon"]),
    ("pretrain", ["--target_flops", "1e15"], "--target_flops 1e+15: acts only with --max_steps -1 (a --max_steps "
     "sets the steps first); pass --max_steps -1, or leave --target_flops out", ["--max_steps", "-1"]),
    ("pretrain", ["--core_bundle_dir", "tests/fixtures/core_bundle"], "--core_bundle_dir tests/fixtures/core_bundle: "
     "acts only with --core_metric_every N; add it, or leave --core_bundle_dir out", ["--core_metric_every", "10"]),
    ("pretrain", ["--lr_scheduler_type", "cosine", "--warmdown_ratio", "0.3"], "--warmdown_ratio 0.3: acts only "
     "with --lr_scheduler_type warmup_stable_decay; add it, or leave --warmdown_ratio out", None),
    ("sft_lora", ["--early_stopping_threshold", "0.1", "--val_split", "0.25"], "--early_stopping_threshold 0.1: acts "
     "only with --early_stopping_patience N; add it, or leave --early_stopping_threshold out",
     ["--early_stopping_patience", "2"]),
    ("sft_lora", ["--max_new_tokens", "5"], "--max_new_tokens 5: acts only with --sample_prompts; add it, or leave "
     "--max_new_tokens out", ["--sample_prompts", "Hi?"]),
    ("sft_lora", ["--init_lr_frac", "0.5", "--use_peft", "false"], "--init_lr_frac 0.5: acts only with --optim muon; "
     "add it, or leave --init_lr_frac out", ["--optim", "muon"]),
    ("sft_lora", ["--hub_revision", "dev"], "--hub_revision dev: acts only with --push_to_hub; add it, or leave "
     "--hub_revision out", None),
    ("sft_lora", ["--router_aux_loss_coef", "0.01"], "--router_aux_loss_coef 0.01: {model} is not a "
     "Mixture-of-Experts model (its config has no output_router_logits), so there is no router loss to weigh; leave "
     "--router_aux_loss_coef out", None),
]
if not is_liger_kernel_available():
    NEEDS_CASES.append(("sft_lora", ["--use_liger_kernel", "true"], "--use_liger_kernel True: acts only with "
                        "liger-kernel, which is not installed; pip install liger-kernel, or leave --use_liger_kernel "
                        "out", None))
if not torch.accelerator.is_available():
    NEEDS_CASES.append(("sft_lora", ["--activation_offloading", "true"], "--activation_offloading True: acts only "
                        "with an accelerator to offload activations from (TRL's offloading fails without one); train "
                        "on a GPU, or leave --activation_offloading out", None))


@pytest.mark.parametrize("recipe, arguments, message, acting", NEEDS_CASES,
                         ids=[case[2].split(":")[0] for case in NEEDS_CASES])
def test_a_flag_that_needs_another_setting_is_refused_without_it(recipes, repo_root, inputs, tmp_path, capsys,
                                                                 monkeypatch, recipe, arguments, message, acting):
    monkeypatch.chdir(repo_root)
    base = recipe_arguments(recipe, repo_root, inputs, tmp_path / "out")
    expected = message.format(model=inputs / "model")
    assert parse_error(recipes[recipe], base + arguments, capsys) == expected
    if acting is not None:  # the guard: with the setting it needs, the same flag passes
        set_up_recipe(recipes[recipe], base + arguments + acting)


@pytest.mark.parametrize("name", sorted(path.name for path in (Path(__file__).parents[1] / "recipes" / "configs")
                                        .glob("*.yaml")))
def test_the_shipped_configs_give_no_flag_that_cannot_act(recipes, repo_root, name):
    recipe = "sft_lora" if name.startswith("sft") else "pretrain"
    parser = recipes[recipe].make_parser()
    arguments = ["--config", str(repo_root / "recipes" / "configs" / name), "--use_cpu"]  # bf16 configs, on a CPU
    parsed = parser.parse_args_and_config(arguments)  # parsing only: no path is checked
    flag_checks.refuse_flags(recipe, parser.given_arguments(arguments), *parsed)


class FakeApi:
    """The Hub API boundary: what each call would send."""

    calls: list = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, exist_ok))

    def create_branch(self, repo_id, *, branch, exist_ok=False):
        self.calls.append(("create_branch", repo_id, branch, exist_ok))

    def upload_folder(self, *, repo_id, folder_path, commit_message, ignore_patterns, revision=None):
        self.calls.append(("upload_folder", repo_id, revision))
        return f"https://huggingface.co/{repo_id}/commit/{revision or 'main'}"


def test_hub_revision_sends_the_push_to_its_branch_created_if_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    FakeApi.calls = []
    assert push_folder_to_hub(tmp_path, "me/model", revision="dev").endswith("/commit/dev")
    assert FakeApi.calls[1:] == [("create_repo", "me/model", None, True), ("create_branch", "me/model", "dev", True),
                                 ("upload_folder", "me/model", "dev")]
    FakeApi.calls = []
    push_folder_to_hub(tmp_path, "me/model")  # no revision: the default branch, none created
    assert FakeApi.calls[1:] == [("create_repo", "me/model", None, True), ("upload_folder", "me/model", None)]
    # the trainers' push passes --hub_revision on
    FakeApi.calls = []
    outputs = RunOutputs(OutputConfig(str(tmp_path), push_to_hub=True, hub_model_id="me/model", hub_private_repo=True,
                                      hub_token="t", hub_revision="dev"))
    trainer = SimpleNamespace(is_world_process_zero=lambda: True, hub_files=lambda folder: {})
    assert outputs.push(trainer).endswith("/commit/dev")
    assert FakeApi.calls == [("init", "t"), ("create_repo", "me/model", True, True),
                             ("create_branch", "me/model", "dev", True), ("upload_folder", "me/model", "dev")]


def test_the_output_folder_takes_the_hub_arguments_and_shows_no_token():
    args = SimpleNamespace(output_dir="out", push_to_hub=True, hub_model_id="me/model", hub_private_repo=None,
                           hub_token="hf_AbCdEfGhIjKlMnOp", hub_revision="dev", learning_rate=0.1)
    config = OutputConfig.from_args(args)
    assert (config.output_dir, config.hub_model_id, config.hub_token, config.hub_revision) == (
        "out", "me/model", "hf_AbCdEfGhIjKlMnOp", "dev")
    assert "hf_AbCdEfGhIjKlMnOp" not in repr(config)
    assert RunOutputs(config).usage_name() == "me/model"  # the card loads a pushed output by its Hub id
    assert RunOutputs(OutputConfig("out/run")).usage_name() == "out/run"


def test_push_flags_parse_with_the_end_strategy(pretrain_recipe, repo_root, inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    arguments = recipe_arguments("pretrain", repo_root, inputs, tmp_path / "out") + [
        "--push_to_hub", "--hub_model_id", "me/model", "--hub_strategy", "end", "--hub_revision", "dev"]
    _, args, _, _ = set_up_recipe(pretrain_recipe, arguments)
    assert args.hub_revision == "dev" and args.hub_strategy.value == "end"


def test_one_regular_expression_in_lora_target_modules_is_trls(sft_recipe, repo_root, inputs, tmp_path, capsys):
    base = recipe_arguments("sft_lora", repo_root, inputs, tmp_path / "out")
    pattern = r"model\.layers\.0\.self_attn\.(q|v)_proj"
    _, _, model_args, _ = set_up_recipe(sft_recipe, base + ["--lora_target_modules", pattern])
    assert model_args.lora_target_modules == pattern  # TRL's: one value is a regex, not a module name
    config = Qwen3Config(vocab_size=64, **TINY_QWEN3)
    adapted = get_peft_model(Qwen3ForCausalLM(config), get_peft_config(model_args))
    assert sorted(name for name, _ in adapted.named_modules() if name.endswith(".lora_A")) == [
        f"base_model.model.model.layers.0.self_attn.{kind}_proj.lora_A" for kind in "qv"]
    _, _, model_args, _ = set_up_recipe(sft_recipe, base + ["--lora_target_modules", "o_proj"])
    assert model_args.lora_target_modules == ["o_proj"]  # a single name stays a name (PEFT: the end of a name)
    assert parse_error(sft_recipe, base + ["--lora_target_modules", r".*layers\.9\..*"], capsys) == (
        r"--lora_target_modules .*layers\.9\..*: a regular expression matched against whole module names (one value, "
        f"as TRL takes it); matches no module of {inputs / 'model'}, whose linear layers are named down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj; or pass all-linear")
    assert parse_error(sft_recipe, base + ["--lora_target_modules", r".*\.self_attn"], capsys) == (
        r"--lora_target_modules .*\.self_attn: a regular expression matched against whole module names (one value, as "
        "TRL takes it); matches model.layers.0.self_attn, a Qwen3Attention, which LoRA cannot adapt (it adapts "
        "Linear, Embedding and Conv layers)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_padding_free_without_packing_trains_as_the_padded_rows(sft_recipe, repo_root, inputs, tmp_path):
    """`--padding_free true` alone: TRL's padding-free collation of hfl3's rows (truncated already; TRL is handed no
    max_length), which gives the padded run's loss (the same chats, positions restarting per row)."""
    losses = {}
    for padding_free in ("false", "true"):
        script, args, model, setup = set_up_recipe(sft_recipe, [
            *recipe_arguments("sft_lora", repo_root, inputs, tmp_path / padding_free), "--padding_free", padding_free,
            "--max_steps", "2", "--per_device_train_batch_size", "2", "--eval_strategy", "no"])
        trainer = build_sft_trainer(script, args, model, setup).trainer
        assert trainer.data_collator.padding_free == (padding_free == "true")  # the guard: the flag reached TRL
        losses[padding_free] = trainer.train().training_loss
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)


# ---- every optimizer setting is range-checked while the arguments are parsed ---------------------------------------

OPTIMIZER_SETTING = re.compile(r"(^|_)lr($|_)|learning_rate|weight_decay|beta\d|momentum|epsilon|_frac$|_ratio$")
"""Field names of a learning rate, weight decay, momentum coefficient, epsilon or fraction of an optimizer group."""
NOT_OPTIMIZER_SETTINGS = {  # matched by the pattern, but no number of an optimizer group
    "lr_scheduler_type": "the schedule's name",
    "lr_scheduler_kwargs": "the schedule's keyword arguments (a dict)",
    "target_param_data_ratio": "the compute-optimal dial's training tokens per parameter, not an optimizer group's",
    "aspect_ratio": "the model's width per layer (nanochat's dial), not an optimizer group's",
}


def out_of_range(bounds) -> list[float]:
    """Values just outside `bounds` on each side, and a NaN."""
    below = float(bounds.low if not bounds.low_closed else bounds.low - 0.01)
    above = [float(bounds.high if not bounds.high_closed else bounds.high + 0.01)] if math.isfinite(bounds.high) \
        else []
    return [below, *above, math.nan]


@pytest.mark.parametrize("recipe", flags.RECIPES)
def test_every_optimizer_setting_is_range_checked_in_one_line_before_any_work(recipes, repo_root, inputs, tmp_path,
                                                                             capsys, monkeypatch, recipe):
    monkeypatch.chdir(repo_root)
    classes = recipes[recipe].make_parser().dataclass_types
    settings = sorted({field.name for cls in classes for field in dataclasses.fields(cls)
                       if field.init and OPTIMIZER_SETTING.search(field.name)} - set(NOT_OPTIMIZER_SETTINGS))
    assert "matrix_lr" in settings and "adam_beta2" in settings  # the guard: the pattern finds them
    assert sorted(set(settings) - set(flag_checks.OPTIMIZER_BOUNDS)) == [], "an optimizer setting without bounds"
    base = recipe_arguments(recipe, repo_root, inputs, tmp_path / "out")
    for name in settings:
        bounds = flag_checks.OPTIMIZER_BOUNDS[name]
        for value in out_of_range(bounds):
            line = parse_error(recipes[recipe], [*base, f"--{name}", str(value)], capsys)
            assert line.startswith(f"{name}={value}: expected {bounds.expected}"), line
        assert not (tmp_path / "out").exists()


# ---- no credential in any message ------------------------------------------------------------------------------

TOKEN = "hf_" + "Zq7Xw3Vb" * 4  # shaped like a Hugging Face token
NOT_CREDENTIALS = {  # fields named like a credential that hold none
    "eos_token": "a vocabulary token's text (the masks' end of turn)",
    "pad_token": "a vocabulary token's text (TRL's collator)",
    "max_new_tokens": "a count of tokens",
    "chatcore_max_new_tokens": "a count of tokens (ChatCORE's generations)",
    "l3_sample_tokens": "a count of tokens",
    "tokenizer_train_chars": "a count of characters",
    "tokenizer_name_or_path": "a tokenizer's folder or Hub id",
    "average_tokens_across_devices": "a switch of the loss normalisation",
    "include_num_input_tokens_seen": "a switch of the token count",
    "num_key_value_heads": "the model's key-value heads",
}


@pytest.mark.parametrize("recipe", flags.RECIPES)
def test_every_field_named_like_a_credential_is_one_or_listed_as_none(recipes, recipe):
    classes = recipes[recipe].make_parser().dataclass_types
    named = {field.name for cls in classes for field in dataclasses.fields(cls)
             if re.search("token|secret|passw|key|auth|credential", field.name)}
    secret = {name for name in named if is_secret(name)}
    assert "hub_token" in secret
    assert sorted(named - secret - set(NOT_CREDENTIALS)) == []
    assert not secret & set(NOT_CREDENTIALS)


@pytest.mark.parametrize("recipe", flags.RECIPES)
def test_a_message_that_quotes_a_credential_redacts_it(recipes, repo_root, inputs, tmp_path, capsys, recipe):
    base = recipe_arguments(recipe, repo_root, inputs, tmp_path / "out")
    secret_fields = sorted({field.name for cls in recipes[recipe].make_parser().dataclass_types
                            for field in dataclasses.fields(cls) if is_secret(field.name)})
    for name in secret_fields:  # refused (each acts only with --push_to_hub): the line names the flag, not its value
        for arguments in ([*base, f"--{name}", TOKEN], recipe_arguments(recipe, repo_root, inputs, tmp_path / "out",
                                                                         {name: TOKEN})):
            capsys.readouterr()
            with pytest.raises(SystemExit):
                set_up_recipe(recipes[recipe], arguments)
            err = capsys.readouterr().err
            assert TOKEN not in err and f"--{name} <redacted>: acts only with --push_to_hub" in err
    assert TOKEN not in parse_error(recipes[recipe], [*base, "--hub_tokn", TOKEN], capsys)  # a mistyped flag
    parsed = parse_recipe_args(recipes[recipe].make_parser(), [*base, "--push_to_hub", "false"])
    parsed[1].hub_token = TOKEN
    assert TOKEN not in json.dumps(launch_arguments(parsed))  # what machines compare, and a difference shows
    assert launch_arguments(parsed)["hub_token"] != launch_arguments(parse_recipe_args(
        recipes[recipe].make_parser(), base))["hub_token"]  # still compared
    parsed[1].hub_token = "s3cr3t-of-another-hub"  # not shaped like a Hugging Face token: found by its field
    with pytest.raises(SystemExit), recipe_exits() as ending:  # a line at the end of a run
        ending.secrets = parsed_secrets(*parsed)
        raise InputError("the Hub refused the token s3cr3t-of-another-hub")
    assert capsys.readouterr().err.endswith("error: the Hub refused the token <redacted>\n")
