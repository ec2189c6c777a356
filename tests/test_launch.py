"""Quiet launches: `import hfl3` prints nothing (torchao's import-time warnings are kept for the AO FP8 backend),
hfl3.fp8 works without torchao, and a bad recipe argument is one clear message, not a traceback."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from hfl3.trainers.launch import parse_recipe_args

# Root logging configured first, as a recipe does, so every logged record would be printed
LOGGING = "import logging; logging.basicConfig(level=logging.WARNING, format='%(name)s: %(message)s')\n"
HFL3_FIRST = LOGGING + textwrap.dedent("""
    import json, os, sys, types
    import hfl3
    from hfl3.fp8 import ao
    print(json.dumps([record.getMessage() for record in ao._kept_messages]))
    sys.stderr.write("--- AO backend\\n")
    os.environ.update(ACCELERATE_MIXED_PRECISION="fp8", ACCELERATE_FP8_BACKEND="AO",
                      ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER="false")
    assert ao.check_ao_backend(types.SimpleNamespace(mixed_precision="fp8", bf16=False, fp16=False))
""")
TRANSFORMERS_ALONE = LOGGING + "import transformers.modeling_utils\n"
WITHOUT_TORCHAO = textwrap.dedent("""
    import sys, types
    sys.modules["torchao"] = None  # what a machine without hfl3[fp8] has: import and find_spec both fail
    import torch
    from hfl3 import L3GPTConfig, L3GPTForCausalLM, fp8
    model = L3GPTForCausalLM(L3GPTConfig.from_depth(2, vocab_size=256, aspect_ratio=64, head_dim=64))
    assert fp8.convert_to_float8_training(model) is model
    assert isinstance(model.model.layers[1].mlp.up_proj, fp8.Float8Linear)
    assert fp8.check_ao_backend(types.SimpleNamespace(mixed_precision="no", bf16=False, fp16=False)) is None
    print("ok")
""")


def run_python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_import_hfl3_is_silent_and_keeps_torchao_messages_for_the_ao_backend():
    ours, alone = run_python(HFL3_FIRST), run_python(TRANSFORMERS_ALONE)
    assert ours.returncode == 0 and alone.returncode == 0, ours.stderr[-3000:] + alone.stderr[-3000:]
    at_import, at_ao_backend = ours.stderr.split("--- AO backend\n")
    assert at_import == ""
    kept = json.loads(ours.stdout)
    printed_by_transformers = [line for line in alone.stderr.splitlines() if line.strip()]
    # Kept exactly what importing transformers' model code prints on this machine, and logged it for the AO backend
    assert len(kept) == len(printed_by_transformers)
    assert all(any(message in line for line in printed_by_transformers) for message in kept)
    assert all(message in at_ao_backend for message in kept)
    if importlib.util.find_spec("torchao") is not None:
        assert kept, "torchao's import printed nothing here: nothing to keep, and this test tells nothing"


def test_fp8_without_torchao():
    run = run_python(WITHOUT_TORCHAO)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def load_recipe(repo_root, name: str):
    spec = importlib.util.spec_from_file_location(name, repo_root / "recipes" / f"{name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


ARGUMENT_ERRORS = [  # (recipe, arguments, what the one message says)
    ("pretrain", ["--no_such_flag"], "not used by the HfArgumentParser: ['--no_such_flag']"),
    ("pretrain", ["--learning_rate", "abc"], "argument --learning_rate/--learning-rate: invalid float value: 'abc'"),
    ("sft_lora", ["--eval_strategy", "bogus"], "bogus is not a valid IntervalStrategy"),
    ("sft_lora", ["--config", "no_such_config.yaml"], "No such file or directory: 'no_such_config.yaml'"),
    ("sft_lora", ["--config", "LIST_YAML"], "must contain a YAML mapping"),
]


@pytest.mark.parametrize("name, arguments, message", ARGUMENT_ERRORS)
def test_a_bad_argument_is_one_message(repo_root, tmp_path, capsys, monkeypatch, name, arguments, message):
    monkeypatch.chdir(repo_root)
    (tmp_path / "list.yaml").write_text("- learning_rate: 0.1\n")
    arguments = [argument.replace("LIST_YAML", str(tmp_path / "list.yaml")) for argument in arguments]
    parser = load_recipe(repo_root, name).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_args(parser, arguments)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage == f"usage: {parser.prog} [--config FILE] [options] (--help lists them)"
    assert error.startswith(f"{parser.prog}: error: ") and message in error


@pytest.mark.parametrize("name", ["pretrain", "sft_lora"])
def test_recipe_start_with_a_bad_flag_prints_only_the_message(repo_root, name):
    run = subprocess.run([sys.executable, f"recipes/{name}.py", "--no_such_flag"], capture_output=True, text=True,
                         timeout=300, cwd=repo_root)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        f"usage: {name}.py [--config FILE] [options] (--help lists them)",
        f"{name}.py: error: Some specified arguments are not used by the HfArgumentParser: ['--no_such_flag']",
    ]


@pytest.mark.parametrize("name, own_option", [("pretrain", "--dataset"), ("sft_lora", "--train_file")])
def test_help_starts_with_config_and_the_recipes_own_options(repo_root, name, own_option):
    help_lines = load_recipe(repo_root, name).make_parser().format_help().splitlines()
    first = "\n".join(help_lines[:40])
    assert "--config FILE" in first and own_option in first, first
    assert sum(line.lstrip().startswith("--config") for line in help_lines) == 1
