"""Provenance that travels with every artifact (DESIGN decision 10).

The same facts go to three places: `metadata.json` beside the weights, the `__metadata__` header of the
`.safetensors` files, and the model card (`README.md`) that `push_to_hub` uploads. This module is generic: the
pretraining and the LoRA SFT recipes both use it.

- `sha256_records` / `sha256_file`: hashes of the exact training data.
- `package_versions`, `git_commit`, `git_dirty`: the software that produced the artifact.
- `build_metadata`: one JSON-safe dict from named sections, with versions, commit and time added.
- `write_json_atomic`, `add_safetensors_metadata`, `write_model_card`: atomic writers for the three places.
- `push_folder_to_hub`: upload a finished folder, card included, to the Hub.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import hashlib
import json
import os
import platform
import re
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

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
METADATA_FORMAT_VERSION = 1
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _record_bytes(record: str | bytes | Mapping | Sequence) -> bytes:
    if isinstance(record, bytes):
        return record
    if isinstance(record, str):
        return record.encode("utf-8")
    if isinstance(record, (Mapping, list, tuple)):
        return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raise TypeError(f"cannot hash a record of type {type(record).__name__}; expected str, bytes, dict or list")


def sha256_records(records: Iterable[str | bytes | Mapping | Sequence]) -> str:
    """SHA-256 over an ordered stream of records, as a hex string.

    Each record becomes bytes (str: UTF-8; bytes: as is; dict/list: canonical JSON with sorted keys, separators
    `(",", ":")` and `ensure_ascii=False`, UTF-8) and is fed to the hash as an 8-byte little-endian length followed by
    those bytes, so record boundaries count: `["ab", "c"]` and `["a", "bc"]` hash differently, and so does a
    reordering. The empty stream hashes to the SHA-256 of nothing.

    Raises:
        TypeError: for a record of any other type.
    """
    digest = hashlib.sha256()
    for record in records:
        data = _record_bytes(record)
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes as a hex string (the value `sha256sum FILE` prints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


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


def _replace(tmp: str, path: Path) -> None:
    # mkstemp creates files readable by the owner only; give the result the mode a plain open() would have
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)
    os.replace(tmp, path)


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    # Paths, torch.dtype, devices and other values whose str() is their identity
    return str(value)


def to_json_safe(obj: Any) -> Any:
    """`obj` with dataclasses turned into dicts, enums into their values, sets into sorted lists and any other
    non-JSON value (Path, torch.dtype, ...) into its `str`; the result survives `json.dumps` unchanged."""
    return json.loads(json.dumps(obj, default=_json_default))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON to `path` atomically (temporary file in the same folder, then `os.replace`), so
    readers never see a half-written file. Values that JSON cannot hold are converted as in `to_json_safe`.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        _replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def build_metadata(**sections: Any) -> dict:
    """One JSON-safe provenance dict: the given named sections (e.g. `data=...`, `base_model=...`, `lora=...`,
    `training_args=...`) plus `format_version`, `created_at` (UTC, ISO 8601), `versions` (`package_versions()`) and
    `git_commit` / `git_dirty` (of the checkout hfl3 runs from; None for an installed wheel). A section named like one
    of the added keys replaces it."""
    source = Path(__file__).resolve().parent
    added = {
        "format_version": METADATA_FORMAT_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "git_commit": git_commit(source),
        "git_dirty": git_dirty(source),
    }
    return to_json_safe({**added, **sections})


def add_safetensors_metadata(file: str | os.PathLike, metadata: Mapping[str, str]) -> Path:
    """Merge `metadata` into the `__metadata__` header of a `.safetensors` file, keeping every tensor byte.

    The file format (https://github.com/huggingface/safetensors#format) is an 8-byte little-endian header length N,
    N bytes of JSON header, then the tensor data, whose offsets in the header are relative to the end of the header,
    so only the header is rewritten. Existing keys (e.g. `format: pt`) stay unless `metadata` sets them. The new file
    is written beside the old one and swapped in with `os.replace`. The header is padded with spaces to a multiple of
    8 bytes, as the safetensors writer does.

    Raises:
        TypeError: if a key or value of `metadata` is not a `str` (the format allows only strings).
        ValueError: if `file` is not a valid safetensors file.
    """
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"safetensors metadata must map str to str; got {key!r}: {type(value).__name__} "
                "(json.dumps non-string values first)"
            )
    file = Path(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{file}: too short to be a safetensors file")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > 100_000_000:
            raise ValueError(f"{file}: header size {header_size} is implausible; not a safetensors file")
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{file}: header is not JSON ({error}); not a safetensors file") from error
        header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
        new_header = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        new_header += b" " * (-len(new_header) % 8)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(struct.pack("<Q", len(new_header)))
                out.write(new_header)
                while chunk := f.read(1 << 24):
                    out.write(chunk)
            _replace(tmp, file)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return file


def _front_matter(library_name: str, tags: Sequence[str], base_model: str | None) -> str:
    import yaml

    data: dict[str, Any] = {"library_name": library_name, "tags": list(tags)}
    # The Hub validates base_model as a repository id; a local path would make the upload fail
    if base_model and _HUB_REPO_ID.match(base_model) and not Path(base_model).exists():
        data["base_model"] = base_model
    return "---\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True) + "---\n"


def write_model_card(
    output_dir: str | os.PathLike,
    title: str,
    metadata: Mapping[str, Any],
    extra_markdown: str = "",
    *,
    library_name: str = "transformers",
    tags: Sequence[str] = ("hfl3",),
    base_model: str | None = None,
) -> Path:
    """Write `output_dir/README.md`: YAML front matter (`library_name`, `tags`, and `base_model` when it is a Hub
    repository id rather than a local path), the title, `extra_markdown`, a provenance summary (every `*sha256*` value
    found in `metadata`, the package versions, the git commit) and the full `metadata` as JSON.

    Args:
        output_dir: folder of the artifact (created if missing).
        title: first-level heading.
        metadata: provenance dict, usually from `build_metadata`.
        extra_markdown: free text placed after the title (usage, results).
        library_name: `transformers` for full models, `peft` for adapters.
        tags: Hub tags.
        base_model: the model this one was fine-tuned from, if any.

    Returns:
        The path of the README written (atomically).
    """
    metadata = to_json_safe(dict(metadata))
    hashes = dict(_find_hashes(metadata))
    lines = [_front_matter(library_name, tags, base_model), f"# {title}", ""]
    if extra_markdown:
        lines += [extra_markdown.strip(), ""]
    lines += ["## Provenance", "", "| what | value |", "|---|---|"]
    lines += [f"| {key} | `{value}` |" for key, value in hashes.items()]
    lines.append(f"| git commit | `{metadata.get('git_commit')}` |")
    for package, version in metadata.get("versions", {}).items():
        lines.append(f"| {package} | {version} |")
    lines += ["", "<details><summary>metadata.json</summary>", "", "```json"]
    lines += [json.dumps(metadata, indent=2, ensure_ascii=False), "```", "", "</details>", ""]
    path = Path(output_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".README.md.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
        _replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _find_hashes(obj: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if "sha256" in str(key) and isinstance(value, str):
                yield name, value
            else:
                yield from _find_hashes(value, name)


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    ignore_patterns: Sequence[str] = ("checkpoint-*", "checkpoint-*/**", "merged/**", "*.tmp", ".*"),
) -> str:
    """Upload `folder` (weights or adapter, tokenizer, metadata.json and README.md) to the Hub model repository
    `repo_id` with `huggingface_hub`, creating the repository if needed; checkpoints and temporary files are left
    out. Returns the commit URL.

    Raises:
        huggingface_hub errors: offline (`HF_HUB_OFFLINE=1`), no token, or no write access to `repo_id`.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message="Upload from hfl3",
        ignore_patterns=list(ignore_patterns),
    )
    return str(commit)


def config_sha256(config) -> str:
    """SHA-256 of a model config's canonical JSON, without the fields that name where or with what it was saved
    (`_name_or_path`, `transformers_version`)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return sha256_records([values])
