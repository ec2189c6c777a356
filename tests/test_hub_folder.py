"""The model's folder (`src/hfl3/models/l3gpt/`) is what a Hub repository's remote code needs and nothing more: it
imports nothing of hfl3 outside itself, and `save_pretrained` ships none of the developer-side tools (the nanochat
converters live in `hfl3/nanochat/`). That a saved folder loads with `trust_remote_code=True` where hfl3 is not
installed: `tests/test_l3gpt.py::test_remote_code_loads_without_hfl3`."""

import ast
from pathlib import Path

import hfl3
from hfl3 import L3GPTConfig, L3GPTForCausalLM

PACKAGE = Path(hfl3.__file__).parent
MODEL_FOLDER = PACKAGE / "models" / "l3gpt"
MODEL_PACKAGE = "hfl3.models.l3gpt"


def outside_imports(source: str, filename: str) -> list[str]:
    """`filename:line: module` for each import in `source` (a module of `hfl3.models.l3gpt`) of hfl3 outside that
    package: absolute `hfl3` imports elsewhere, and relative imports that climb out of the folder."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.ImportFrom):
            modules = [] if node.level == 1 else ["." * node.level + (node.module or "")]
        else:
            continue
        for module in modules:
            if module.startswith(".") or (module.split(".")[0] == "hfl3" and not (
                    module == MODEL_PACKAGE or module.startswith(MODEL_PACKAGE + "."))):
                found.append(f"{filename}:{node.lineno}: {module}")
    return found


def test_model_folder_imports_nothing_of_hfl3_outside_itself():
    files = sorted(MODEL_FOLDER.glob("*.py"))
    assert {"modeling_l3gpt.py", "configuration_l3gpt.py", "lookup.py", "offload.py"} <= {f.name for f in files}
    found = [line for f in files for line in outside_imports(f.read_text(), f.name)]
    assert not found, "models/l3gpt/ ships as Hub remote code; move these imports out:\n" + "\n".join(found)
    # the guard: the check tells such imports apart, in code as the converters write it and in synthetic lines
    converters = [line for f in sorted((PACKAGE / "nanochat").glob("*.py")) for line in
                  outside_imports(f.read_text(), f.name)]
    assert any(line.endswith(": hfl3.provenance") for line in converters), converters
    assert outside_imports("from ..callbacks import x\nimport hfl3.atomic\nfrom hfl3 import fp8\n", "x.py") == [
        "x.py:1: ..callbacks", "x.py:2: hfl3.atomic", "x.py:3: hfl3"]
    assert outside_imports("from .lookup import x\nfrom hfl3.models.l3gpt.layers import y\n", "x.py") == []


def test_saved_folder_ships_model_files_only(tmp_path):
    config = L3GPTConfig.from_depth(2, vocab_size=64, aspect_ratio=32, head_dim=16, max_position_embeddings=32,
                                    l3_after_layers=[0], l3_n_emb=128, l3_k_max=4, l3_d_up=32)
    L3GPTForCausalLM(config).save_pretrained(tmp_path)
    shipped = {path.name for path in tmp_path.glob("*.py")}
    assert {"modeling_l3gpt.py", "configuration_l3gpt.py", "lookup.py", "offload.py"} <= shipped
    assert shipped <= {path.name for path in MODEL_FOLDER.glob("*.py")}, shipped
    assert not any(name.startswith("convert_") for name in shipped), shipped
