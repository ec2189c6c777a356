"""What every benchmark script shares: where the assets are, fresh processes for the arms of a comparison, and
paths fit to be written into a result.

Assets (tokenizers, text, chat JSONL) are looked up by their path relative to an assets folder, in this order:
`HFL3_ASSETS` (a folder you point at), the repository's own `tests/fixtures/` (a redistributable subset, the same
layout), then a `shared/assets` folder beside the checkout (the development machines' full set). The first folder
that holds the path wins, so a run on a machine with only the repository uses the fixtures.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# Set (to "1") in the section processes of gpu_suite.py --smoke: `in_fresh_process` then calls its function in the calling process. A smoke
# run measures nothing, and a spawned interpreter costs ~6 s of CPU importing torch and transformers.
SAME_PROCESS_VARIABLE = "HFL3_BENCH_SAME_PROCESS"


def asset_roots() -> list[Path]:
    """The assets folders, in lookup order (`HFL3_ASSETS` only when set and non-empty)."""
    roots = [Path(os.environ["HFL3_ASSETS"])] if os.environ.get("HFL3_ASSETS") else []
    return roots + [REPO_ROOT / "tests" / "fixtures", REPO_ROOT.parent / "shared" / "assets"]


def find_asset(relative: str) -> Path:
    """The first `root / relative` that exists among `asset_roots()` (a file or a folder, e.g. "text/gutenberg").

    Raises:
        FileNotFoundError: in none of them, with the one-line fix.
    """
    for root in asset_roots():
        if (root / relative).exists():
            return root / relative
    raise FileNotFoundError(
        f"asset {relative} not found under HFL3_ASSETS ({os.environ.get('HFL3_ASSETS') or 'unset'}), tests/fixtures "
        f"or shared/assets beside the checkout: set HFL3_ASSETS to a folder with {relative} in it"
    )


def asset_or_none(relative: str) -> Path | None:
    """`find_asset(relative)`, or None where it is missing (for defaults computed at import time)."""
    try:
        return find_asset(relative)
    except FileNotFoundError:
        return None


def asset_origin(path: Path) -> str:
    """Which assets folder `path` (from `find_asset`) is in, as it may be written into a result."""
    if os.environ.get("HFL3_ASSETS") and Path(path).is_relative_to(os.environ["HFL3_ASSETS"]):
        return "HFL3_ASSETS"
    if Path(path).is_relative_to(REPO_ROOT / "tests" / "fixtures"):
        return "tests/fixtures"
    return "shared/assets beside the checkout"


def shown_path(path: str | Path | None) -> str | None:
    """`path` as it may be written into a result: relative to the repository when inside it, else only its last two
    parts (no local absolute path leaves the machine)."""
    if path is None or str(path) == "":
        return None if path is None else ""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(REPO_ROOT):
        return str(resolved.relative_to(REPO_ROOT))
    return str(Path(*resolved.parts[1:][-2:]))


def in_fresh_process(function, *arguments, env: dict[str, str] | None = None):
    """`function(*arguments)` run in a new process (its own allocator, peak-memory counters, CUDA context and compile
    caches), its result returned; `env` is added to that process's environment (read at its start, e.g. glibc's
    `MALLOC_MMAP_THRESHOLD_`). The process is spawned (a new interpreter), never forked: a fork taken while another
    thread (OpenMP's workers, a tokenizer's pool) holds a lock leaves the child waiting on that lock forever — the CPU
    smoke run of gpu_suite.py hung so, every time, with two OpenMP threads. With `SAME_PROCESS_VARIABLE` set in the
    environment (the smoke run), `function` runs here, `env` set around the call.

    Raises:
        whatever `function` raised; `concurrent.futures.process.BrokenProcessPool` when the process died (killed,
        out of memory, a crash in native code).
    """
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        if os.environ.get(SAME_PROCESS_VARIABLE) == "1":
            return function(*arguments)
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            return pool.submit(function, *arguments).result()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
