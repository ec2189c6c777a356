"""The plugin as vLLM finds it, what it depends on, and the configs it refuses (one line naming the field)."""

import importlib.metadata
import json
import shutil
import subprocess
import sys

import pytest
from conftest import ENGINE, engine

REFUSED = [  # (case id, config.json changes, text the one-line refusal must contain)
    ("rope-type", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters="),
    ("partial-rotary", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rope_parameters['partial_rotary_factor']=0.5"),
    ("window-letter", {"window_pattern": "SX"}, "window_pattern='SX'"),
    ("kv-heads", {"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ("value-embedding-layer", {"value_embedding_layers": [9]}, "value_embedding_layers contains 9"),
    ("l3-mix-input", {"l3_mix_input": "both"}, "l3_mix_input='both'"),
    ("smear-channels", {"smear_gate_channels": 0}, "smear_gate_channels=0"),
]


@pytest.mark.timeout(120)
def test_vllm_finds_the_plugin_and_registers_both_classes():
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "l3gpt"]
    assert entry_point.value == "hfl3_vllm:register"
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert {"L3GPTForCausalLM", "L3GPTSmearForCausalLM"} <= set(ModelRegistry.get_supported_archs())
    from hfl3_vllm.config import L3GPTConfig

    assert AutoConfig.for_model("l3gpt").__class__ is L3GPTConfig


@pytest.mark.timeout(120)
def test_the_plugin_needs_neither_hfl3_nor_remote_code():
    script = ("import sys, hfl3_vllm.model, hfl3_vllm.config\n"
              "assert not [name for name in sys.modules if name == 'hfl3' or name.startswith('hfl3.')]\n"
              "import importlib.util; assert importlib.util.find_spec('hfl3') is None\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ENGINE.get("trust_remote_code") is None  # every engine of these tests runs without remote code


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change, expected", [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_unservable_configs_are_refused_in_one_line_naming_the_field(references, change, expected):
    from hfl3_vllm.config import L3GPTConfig, UnservableConfigError

    config = json.loads((references("generation") / "dense" / "config.json").read_text())
    with pytest.raises(UnservableConfigError) as refused:
        L3GPTConfig.from_dict({**config, **change})
    message = str(refused.value)
    assert expected in message and "\n" not in message, message


@pytest.mark.timeout(180)
def test_the_refusal_reaches_the_vllm_user(references, tmp_path):
    folder = tmp_path / "unservable"
    shutil.copytree(references("generation") / "legacy", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "l3_mix_input": "both"}))
    with pytest.raises(Exception, match="l3_mix_input='both' must be 'normed' or 'residual'"):
        with engine(folder):
            pass
