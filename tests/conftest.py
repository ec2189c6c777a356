"""Shared fixtures: real assets from ../shared/assets (override with HFL3_ASSETS), offline Hub."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS = Path(os.environ.get("HFL3_ASSETS", REPO_ROOT.parent / "shared" / "assets"))


@pytest.fixture(scope="session")
def assets() -> Path:
    """Folder of real test assets (tokenizers, chat JSONL, text); see ../shared/assets/README.md."""
    if not ASSETS.is_dir():
        pytest.fail(f"assets folder {ASSETS} not found; set HFL3_ASSETS to ../shared/assets")
    return ASSETS


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def load_recipe(name: str):
    """The module `recipes/<name>.py` (its argument classes, `make_parser`, `main`, ...)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "recipes" / f"{name}.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.fixture(scope="session")
def sft_recipe():
    return load_recipe("sft_lora")


@pytest.fixture(scope="session")
def pretrain_recipe():
    return load_recipe("pretrain")


HIDE_HFL3 = """
import sys

class HideHfl3:
    def find_spec(self, name, path=None, target=None):
        if name == "hfl3" or name.startswith("hfl3."):
            raise ImportError("hfl3 is hidden in this process")

sys.meta_path.insert(0, HideHfl3())
"""


@pytest.fixture
def run_without_hfl3(tmp_path):
    """`run(script, *args, timeout=300)`: run a Python `script` in a fresh process where `import hfl3` fails (what a
    Hub user without hfl3 has), offline, with its own remote-code module cache; returns the `CompletedProcess`."""

    def run(script: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
        path = tmp_path / "without_hfl3.py"
        path.write_text(HIDE_HFL3 + textwrap.dedent(script))
        env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_MODULES_CACHE": str(tmp_path / "modules")}
        return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=env)

    return run


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def largest_tensor():
    """`with largest_tensor() as largest: ...` records `largest.numel`, the element count of the largest tensor any
    operator produced inside the block (forward and backward), through a `TorchDispatchMode`."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class LargestTensor(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes = [leaf.numel() for leaf in tree_leaves(out) if hasattr(leaf, "numel")]
            self.numel = max([self.numel, *sizes])
            return out

    return LargestTensor
