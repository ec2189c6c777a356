"""transformers' own common model tests, for the installed transformers version, from its sdist on PyPI.

`common_tests()` returns the modules `test_modeling_common` and `test_configuration_common` of the
`transformers==<installed version>` sdist (Apache-2.0, copyright The HuggingFace Team; `tests/` of the sdist), which it
downloads once with pip (`pip download --no-deps --no-binary :all:`) into the git-ignored `build/transformers-tests/`
and imports from there.

Downloaded rather than vendored: the tests then always match the installed transformers, whose private helpers they
call and which move between releases (a vendored copy breaks on the next upgrade, or worse, passes against APIs that
are gone), and the repository keeps none of their 7,000 lines. The cost is one download (10 MB) on a fresh checkout;
without PyPI (an offline GPU box) the tests are skipped with the reason shown, or put `transformers-<version>.tar.gz`
into `build/transformers-tests/` by hand.

The sdist ships `tests/*.py` but not the three helper modules these two files import; `install_stand_ins` puts
stand-ins into `sys.modules` before the import:
- `exporters.test_export.ExportTesterMixin`: an empty mixin (transformers' `torch.export` tests are not shipped);
- `generation.test_utils.GenerationTesterMixin`: an empty marker class; the L3GPT generation tests subclass it, so
  `test_generation_tester_mixin_inheritance` sees a generative model tested for generation;
- `utils.test_configuration_utils.config_common_kwargs`: non-default values of `PreTrainedConfig`'s own fields, which
  `ConfigTester.check_config_arguments_init` passes to the config and expects back.
"""

import importlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import transformers
from filelock import FileLock  # transformers' and huggingface_hub's own dependency

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE = REPO_ROOT / "build" / "transformers-tests"
PACKAGE = "transformers_common_tests"
SHIPPED = ("test_modeling_common.py", "test_configuration_common.py")


class SdistUnavailable(RuntimeError):
    """The sdist is neither cached nor downloadable."""


class ExportTesterMixin:
    """Stand-in for transformers' `tests/exporters/test_export.py` mixin (not in the sdist): no export tests."""


class GenerationTesterMixin:
    """Stand-in for transformers' `tests/generation/test_utils.py` mixin (not in the sdist): subclass it with the
    generation tests of the model under test."""


CONFIG_COMMON_KWARGS = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["L3GPTForCausalLM"],
    "id2label": {0: "label_0", 1: "label_1", 2: "label_2"},
    "problem_type": "multi_label_classification",
}


def sdist(version: str) -> Path:
    """Path of `transformers-<version>.tar.gz` in the cache, downloaded from PyPI with pip if absent.

    Raises:
        SdistUnavailable: if pip cannot download it (no PyPI), with the command to run or the file to place.
    """
    path = CACHE / f"transformers-{version}.tar.gz"
    if path.exists():
        return path
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"transformers=={version}", "--dest", str(CACHE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode or not path.exists():
        raise SdistUnavailable(
            f"could not download transformers=={version}'s sdist for its common model tests ({' '.join(command[2:])}"
            f" exited {result.returncode}: {result.stderr.strip()[-300:]}); with PyPI reachable run it again, or "
            f"put transformers-{version}.tar.gz into {CACHE.relative_to(REPO_ROOT)}/"
        )
    return path


def extracted_tests(version: str) -> Path:
    """Folder holding the package `PACKAGE` with the sdist's `SHIPPED` files, downloaded and extracted once, by one
    process at a time: `make test`'s pytest-xdist workers collect at the same time, and in a fresh clone one of them
    once imported the package while the other replaced it (ModuleNotFoundError at collection)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(CACHE / ".lock", timeout=900):  # a download takes seconds; 900 s: pip's 600 s limit, with margin
        return _extracted_tests(version)


def _extracted_tests(version: str) -> Path:
    root = CACHE / version
    if all((root / PACKAGE / name).exists() for name in SHIPPED):
        return root
    with tarfile.open(sdist(version)) as archive, tempfile.TemporaryDirectory(dir=CACHE) as staging:
        package = Path(staging) / PACKAGE
        package.mkdir()
        for name in SHIPPED:
            member = archive.extractfile(f"transformers-{version}/tests/{name}")
            (package / name).write_bytes(member.read())
        (package / "__init__.py").write_text("")
        root.mkdir(exist_ok=True)
        shutil.rmtree(root / PACKAGE, ignore_errors=True)  # an incomplete earlier extraction
        package.rename(root / PACKAGE)
    return root


def install_stand_ins() -> None:
    """Register the helper modules the sdist lacks (see the module docstring) under `PACKAGE`."""
    for name, attributes in (
        ("exporters.test_export", {"ExportTesterMixin": ExportTesterMixin}),
        ("generation.test_utils", {"GenerationTesterMixin": GenerationTesterMixin}),
        ("utils.test_configuration_utils", {"config_common_kwargs": CONFIG_COMMON_KWARGS}),
    ):
        parent_name = f"{PACKAGE}.{name.split('.')[0]}"
        sys.modules.setdefault(parent_name, types.ModuleType(parent_name))
        module = types.ModuleType(f"{PACKAGE}.{name}")
        module.__dict__.update(attributes)
        sys.modules[module.__name__] = module


def common_tests() -> tuple[types.ModuleType, types.ModuleType]:
    """transformers' `(test_modeling_common, test_configuration_common)` for the installed version.

    Raises:
        SdistUnavailable: if the sdist is not cached and cannot be downloaded.
    """
    root = extracted_tests(transformers.__version__)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    install_stand_ins()
    modeling = importlib.import_module(f"{PACKAGE}.test_modeling_common")
    configuration = importlib.import_module(f"{PACKAGE}.test_configuration_common")
    return modeling, configuration
