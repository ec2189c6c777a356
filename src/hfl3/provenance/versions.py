"""The software that produced an artifact: installed package versions and the git commit hfl3 runs from."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata as importlib_metadata
from pathlib import Path

# The packages whose versions decide what a run computes (`package_versions`).
TRACKED_PACKAGES = (
    "hfl3",
    "torch",
    "transformers",
    "accelerate",
    "datasets",
    "trl",
    "peft",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
)


def package_versions() -> dict[str, str]:
    """Installed versions of `TRACKED_PACKAGES` plus `python`; packages that are not installed are left out."""
    versions = {"python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            continue
    return versions


def _git(path: str | os.PathLike, *args: str) -> str | None:
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    try:
        # --no-optional-locks: never take index.lock (a concurrent `git commit` would fail on it)
        result = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(folder), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def git_commit(path: str | os.PathLike) -> str | None:
    """Commit hash (40 hex digits) of HEAD in the git checkout containing `path`; None outside a checkout or when
    git is not installed. Read-only (`git rev-parse HEAD`)."""
    out = _git(path, "rev-parse", "HEAD")
    return out.strip() if out else None


def git_dirty(path: str | os.PathLike) -> bool | None:
    """Whether tracked files of the checkout containing `path` differ from HEAD (`git status --porcelain
    --untracked-files=no` is non-empty); None outside a checkout. Read-only."""
    out = _git(path, "status", "--porcelain", "--untracked-files=no")
    return None if out is None else out.strip() != ""
