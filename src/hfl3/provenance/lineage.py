"""The chain from a corpus to a merged chat model: each output's `metadata.json` carries its base's provenance under
the top-level key `lineage`, so the chain survives the deletion of any folder in it (docs/design.md, decision 10).

`lineage` is a list of links, newest first: the output's base, then that base's base, and so on to a pretraining run,
a converted nanochat checkpoint, a Hub model or a model without metadata. A link is the base's `metadata.json` cut to
what identifies it (`_MAX_ITEMS`, `_MAX_TEXT`), a few kilobytes at most whatever the corpus:

- `kind`: `pretrained base`, `adapter`, `merged model`, `full SFT model`, `converted nanochat checkpoint`, `model`
  (hfl3 metadata of another shape), `Hub model` (none), `model without metadata`; `name`: the folder (`portable`) or
  the Hub id;
- `metadata_sha256`: sha256 of the base's `metadata.json` file as read; `hub_id`, `revision` (as asked) and `sha` (the
  commit it resolved to) for a Hub model or a folder of the Hugging Face cache; `gguf_file`;
- `created_at`, `git_commit`, `git_dirty`, `versions`: when and with what the base was made;
- `model`: the architecture's main fields (a pretraining run's config);
- `data`: record, token or file hashes, sources and counts; `plan` (pretraining's compute-optimal plan), `lora`,
  `optimizer` (what trained it: MuonAdamW and its group LRs, or the Trainer's optimizer and its learning rate; from
  the metadata's `optimizer`, else, for metadata written before it, from its `training_args`), `training` (the few
  other `TrainingArguments` that set the run), `results`, `base_model` (what the base's own run recorded of its
  base), `note`.

A list or dict of more than `_MAX_ITEMS` items becomes `{"count": N, "sha256": D}`, D the `sha256_records` of its
items as canonical JSON in order (a dict's as one-key objects `{key: value}`): a corpus's `files` list gives the same
D as `sha256_records(files)`, recomputable from the base's `metadata.json` while it exists. Everything is `portable`.
"""

from __future__ import annotations

import json
import logging
import os
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfl3.provenance.hashing import canonical_json, sha256_file, sha256_records
from hfl3.provenance.portable import portable
from hfl3.provenance.safetensors_header import find_hashes

logger = logging.getLogger(__name__)

METADATA_FILE = "metadata.json"
_MAX_ITEMS = 8  # a longer list or dict in a link becomes its count and sha256
_MAX_TEXT = 200  # characters of a string kept in a link
_MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings", "l3_after_layers")
_PLAN_KEYS = ("max_steps", "training_tokens", "total_batch_size", "max_length", "world_size", "target_param_data_ratio",
              "learning_rates")
_LORA_KEYS = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora",
              "modules_to_save", "bias")
_TRAINING_KEYS = ("lr_scheduler_type", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                  "gradient_accumulation_steps", "max_length", "packing", "seed")
_GROUP_LR_KEYS = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "l3_table_lr", "value_embedding_lr",
                  "smear_lr", "init_lr_frac")
_RESULT_WORDS = ("loss", "bpb", "perplexity", "accuracy", "core")  # what the model is, not speed or bookkeeping


def base_lineage(name_or_path: str, revision: str | None = None, gguf_file: str | None = None, *,
                 name: str | None = None) -> list[dict]:
    """The `lineage` of an output trained from the base `name_or_path` (what `from_pretrained` was given): the base's
    link first, then the links its own `metadata.json` carries, newest first (module docstring). Put it in the
    output's metadata as `build_metadata(..., lineage=base_lineage(...))`.

    - A local folder with `metadata.json` (an hfl3 output): its link (with `metadata_sha256`) and its `lineage`; a
      base written before `lineage` existed ends the chain with what it recorded of its own base (`base_model`).
    - A Hub id (or a folder of the Hugging Face cache, `models--OWNER--NAME/snapshots/SHA`): `hub_id`, `revision` and
      `sha`, the commit of the snapshot in the local cache that `from_pretrained` read (`try_to_load_from_cache` of
      `gguf_file` or `config.json`; works offline), else, online, `HfApi().model_info(hub_id, revision).sha`; an hfl3
      model's own `metadata.json` (from the cache, or downloaded online) continues the chain.
    - Anything else: one link of kind `model without metadata` that says so.

    Args:
        name_or_path: the base model's Hub id or local folder.
        revision: the Hub revision asked for (`--model_revision`); ignored for a local folder.
        gguf_file: the GGUF file loaded from the base, if any (recorded by name).
        name: what the link calls a local base instead of its `portable` path (e.g. the final name of a folder
            still staged).

    Returns:
        A JSON-safe list of dicts, a few kilobytes per link, with no local path and no token (`portable`).
    """
    folder = Path(name_or_path)
    if folder.is_dir():
        snapshot = _cache_snapshot(folder)
        link = {"name": name or snapshot.get("hub_id") or str(folder.resolve()), **snapshot}
        metadata_file = folder / METADATA_FILE
        if metadata_file.is_file():
            return _from_metadata_file(metadata_file, link, gguf_file)
        return portable([{**_without_metadata(folder, gguf_file), **link,
                          **({"kind": "Hub model"} if snapshot else {})}])
    hub = {"name": name_or_path, "hub_id": name_or_path, "revision": revision,
           **_hub_revision(name_or_path, revision, gguf_file)}
    metadata_file = _hub_metadata_file(name_or_path, hub.get("sha") or revision)
    if metadata_file is not None:
        return _from_metadata_file(metadata_file, hub, gguf_file)
    return portable([_drop_none({"kind": "Hub model", **hub, "gguf_file": gguf_file})])


def read_chain(folder: str | os.PathLike) -> list[dict]:
    """The chain of the output in `folder`, newest first: the folder's own link (from its `metadata.json`), then the
    links of its `lineage` (`base_lineage`); for metadata written before `lineage` existed, what it recorded of its
    base (`base_model`).

    Raises:
        FileNotFoundError: `folder` has no `metadata.json` (not an hfl3 output).
        ValueError: its `metadata.json` is not a JSON object.
    """
    metadata_file = Path(folder) / METADATA_FILE
    if not metadata_file.is_file():
        raise FileNotFoundError(f"{folder}: no {METADATA_FILE}; not an hfl3 output, so no provenance to show (give "
                                "the folder a recipe or converter wrote)")
    return _from_metadata_file(metadata_file, {"name": str(Path(folder).resolve())}, None)


def format_chain(chain: list[dict]) -> str:
    """`read_chain`'s links as text, newest first: per link a heading (number, kind, name) and a few lines (Hub
    revision, when and with which commit, data, plan, LoRA, training, results, note), wrapped at 120 columns."""
    count = f"{len(chain)} link{'s' if len(chain) != 1 else ''}"
    lines = [f"provenance of {chain[0].get('name') if chain else '?'}: {count}, newest first"]
    for number, link in enumerate(chain, 1):
        lines.append(f"{number}. {link.get('kind', 'model')}: {link.get('name')}")
        lines += _wrapped("hub", _pairs({k: link.get(k) for k in ("hub_id", "revision", "sha", "gguf_file")}))
        made = [f"created {link['created_at']}" if link.get("created_at") else "",
                f"git {link['git_commit']}" + (" (uncommitted changes)" if link.get("git_dirty") else "")
                if link.get("git_commit") else "",
                ", ".join(f"{k} {v}" for k, v in (link.get("versions") or {}).items()
                          if k in ("hfl3", "transformers", "trl", "peft"))]
        lines += _wrapped("made", "; ".join(part for part in made if part))
        lines += _wrapped("metadata.json sha256", link.get("metadata_sha256") or "")
        for section in ("model", "data", "plan", "lora", "optimizer", "training", "results", "base_model"):
            lines += _wrapped(section, _pairs(link.get(section) or {}))
        lines += _wrapped("note", link.get("note") or "")
    return "\n".join(lines)


def _wrapped(label: str, text: str) -> list[str]:
    if not text:
        return []
    return textwrap.wrap(f"{label}: {text}", width=120, initial_indent="   ", subsequent_indent="      ",
                         break_long_words=False, break_on_hyphens=False)


def _pairs(values: Mapping[str, Any], prefix: str = "") -> str:
    """`key value` pairs of a nested dict, nested keys dotted, None left out."""
    parts = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, Mapping):
            parts.append(_pairs(value, f"{prefix}{key}."))
        elif isinstance(value, float):
            parts.append(f"{prefix}{key} {value:.6g}")
        else:
            shown = ", ".join(f"({_pairs(v)})" if isinstance(v, Mapping) else str(v) for v in value) \
                if isinstance(value, list) else value
            parts.append(f"{prefix}{key} {shown}")
    return "; ".join(part for part in parts if part)


def _from_metadata_file(path: Path, link: dict, gguf_file: str | None) -> list[dict]:
    """The link of the output whose `metadata.json` is `path`, then the links it carries."""
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not JSON ({error}); restore it, or delete it to treat the folder as a model "
                         "without provenance") from error
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: holds a JSON {type(metadata).__name__}, not hfl3's metadata object; restore it, or "
                         "delete it to treat the folder as a model without provenance")
    described = _describe(metadata)
    own = {"kind": described["kind"], **link, "gguf_file": gguf_file, "metadata_sha256": sha256_file(path)}
    own.update((key, value) for key, value in described.items() if key not in own)  # where it was read from wins
    return portable([_drop_none(own), *_earlier_links(metadata)])


def _earlier_links(metadata: Mapping[str, Any]) -> list[dict]:
    """The links below an output: its `lineage`, or for metadata written before `lineage` existed a last link made of
    what it recorded of its base."""
    if isinstance(metadata.get("lineage"), list):  # bounded again: a hand-edited base could hold anything
        return [_drop_none({str(k): _bounded(v) for k, v in link.items()}) for link in metadata["lineage"]
                if isinstance(link, Mapping)]
    base = metadata.get("base_model")
    if not isinstance(base, Mapping):
        return []
    hub_id = base.get("hub_id")
    return [_drop_none({"kind": "Hub model" if hub_id else "model without metadata",
                        "name": hub_id or base.get("name_or_path"), "hub_id": hub_id,
                        "gguf_file": base.get("gguf_file"),
                        "note": "recorded by the output above, whose metadata predates lineage: the base's own "
                                "provenance was not copied"})]


def _describe(metadata: Mapping[str, Any]) -> dict:
    """The link of one hfl3 `metadata.json` (module docstring), without name and file hashes."""
    training = metadata.get("training_args") or {}
    plan = _pick(metadata.get("compute_optimal"), _PLAN_KEYS)
    link = {
        "kind": _kind(metadata),
        "hub_id": training.get("hub_model_id"),
        "created_at": metadata.get("created_at"),
        "git_commit": metadata.get("git_commit"),
        "git_dirty": metadata.get("git_dirty"),
        "versions": metadata.get("versions"),
        "model": _pick(metadata.get("model"), _MODEL_KEYS),
        "data": _data(metadata),
        "plan": plan,
        "lora": _pick(metadata.get("lora"), _LORA_KEYS),
        "optimizer": _optimizer(metadata.get("optimizer"), training),
        "training": _pick(training, tuple(key for key in _TRAINING_KEYS if key not in (plan or {}))),
        "results": {k: v for k, v in (metadata.get("results") or {}).items()
                    if isinstance(v, (int, float)) and any(word in k for word in _RESULT_WORDS)},
        "base_model": _pick(metadata.get("base_model"), ("name_or_path", "hub_id", "gguf_file", "model_type",
                                                         "config_sha256", "num_parameters")),
    }
    return _drop_none({key: _bounded(value) for key, value in link.items()})


def _optimizer(recorded: Any, training: Mapping[str, Any]) -> dict | None:
    """What trained a model: its metadata's `optimizer` section, else (written before it) what its `training_args`
    say: with `use_muon`, MuonAdamW and the group LR fields (the LRs before the batch and `init_lr_frac` scales),
    else `optim` and `learning_rate`."""
    if isinstance(recorded, Mapping):
        return dict(recorded)
    if training.get("use_muon"):
        return {"name": "MuonAdamW", **(_pick(training, _GROUP_LR_KEYS + ("weight_decay",)) or {})}
    return _pick(training, ("optim", "learning_rate", "weight_decay"))


def _kind(metadata: Mapping[str, Any]) -> str:
    if metadata.get("merged"):
        return "merged model"
    if metadata.get("lora"):
        return "adapter"
    if metadata.get("nanochat_source"):
        return "converted nanochat checkpoint"
    if metadata.get("base_model"):
        return "full SFT model"
    if metadata.get("compute_optimal") or isinstance((metadata.get("data") or {}).get("corpus"), Mapping):
        return "pretrained base"
    return "model"


def _data(metadata: Mapping[str, Any]) -> dict | None:
    """What identifies the data of a run: pretraining's corpus and token hashes, SFT's record and file hashes, a
    nanochat checkpoint's files, else every `*sha256*` value of the `data` section."""
    data = metadata.get("data")
    if isinstance(data, Mapping) and isinstance(data.get("corpus"), Mapping):
        split, packing = data.get("split") or {}, (data.get("packing") or {}).get("train") or {}
        return {"corpus": _corpus(data["corpus"]), "eval_corpus": _corpus(data.get("eval_corpus")),
                "train_tokens_sha256": data.get("train_tokens_sha256"), "split": split.get("method"),
                "documents": split.get("training_documents_read"),
                "validation_documents": split.get("validation_documents"),
                "packed_tokens": packing.get("packed_tokens")}
    if isinstance(data, Mapping) and "train_records_sha256" in data:
        return _pick(data, ("train_records_sha256", "eval_records_sha256", "files_sha256", "datasets", "train_examples",
                            "eval_examples", "val_split", "max_length"))
    source = metadata.get("nanochat_source")
    if isinstance(source, Mapping):
        files = source.get("files") or {}
        return {"files_sha256": {name: (entry or {}).get("sha256") for name, entry in files.items()},
                "step": source.get("step"), "version": source.get("version"), "val_bpb": source.get("val_bpb")}
    return dict(find_hashes(data)) if isinstance(data, Mapping) else None


def _corpus(corpus: Any) -> dict | None:
    """A pretraining corpus report (`hfl3.data.sources.Corpus.report`) as counts and one digest of its file list."""
    if not isinstance(corpus, Mapping):
        return None
    files = corpus.get("files") or []
    return {"source": corpus.get("source"), "files": len(files),
            "bytes": sum(f.get("bytes") or 0 for f in files if isinstance(f, Mapping)),
            "files_sha256": sha256_records(files) if files else None,
            "skipped_files": len(corpus.get("skipped_files") or {}),
            "duplicate_files": len(corpus.get("duplicate_files") or {}),
            "datasets": [_pick(d, ("name", "config", "split")) for d in corpus.get("datasets") or []
                         if isinstance(d, Mapping)] or None}


def _pick(section: Any, keys: tuple[str, ...]) -> dict | None:
    if not isinstance(section, Mapping):
        return None
    picked = {key: section[key] for key in keys if section.get(key) not in (None, [], {})}
    return picked or None


def _bounded(value: Any, nested: bool = False) -> Any:
    """`value` (a section of a link) with None dropped from dicts, strings cut to `_MAX_TEXT` characters and any list
    or dict inside it of more than `_MAX_ITEMS` items replaced by its count and sha256 (module docstring); the
    section's own keys, which the code chose, are kept."""
    if nested and isinstance(value, (list, tuple, Mapping)) and len(value) > _MAX_ITEMS:
        items = [{str(k): v} for k, v in value.items()] if isinstance(value, Mapping) else list(value)
        return {"count": len(items), "sha256": sha256_records(canonical_json(item) if isinstance(item, (dict, list))
                                                              else json.dumps(item) for item in items)}
    if isinstance(value, Mapping):
        return {str(k): _bounded(v, True) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_bounded(v, True) for v in value]
    if isinstance(value, str) and len(value) > _MAX_TEXT:
        return value[:_MAX_TEXT] + "…"
    return value


def _drop_none(link: dict) -> dict:
    return {key: value for key, value in link.items() if value is not None}


def _without_metadata(folder: Path, gguf_file: str | None) -> dict:
    """The link of a local model folder that hfl3 did not write: its `model_type` when `config.json` names one."""
    model_type = None
    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        pass  # no readable config.json: a GGUF folder, or not a transformers model
    return _drop_none({"kind": "model without metadata", "model_type": model_type, "gguf_file": gguf_file,
                       "note": f"no {METADATA_FILE}: its data, commit and plan were not recorded"})


def _cache_snapshot(folder: Path) -> dict:
    """`hub_id` and `sha` of a folder of the Hugging Face cache (`.../models--OWNER--NAME/snapshots/SHA`), else {}."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return {"hub_id": resolved.parent.parent.name.removeprefix("models--").replace("--", "/"),
                "sha": resolved.name}
    return {}


def _hub_revision(hub_id: str, revision: str | None, gguf_file: str | None) -> dict:
    """`{"sha": commit}` of `hub_id` at `revision`: the cached snapshot's folder name, else (online) the Hub's answer;
    `{"note": why}` when neither is available."""
    from huggingface_hub import HfApi, is_offline_mode, try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, gguf_file or "config.json", revision=revision)
    if isinstance(cached, str):
        parts = Path(cached).parts
        return {"sha": parts[parts.index("snapshots") + 1]}
    if is_offline_mode():
        return {"note": "commit not resolved: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"}
    try:
        return {"sha": HfApi().model_info(hub_id, revision=revision).sha}
    except Exception as error:  # noqa: BLE001 - any failure to reach the Hub leaves the commit unknown, and says so
        logger.warning("%s: commit not resolved (%s)", hub_id, error)
        return {"note": f"commit not resolved: {type(error).__name__}"}


def _hub_metadata_file(hub_id: str, revision: str | None) -> Path | None:
    """The hfl3 `metadata.json` of a Hub model: from the local cache, else (online) downloaded; None if it has none."""
    from huggingface_hub import hf_hub_download, is_offline_mode, try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, METADATA_FILE, revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    if cached is not None or is_offline_mode():  # known absent, or no way to ask
        return None
    try:
        return Path(hf_hub_download(hub_id, METADATA_FILE, revision=revision))
    except Exception as error:  # noqa: BLE001 - most models have no metadata.json: the chain ends at the Hub model
        logger.debug("%s: no %s (%s)", hub_id, METADATA_FILE, error)
        return None
