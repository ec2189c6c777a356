"""Provenance that travels with every artifact (DESIGN decision 10).

The same facts go to three places: `metadata.json` beside the weights, the `__metadata__` header of the
`.safetensors` files, and the model card (`README.md`) that `push_to_hub` uploads. This module is generic: the
pretraining and the LoRA SFT recipes both use it.

- `sha256_records` / `sha256_file`: hashes of the exact training data.
- `package_versions`, `git_commit`, `git_dirty`: the software that produced the artifact.
- `build_metadata`: one JSON-safe dict from named sections, with versions, commit and time added.
- `atomic_path`: the one atomic-write helper (temporary file, then `os.replace`), used by every writer in hfl3.
- `write_json_atomic`, `add_safetensors_metadata`, `write_model_card` (a `huggingface_hub.ModelCard`): the writers
  for the three places; `stamp_folder` does all three, `provenance_header` chooses the header entries.
- `portable`: what is written holds no token and no absolute path of this machine.
- `ProvenanceMixin`: the Trainer mixin that stamps every saved folder, for both trainers (through
  `hfl3.trainers.outputs.OutputFolderMixin`).
- `push_folder_to_hub`: upload a finished folder, card included, to the Hub.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
# Keys whose values are credentials: dropped from everything written (`portable`)
SECRET_KEYS = frozenset({"hub_token", "token", "push_to_hub_token", "api_key", "password", "secret"})
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`,;:()\[\]{}<>|*]+")
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


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """`with atomic_path(path) as tmp:` write the file `tmp` (a fresh name in `path`'s folder, which is created);
    when the block ends without an exception `tmp` replaces `path` in one `os.replace`, so a reader sees the old
    file or the complete new one, never part of it (a kill leaves at most a `.NAME.*.tmp` file behind). On an
    exception `tmp` is deleted. The result gets the mode a plain `open()` would give (mkstemp's files are 0o600).
    The one atomic-write helper of hfl3: JSON, model cards, safetensors headers, plots, JSONL and data states."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp" + path.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


def _local_path_free(text: str) -> str:
    def relative(match: re.Match) -> str:
        path = match.group(0)
        top = path.split("/")[1]
        if not top or not os.path.isdir("/" + top):
            return path  # not a path of this machine (e.g. a Hub URL fragment or prose)
        try:
            inside = Path(path).resolve().relative_to(Path.cwd().resolve())
        except ValueError:
            return Path(path.rstrip("/")).name or path
        return str(inside)

    return _HF_TOKEN.sub("<redacted>", _ABSOLUTE_PATH.sub(relative, text))


def portable(obj: Any) -> Any:
    """`obj` (JSON-like: dicts, lists, strings, numbers) with nothing of this machine in it, for anything written
    into an output folder (DESIGN decision 10; issue 15 item 6):

    - keys in `SECRET_KEYS` (`hub_token`, ...) are dropped, and `hf_...` token strings become `<redacted>`;
    - absolute paths whose top folder exists here (`/home/...`, `/tmp/...`) become relative to the working
      directory when inside it (`outputs/demo`), else their last component (`pytest-3/out` → `out`), in keys,
      values and inside longer strings.
    """
    if isinstance(obj, Mapping):
        return {_local_path_free(str(k)): portable(v) for k, v in obj.items() if str(k) not in SECRET_KEYS}
    if isinstance(obj, (list, tuple)):
        return [portable(v) for v in obj]
    if isinstance(obj, str):
        return _local_path_free(obj)
    return obj


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON to `path` atomically (temporary file in the same folder, then `os.replace`), so
    readers never see a half-written file. Values that JSON cannot hold are converted as in `to_json_safe`.

    Returns:
        The path written.
    """
    path = Path(path)
    text = json.dumps(obj, indent=2, ensure_ascii=False, default=_json_default) + "\n"
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
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
        with atomic_path(file) as tmp, open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(new_header)))
            out.write(new_header)
            while chunk := f.read(1 << 24):
                out.write(chunk)
    return file


def write_model_card(
    output_dir: str | os.PathLike,
    title: str,
    metadata: Mapping[str, Any],
    extra_markdown: str = "",
    *,
    library_name: str = "transformers",
    tags: Sequence[str] = ("hfl3",),
    base_model: str | None = None,
    eval_results: Sequence[Any] = (),
    model_name: str | None = None,
) -> Path:
    """Write `output_dir/README.md` with `huggingface_hub.ModelCard`: the YAML card data (`ModelCardData`:
    `library_name`, `tags`, and `base_model` when it is a Hub repository id rather than a local path, since the Hub
    validates it), the title, `extra_markdown`, a provenance summary (every `*sha256*` value found in `metadata`, the
    package versions, the git commit) and the full `metadata` as JSON. Local paths and tokens are removed first
    (`portable`).

    Args:
        output_dir: folder of the artifact (created if missing).
        title: first-level heading.
        metadata: provenance dict, usually from `build_metadata`.
        extra_markdown: free text placed after the title (usage, results).
        library_name: `transformers` for full models, `peft` for adapters.
        tags: Hub tags.
        base_model: the model this one was fine-tuned from, if any.
        eval_results: `huggingface_hub.EvalResult`s for the card's `model-index` (e.g.
            `hfl3.evaluate.core_eval_results`); they need `model_name`.
        model_name: the model's name in the `model-index`.

    Returns:
        The path of the README written (atomically).
    """
    from huggingface_hub import ModelCard, ModelCardData

    metadata = portable(to_json_safe(dict(metadata)))
    hub_base = base_model if base_model and _HUB_REPO_ID.match(base_model) and not Path(base_model).exists() else None
    data = ModelCardData(library_name=library_name, tags=list(tags), base_model=hub_base,
                         eval_results=list(eval_results) or None, model_name=model_name)
    lines = [f"# {title}", ""]
    if extra_markdown:
        lines += [extra_markdown.strip(), ""]
    lines += ["## Provenance", "", "| what | value |", "|---|---|"]
    lines += [f"| {key} | `{value}` |" for key, value in _find_hashes(metadata)]
    lines.append(f"| git commit | `{metadata.get('git_commit')}` |")
    for package, version in metadata.get("versions", {}).items():
        lines.append(f"| {package} | {version} |")
    lines += ["", "<details><summary>metadata.json</summary>", "", "```json"]
    lines += [json.dumps(metadata, indent=2, ensure_ascii=False), "```", "", "</details>", ""]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + portable("\n".join(lines)))
    path = Path(output_dir) / "README.md"
    with atomic_path(path) as tmp:
        card.save(tmp)
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
    ignore_patterns: Sequence[str] = ("checkpoint-*", "checkpoint-*/**", "merged/**", "*.tmp", ".*", "_hfl3*"),
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


def provenance_header(metadata: Mapping[str, Any], max_section_bytes: int = 16384) -> dict[str, str]:
    """The `.safetensors` header entries: every top-level section of `metadata` as a JSON string under
    `hfl3.<section>`, except the argument sections (in `metadata.json` only); a section longer than
    `max_section_bytes` as JSON (a corpus of thousands of files) keeps only its `*sha256*` entries."""
    header = {}
    for key, value in metadata.items():
        if key in ("training_args", "script_args", "model_args"):
            continue
        text = json.dumps(value, sort_keys=True)
        if len(text) > max_section_bytes:
            text = json.dumps(dict(_find_hashes(value)), sort_keys=True)
        header[f"hfl3.{key}"] = text
    return header


def stamp_folder(folder: str | os.PathLike, metadata: Mapping[str, Any], card: Mapping[str, Any]) -> None:
    """Write `metadata.json`, add `provenance_header(metadata)` to each `*.safetensors` file of `folder` and write
    the model card (`write_model_card(folder, metadata=metadata, **card)`); all atomic, all through `portable`."""
    folder = Path(folder)
    metadata = portable(to_json_safe(dict(metadata)))
    write_json_atomic(folder / "metadata.json", metadata)
    header = provenance_header(metadata)
    for file in sorted(folder.glob("*.safetensors")):
        add_safetensors_metadata(file, header)
    write_model_card(folder, metadata=metadata, **card)


class ProvenanceMixin:
    """Trainer mixin (before `Trainer`/`SFTTrainer` in the bases): provenance on every save, for both hfl3 trainers.

    Each `_save` (the final `save_model` and every checkpoint) drops the pickled `training_args.bin` the Trainer
    writes (it would carry `hub_token`; `metadata.json` holds the arguments) and, when `self.provenance` (a
    `build_metadata` dict) is set, stamps the folder (`stamp_folder`): `metadata.json`, the safetensors header, the
    model card whose text `model_card(metadata)` returns. The Trainer's own `create_model_card` (TRL calls it into
    `output_dir` before every checkpoint) writes that card too instead of its template.
    """

    provenance: dict | None = None

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        """Keyword arguments of `write_model_card` besides the folder and metadata; subclasses describe their model."""
        return {"title": Path(self.args.output_dir).name, "tags": ("hfl3",)}

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.args.should_save:
            (Path(output_dir) / "training_args.bin").unlink(missing_ok=True)
            if self.provenance is not None:
                stamp_folder(output_dir, self.provenance, self.model_card(self.provenance))

    def create_model_card(self, *args, **kwargs):
        if self.provenance is None:
            return super().create_model_card(*args, **kwargs)
        # The card travels with the saved weights (`_save`); a card alone in output_dir would describe nothing yet
        return None
def config_sha256(config) -> str:
    """SHA-256 of a model config's canonical JSON, without the fields that name where or with what it was saved
    (`_name_or_path`, `transformers_version`)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return sha256_records([values])
