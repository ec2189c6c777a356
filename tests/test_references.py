"""The repository stands alone: no text in it sends a reader to our issue tracker or to a file outside the clone,
and every "docs/design.md, decision N" it cites exists."""

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
