"""A recipe's parser: a bad argument is one message under argparse's usage line, exit status 2 (argparse's refusals
and the argument classes' own, while parsed); `--help` starts with `--config` and the recipe's own options.

Parsing only parses: a recipe's `make_parser().parse_args_and_config(argv)` returns its three argument dataclasses,
in TRL's order (script, training, model), and nothing else; it reads no file but the `--config` one, writes none,
lists no folder, reaches no network and starts no process group. The checks of those arguments (paths, the output
folder, Hub ids, collectives) are the first thing the recipe's `main` does (`hfl3.trainers.cli.setup`), and the guard here
shows that they do touch the inputs, so a parse that ran them would fail."""

import importlib.util
import subprocess
import sys

import pytest
import torch.distributed
import yaml
from recipe_setup import set_up_recipe
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import hfl3.distributed
from hfl3.data.chat import write_chat_jsonl
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.trainers.cli.arguments import parse_recipe_args

FILE_EVENTS = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.unlink",
               "shutil.rmtree", "shutil.copyfile", "os.symlink", "os.link"}
NETWORK_EVENTS = {"socket.connect", "socket.getaddrinfo", "socket.gethostbyname"}
COLLECTIVES = ("on_all_ranks", "from_main", "check_same_on_all_ranks", "separate_disks", "checkpoint_on_this_machine")


class Recorder:
    """File and network audit events (`sys.addaudithook`, installed once per process: a hook cannot be removed),
    kept while `on`."""

    on = False
    events: list = []

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.on and (event in FILE_EVENTS or event in NETWORK_EVENTS):
            cls.events.append((event, *(str(arg) for arg in args[:2])))


if not getattr(sys, "_hfl3_test_parser_hook", False):
    sys.addaudithook(Recorder.hook)
    sys._hfl3_test_parser_hook = True


@pytest.fixture
def recorded(monkeypatch):
    """`(events, calls)`: the audit events and the calls of hfl3's collectives and of
    `torch.distributed.init_process_group` made inside the `with` block the test runs (`Recorder.on`)."""
    calls = []
    originals = {function: getattr(hfl3.distributed, function) for function in COLLECTIVES}
    for name, module in list(sys.modules.items()):
        if not name.startswith("hfl3") or module is None:
            continue
        for function, original in originals.items():
            if getattr(module, function, None) is original:
                monkeypatch.setattr(module, function, lambda *a, _f=original, _n=function, **k: (calls.append(_n),
                                                                                                 _f(*a, **k))[1])
    init = torch.distributed.init_process_group
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *a, **k: (calls.append("init_process_group"), init(*a, **k))[1])
    Recorder.events = []
    yield Recorder.events, calls
    Recorder.on = False


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, assets):
    """Real inputs of both recipes: a corpus folder, a tokenizer folder, a tiny Qwen3 model folder with its tokenizer,
    a chat file."""
    folder = tmp_path_factory.mktemp("parser_inputs")
    (folder / "corpus").mkdir()
    (folder / "corpus" / "a.txt").write_text("Some text to pretrain on.\n" * 20)
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    tokenizer.save_pretrained(folder / "tokenizer")
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)).save_pretrained(
        folder / "model")
    tokenizer.save_pretrained(folder / "model")
    write_chat_jsonl(stdlib_docstring_chats(4, seed=0), folder / "train.jsonl")
    return folder


def argv(recipe: str, inputs, tmp_path) -> list[str]:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"max_steps": 3, "report_to": "none"}))
    own = {"pretrain": ["--dataset", str(inputs / "corpus"), "--tokenizer_name_or_path", str(inputs / "tokenizer")],
           "sft_lora": ["--model_name_or_path", str(inputs / "model"), "--train_file", str(inputs / "train.jsonl"),
                        "--val_split", "0.25"]}[recipe]
    return ["--config", str(config), *own, "--output_dir", str(tmp_path / "out")]


@pytest.mark.parametrize("recipe", ["pretrain", "sft_lora"])
def test_parsing_only_parses(recipe, pretrain_recipe, sft_recipe, inputs, tmp_path, recorded):
    module = {"pretrain": pretrain_recipe, "sft_lora": sft_recipe}[recipe]
    events, calls = recorded
    arguments = argv(recipe, inputs, tmp_path)
    parser = module.make_parser()
    Recorder.on = True
    parsed = parser.parse_args_and_config(arguments)
    Recorder.on = False
    assert [type(value) for value in parsed] == list(parser.dataclass_types)
    names = [cls.__name__ for cls in parser.dataclass_types]  # TRL's order: script, training, model
    assert "Script" in names[0] and "Config" in names[1] and "Model" in names[2], names
    roots = (str(inputs), str(tmp_path))
    touched = [event for event in events if event[0] in FILE_EVENTS and event[1].startswith(roots)
               and event[1] != str(tmp_path / "config.yaml")]
    assert not touched, touched
    assert not [event for event in events if event[0] in NETWORK_EVENTS]
    assert not calls and not torch.distributed.is_initialized()
    assert not (tmp_path / "out").exists()
    # The guard: the checks `main` runs first do touch the inputs and call the collectives (one process: directly)
    Recorder.on = True
    set_up_recipe(module, arguments)
    Recorder.on = False
    opened = {event[1] for event in events if event[0] == "open" and event[1].startswith(str(inputs))}
    assert opened and {"on_all_ranks", "from_main", "separate_disks"} <= set(calls), (opened, calls)


# ---- refused while parsed --------------------------------------------------------------------------------------------

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
                         cwd=repo_root)
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


# What accelerate 1.15 sets up for each file of accelerate_configs/ launched on a machine without CUDA, with the
# recipe flags that pick the CPU setup (measured with `accelerate launch` of each file on a 2-core CPU box,
# 2026-11-24, dev/LOG.md), and on CUDA GPUs (accelerate/state.py): (config, recipe flags, what the launch asks for,
# accelerate's distributed type, world size set up, processes launched, the start of the refusal or None).


TRAINING_ARGUMENT_ERRORS = [  # (recipe, arguments, what the one message says)
    ("pretrain", ["--learning_rate", "0"], "learning_rate=0.0: expected a positive learning rate (0 trains nothing"),
    ("pretrain", ["--learning_rate", "-0.01"], "learning_rate=-0.01: expected a positive learning rate"),
    ("pretrain", ["--max_steps", "0"], "max_steps=0: expected a positive number of optimizer steps, or -1"),
    ("sft_lora", ["--learning_rate", "0"], "learning_rate=0.0: expected a positive learning rate"),
    ("sft_lora", ["--learning_rate", "-0.01"], "learning_rate=-0.01: expected a positive learning rate"),
    ("sft_lora", ["--max_steps", "0"], "max_steps=0: expected a positive number of optimizer steps"),
    ("sft_lora", ["--max_steps", "-5"], "max_steps=-5: expected a positive number of optimizer steps"),
    ("sft_lora", ["--num_train_epochs", "0"], "num_train_epochs=0.0 with max_steps=-1 trains nothing"),
]


@pytest.mark.parametrize("name, arguments, message", TRAINING_ARGUMENT_ERRORS)
def test_a_bad_training_argument_is_refused_while_parsing(repo_root, capsys, monkeypatch, name, arguments, message):
    monkeypatch.chdir(repo_root)
    config = ["--config", f"recipes/configs/{'pretrain_tiny' if name == 'pretrain' else 'sft_tiny'}.yaml"]
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_args(load_recipe(repo_root, name).make_parser(), config + arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
