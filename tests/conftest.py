"""Shared fixtures: the test assets (in-repo `tests/fixtures/`, the Gemma 3 tokenizer from outside), offline Hub.

What the tests read lives in `tests/fixtures/` (small, redistributable; tests/fixtures/README.md lists each file with
its source and license), so a clone runs the suite with nothing beside it and every machine reads the same bytes.
The Gemma 3 tokenizer is under the Gemma terms and stays out of the repository: `external_assets.py` says where it
is looked for (`HFL3_ASSETS` first). Tests that use it carry the `gemma3` marker and are skipped at collection, with
one line naming what to set, where it is not found.

How the suite stays within `make test`'s 10 minutes on 2 cores (README.md, Tests), for whoever adds a test:
- Each launched process pays ~7 s of CPU importing torch, transformers and peft before it does anything: test in
  process unless the process is what is tested (an exit status, a kill, a launch's ranks), run several checks on what
  one launch left (a module- or session-scoped fixture, as the recipe runs and `tests/distributed/conftest.py`'s
  launches are), and start a one-process recipe with `sys.executable` rather than `accelerate launch` unless the
  launcher is what is tested (`test_pretrain_recipe.py` and `test_sft_recipe.py` launch through it).
- What a fixture builds is shared read-only: a test copies a folder before it changes it. Under pytest-xdist a
  session-scoped fixture runs once per worker that uses it; the tests of one module stay on one worker
  (`xdist_group`), so a module-scoped fixture runs once. Tokenizers and tiny models from configs cost well under a
  second (train_tokenizer on 60,000 characters: 0.03 s), so each module builds its own.
- A check whose long form does not fit keeps a short form in make test and marks the long one `extended` (skipped
  unless `--extended`; `make test-extended` runs only those, after make test in CI).
- One OpenMP thread per process (below). No time limit assumes a quiet machine: a test's own limit is pytest-timeout's
  (pyproject.toml), a hang guard; a process that ends by itself is waited for without a limit of its own (a hang is
  that guard's), or with one derived from a run measured in the same test; a wait for an event in a running process
  (a checkpoint to appear, a share to run out) is derived from a measured duration too (test_interrupts.py,
  test_faults.py, test_benchmarks_smoke.py). The launches of tests/distributed keep their own cut-off so that the
  launch's log says what hung.
"""

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from external_assets import find_gemma3_tokenizer, gemma3_skip_reason

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per process, here and in every process a test launches (accelerate launch keeps it, as torchrun
# sets it for each rank): the tests' matrices are tiny, `make test` runs two workers on two cores, and an OpenMP team
# whose threads wait for a core spins: a tiny pretraining run took 2.3x the CPU time with 2 threads (dev/LOG.md,
# 2026-11-28). Set before torch is imported; a value set outside is kept
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite's `datasets` caches (SFT rows are cached by content) live in a folder of their own, removed at exit; set
# before `datasets` is imported, and inherited by the recipes the tests launch
_DATASETS_CACHE = tempfile.TemporaryDirectory(prefix="hfl3-tests-datasets-")
os.environ["HF_DATASETS_CACHE"] = _DATASETS_CACHE.name

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures"


@functools.cache
def gemma3_folder() -> Path | None:
    return find_gemma3_tokenizer(os.environ.get("HFL3_ASSETS") or None)


def gemma3_missing_reason() -> str:
    return gemma3_skip_reason(os.environ.get("HFL3_ASSETS") or None)


class MissingAsset:
    """Stands in for an asset that was not found. The tests that use it are marked and skipped at collection; a test
    that reaches it without the marker fails here, naming the marker it lacks."""

    def __init__(self, marker: str, reason: str):
        self.marker, self.reason = marker, reason

    def __getattr__(self, name):
        pytest.fail(f"this test uses a missing asset but is not marked `{self.marker}`: {self.reason}", pytrace=False)


@pytest.fixture(scope="session")
def assets() -> Path:
    """`tests/fixtures/`: the in-repo assets (Qwen3 tokenizer, Tiny Shakespeare, three Gutenberg novels, GSM8K chats),
    laid out as `tokenizers/qwen3/`, `text/`, `chat/`. Never taken from elsewhere, so results do not depend on the
    machine; the Gemma 3 tokenizer, which is not here, comes from the `gemma3_tokenizer` fixture."""
    return FIXTURES


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    """The Gemma 3 tokenizer (`find_gemma3_tokenizer`), or a `MissingAsset` where it is not found (the tests that use
    it are marked `gemma3`, or carry the mark on their `pytest.param`, and are then skipped at collection)."""
    folder = gemma3_folder()
    if folder is None:
        return MissingAsset("gemma3", gemma3_missing_reason())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if "<start_of_turn>" not in (tokenizer.chat_template or ""):
        pytest.fail(f"{folder} holds no Gemma 3 chat template: point HFL3_ASSETS at a folder whose tokenizers/gemma3/ "
                    f"is the Gemma 3 tokenizer", pytrace=False)
    return tokenizer


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
    """`run(script, *args)`: run a Python `script` in a fresh process where `import hfl3` fails (what a Hub user
    without hfl3 has), offline, with its own remote-code module cache; returns the `CompletedProcess`."""

    def run(script: str, *args, timeout: float | None = None) -> subprocess.CompletedProcess:
        path = tmp_path / "without_hfl3.py"
        path.write_text(HIDE_HFL3 + textwrap.dedent(script))
        env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HF_MODULES_CACHE": str(tmp_path / "modules")}
        return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env=env)

    return run


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistGroupsCheck(), "hfl3-xdist-groups-check")
        # the groups are handed out in the order `heaviest_groups_first` gives, not by their number of tests
        # (pytest-xdist's default): a one-test module that launches four recipe runs came last and ran alone
        config.option.loadscopereorder = False
    else:  # the groups set at collection are pytest-xdist's mark, declared by it when it is loaded
        config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's scheduling group (unused here)")
    config.addinivalue_line("markers", "gemma3: uses the Gemma 3 tokenizer (not redistributable, see "
                                       "tests/conftest.py): skipped, naming what to set, where it is not found")


# Multi-process modules whose ranks meet through a file store (`equivalence.spawn_gloo_ranks`), never a TCP port, and
# use no session-scoped launch: each is a group of its own, free to run beside the launches (every launch takes a
# free rendezvous port: tests/distributed/conftest.py, `free_port`)
SPAWNED_ONLY = {"tests/test_muon_ddp.py", "tests/distributed/test_handover.py",
                "tests/distributed/test_muon_sharded_distributed.py"}


def xdist_group(item) -> str:
    """A module's tests run in one worker, so that its module-scoped fixtures (whole recipe runs) run once; the
    launched multi-process tests share one worker, so that their session-scoped launches run once and no two of them
    contend for the cores at the same time (`SPAWNED_ONLY` modules excepted)."""
    module = item.nodeid.split("::")[0]
    return "distributed" if item.get_closest_marker("distributed") and module not in SPAWNED_ONLY else module


def heaviest_groups_first(items: list) -> list:
    """`items` with the groups (`xdist_group`) ordered by their tests that launch processes or run a recipe (marked
    `slow` or `distributed`), most first, then by their number of tests; each group's tests in their order. The workers take the
    groups in this order as each finishes one, so the run ends on short in-process modules, not on a long launch that
    one worker runs while the other waits."""
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(xdist_group(item), []).append(item)

    def weight(group: list) -> tuple[int, int]:
        launching = sum(bool(item.get_closest_marker("slow") or item.get_closest_marker("distributed")) for item in group)
        return -launching, -len(group)

    return [item for group in sorted(groups.values(), key=weight) for item in group]


class XdistGroupsCheck:
    """pytest-xdist's hook, registered only where pytest-xdist is loaded (`pytest_configure`): pytest refuses a
    conftest that implements a hook no loaded plugin declares, so `pytest -p no:xdist` would stop at collection."""

    @staticmethod
    def pytest_xdist_node_collection_finished(node, ids):
        """With `--dist loadgroup`: stop, naming the cause, when the groups did not reach the node ids that
        pytest-xdist schedules by (pytest 9.2 with xdist 3.8: pytest-dev/pytest-xdist#1386), instead of a run whose
        launches contend for the cores and whose module fixtures run in both workers."""
        if node.config.getvalue("dist") == "loadgroup" and ids and "@" not in ids[0]:
            raise pytest.UsageError(
                f"pytest {pytest.__version__} with pytest-xdist --dist loadgroup ignores tests/conftest.py's groups "
                "(pytest-dev/pytest-xdist#1386): install the pins, pip install -c constraints.txt -e '.[dev]'")


# pytest-timeout's limit for a multi-process test (pyproject.toml sets 900 s for the others, the hang guard of one
# test): its fixtures may wait on two launches (tests/distributed/conftest.py: the one-process reference, then the
# launch under test), each cut off after LAUNCH_TIMEOUT_S = 900 s (one test's guard) by its own subprocess timeout, so
# that the launch's log says what hung; 300 s more for the test itself
DISTRIBUTED_TIMEOUT_S = 2 * 900 + 300


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked extended (make test-extended; make test skips them)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    import torch

    if not config.getoption("--extended"):  # make test's 10-minute budget on 2 cores: the long variants wait
        skip_extended = pytest.mark.skip(reason="extended: make test-extended runs it")
        for item in items:
            if item.get_closest_marker("extended"):
                item.add_marker(skip_extended)
    for item in items:  # pytest-xdist (`make test` runs 2 workers) schedules by these groups
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
        if item.get_closest_marker("distributed") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(DISTRIBUTED_TIMEOUT_S))
    items[:] = heaviest_groups_first(items)
    needs_gemma3 = [item for item in items if item.get_closest_marker("gemma3")]  # keywords would match param ids
    if needs_gemma3 and gemma3_folder() is None:
        skip_gemma3 = pytest.mark.skip(reason=gemma3_missing_reason())
        for item in needs_gemma3:
            item.add_marker(skip_gemma3)
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
