"""docs/design.md cites only what exists: every file it names or links is in the clone, every hfl3 name it puts in
backticks occurs in the repository's Python files, and every test it cites is defined in a test folder. A design
document that names code that is gone misleads more than none (docs/design.md says the code wins; this keeps it so)."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DESIGN_DOC = REPO / "docs" / "design.md"
TEST_FOLDERS = ("tests/", "integrations/vllm/tests/")
TOP_LEVEL = ("src/", "tests/", "benchmarks/", "recipes/", "integrations/", "dev/", "docs/", "accelerate_configs/",
             ".ci/")

# Names the document cites from the libraries hfl3 builds on (transformers, torch, TRL, PEFT, accelerate, DeepSpeed,
# datasets, huggingface_hub, vLLM) or from nanochat, which hfl3's own code never spells out. Each is checked to be
# cited, so the list cannot outlive the text.
EXTERNAL = {
    "nanochat/gpt.py", "base_train.py", "scripts/chat_sft.py",  # karpathy/nanochat's files
    "trl/scripts/sft.py", "CheckpointManager",  # TRL's SFT script, torchtitan's checkpointing component
    "ChildFailedError", "HFValidationError", "AutoPeftModelForCausalLM", "ModelCardData", "IterableDatasetShard",
    "OptimizerNames", "ShortConv", "MambaBase", "SHORT_CONV", "ReLUSquaredActivation",
    "StaticCache", "DynamicLayer", "LinearAttentionLayer", "LogitsProcessor", "main_process_first", "all_to_all",
    "deepspeed_shm_comm",
}

SPAN = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\((\.\./[^)#\s]+)\)")
CAMEL = re.compile(r"_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*[A-Z][A-Za-z0-9]*|_?[A-Z][a-z0-9]+[A-Z0-9]\w*")
CONSTANT = re.compile(r"_?[A-Z][A-Z0-9]*(_[A-Z0-9]+)+")
SNAKE = re.compile(r"_?[a-z][a-z0-9]*(_[a-z0-9]+)+")
CODE_NAME = re.compile(r"[A-Za-z_][\w.]*(\(.*\))?")


def tracked_files() -> list[str]:
    """The clone's files, committed or not (but not ignored)."""
    return subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout.split()


def python_text() -> str:
    return "\n".join((REPO / name).read_text(encoding="utf-8") for name in tracked_files()
                     if name.endswith(".py") and name != "tests/test_design_doc.py" and (REPO / name).exists())


def cited(text: str) -> tuple[set[str], set[str], set[str], set[str]]:
    """The document's citations: (repository paths, bare file names, code names, test names)."""
    paths, file_names, names, tests = set(), set(), set(), set()
    for span in (" ".join(span.split()) for span in SPAN.findall(text)):
        if span.startswith(TOP_LEVEL) and re.fullmatch(r"[\w./*+-]+", span):
            paths.add(span.rstrip("/"))
        elif re.fullmatch(r"[\w/*-]+\.(py|yaml)", span):
            file_names.add(span)
        elif CODE_NAME.fullmatch(span):
            for name in span.split("(")[0].split("."):
                if name.startswith("test_"):
                    tests.add(name)
                elif any(pattern.fullmatch(name) for pattern in (CAMEL, CONSTANT, SNAKE)):
                    names.add(name)
    paths.update(str((DESIGN_DOC.parent / link).resolve().relative_to(REPO)) for link in LINK.findall(text))
    return paths, file_names, names, tests


def missing_citations(text: str) -> list[str]:
    files, code_words = tracked_files(), set(re.findall(r"\w+", python_text()))
    paths, file_names, names, tests = cited(text)
    defined_tests = set(re.findall(r"^\s*def (test_\w+)", "\n".join(
        (REPO / name).read_text(encoding="utf-8") for name in files
        if name.startswith(TEST_FOLDERS) and name.endswith(".py") and (REPO / name).exists()), re.MULTILINE))
    missing = [f"file {path}" for path in sorted(paths)
               if path not in EXTERNAL and not (list(REPO.glob(path)) if "*" in path else (REPO / path).exists())]
    missing += [f"file {name}" for name in sorted(file_names) if name not in EXTERNAL
                and not any(Path(file).match(name) for file in files)]
    missing += [f"name {name}" for name in sorted(names)
                if name not in EXTERNAL and name not in code_words]
    missing += [f"test {name}" for name in sorted(tests) if name not in defined_tests]
    return missing


def test_every_citation_in_the_design_document_exists():
    missing = missing_citations(DESIGN_DOC.read_text(encoding="utf-8"))
    assert not missing, "docs/design.md cites what the repository lacks (rewrite the passage):\n" + "\n".join(missing)


def test_external_names_are_still_cited():
    paths, file_names, names, _ = cited(DESIGN_DOC.read_text(encoding="utf-8"))
    stale = EXTERNAL - paths - file_names - names
    assert not stale, f"EXTERNAL lists names docs/design.md no longer cites: {sorted(stale)}"


def test_the_check_tells_a_missing_name_apart():
    text = ("`L3GPTConfig`, `_NoSuchScores`, `no_such_function(x)`, `src/hfl3/no_such.py`, `no_such.yaml`, "
            "`test_no_such_thing`, [x](../benchmarks/no_such.py)")
    assert missing_citations(text) == ["file benchmarks/no_such.py", "file src/hfl3/no_such.py",
                                       "file no_such.yaml", "name _NoSuchScores", "name no_such_function",
                                       "test test_no_such_thing"]
