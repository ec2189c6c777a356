"""What every benchmark script shares: where the assets are, the model shape its flags give, fresh processes for the
arms of a comparison, and results written with paths fit to leave the machine.

Assets (tokenizers, text, chat JSONL) are looked up by their path relative to an assets folder, in this order:
`HFL3_ASSETS` (a folder you point at), the repository's own `tests/fixtures/` (a redistributable subset, the same
layout), then a `shared/assets` folder beside the checkout (the development machines' full set). The first folder
that holds the path wins, so a run on a machine with only the repository uses the fixtures.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hfl3 import L3GPTConfig

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


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A benchmarked L3GPT's shape, by the names the scripts' flags use, in `L3GPTConfig.from_depth`'s terms.

    depth: decoder layers; hidden size = `depth * aspect_ratio` rounded up to a multiple of `head_dim`.
    vocab_size: the vocabulary before the config pads it to a multiple of 64.
    seq_len: tokens per row, also the config's `max_position_embeddings` (None: a script without rows, the config's
        default 2048).
    batch_size: rows per step (None: a script that does not batch rows this way).
    """

    depth: int
    vocab_size: int
    head_dim: int = 128
    aspect_ratio: int = 64
    seq_len: int | None = None
    batch_size: int | None = None

    @classmethod
    def of(cls, args, **fields) -> "ModelShape":
        """The shape in a script's arguments `args` (the fields it has), `fields` over them."""
        names = [field.name for field in dataclasses.fields(cls) if hasattr(args, field.name)]
        return cls(**{name: getattr(args, name) for name in names} | fields)

    def fill(self, args) -> None:
        """Sets each shape field of `args` left at None (a flag not given) to this shape's value."""
        for field in dataclasses.fields(self):
            if hasattr(args, field.name) and getattr(args, field.name) is None:
                setattr(args, field.name, getattr(self, field.name))

    def config(self, **fields) -> "L3GPTConfig":
        """`L3GPTConfig.from_depth` of this shape; `fields` (window pattern, L3 layers, token ids) passed on."""
        from hfl3 import L3GPTConfig

        if self.seq_len is not None:
            fields.setdefault("max_position_embeddings", self.seq_len)
        return L3GPTConfig.from_depth(self.depth, vocab_size=self.vocab_size, aspect_ratio=self.aspect_ratio,
                                      head_dim=self.head_dim, **fields)


# A shape's fields left unset: nanochat's d12 training shape on a GPU, a model a CPU steps through in well under a
# second.
GPU_SHAPE = ModelShape(depth=12, vocab_size=32768, head_dim=128, seq_len=2048, batch_size=16)
CPU_SHAPE = ModelShape(depth=2, vocab_size=2048, head_dim=64, seq_len=128, batch_size=4)


def device_shape() -> ModelShape:
    """`GPU_SHAPE` where CUDA is available, else `CPU_SHAPE`."""
    import torch

    return GPU_SHAPE if torch.cuda.is_available() else CPU_SHAPE


def machine_name(device: str) -> str:
    """The machine a result was measured on, as results record it: the GPU's name, or the CPU's core count."""
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"


def write_result(path: str | os.PathLike | None, output: dict) -> dict:
    """Writes a benchmark's `output` to `path` as indented JSON, atomically and its folder created
    (`hfl3.atomic.write_json_atomic`), where a path was given (`--json`); returns `output`."""
    if path:
        from hfl3.atomic import write_json_atomic

        write_json_atomic(path, output)
    return output
