"""The repository stands alone: no text in it sends a reader to our issue tracker or to a file outside the clone,
every "docs/design.md, decision N" it cites exists, and every dotted `hfl3.x.y` it names imports."""

import importlib
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCOPE = ["src", "recipes", "benchmarks", "tests", "accelerate_configs", "Makefile", "README.md", "pyproject.toml"]
FORBIDDEN = re.compile(r"\b[Ii]ssues? ?\d|\bissue-\d|\.\./shared|\bDESIGN(\.md)?\b|/work/")
CITATION = re.compile(r"docs/design\.md, decision (\d+)")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files", "--", *SCOPE], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in names:
        path = REPO / name
        if name.startswith(("tests/fixtures/chat/", "tests/fixtures/text/", "tests/fixtures/tokenizers/")):
            continue  # third-party data, not our prose
        try:
            yield name, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (plots)


def test_no_issue_numbers_or_outside_paths():
    hits = [f"{name}:{number}: {line.strip()[:100]}" for name, text in tracked_text_files()
            for number, line in enumerate(text.splitlines(), 1)
            if FORBIDDEN.search(line) and name != "tests/test_references.py"]
    assert not hits, "say the reason or cite docs/design.md instead:\n" + "\n".join(hits)


def test_cited_decisions_exist():
    decisions = set(re.findall(r"^### (\d+)\. ", (REPO / "docs" / "design.md").read_text(), re.MULTILINE))
    missing = [f"{name}: decision {n}" for name, text in tracked_text_files() for n in CITATION.findall(text)
               if n not in decisions]
    assert not missing, "cited decisions missing from docs/design.md: " + ", ".join(missing)


DOTTED = re.compile(r"(?<![\w./-])hfl3(?:\.[A-Za-z_]\w*)+")
NOT_MODULES = re.compile(r"getLogger\([\"']$")  # a logger's name, written before the dotted name
HEADER_KEYS = {"hfl3.lineage", "hfl3.sha256", "hfl3.versions", "hfl3.nanochat_source"}
"""Safetensors header keys (`hfl3.provenance.safetensors_header` writes `hfl3.<key>`): data, not module paths."""


def resolves(name: str) -> bool:
    """`name` is an importable module, or an attribute (chain) of the longest importable module it starts with."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[end:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def cited_hfl3_names() -> dict[str, str]:
    """`{dotted hfl3 name: the first file naming it}` over the tracked text (docs and integrations included; not the
    history in dev/LOG.md and benchmarks/results)."""
    names = subprocess.run(["git", "ls-files", "--", *SCOPE, "docs", "integrations", "dev"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    found: dict[str, str] = {}
    for name in names:
        if name in ("dev/LOG.md", "tests/test_references.py") or name.startswith(("benchmarks/results/",
                                                                                   "tests/fixtures/")):
            continue
        try:
            text = (REPO / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for match in DOTTED.finditer(text):
            if not NOT_MODULES.search(text[max(0, match.start() - 12):match.start()]):
                found.setdefault(match.group(0), name)
    return found


def test_cited_hfl3_paths_resolve():
    cited = cited_hfl3_names()
    assert len(cited) > 100 and "hfl3.data.chat" in cited  # the scan read the repository
    stale = [f"{name} ({where})" for name, where in sorted(cited.items())
             if name not in HEADER_KEYS and not resolves(name)]
    assert not stale, "names of hfl3 that do not import (rename them where cited):\n" + "\n".join(stale)
    assert not resolves("hfl3.trainers.no_such_module") and not resolves("hfl3.data.chat.no_such_name")
