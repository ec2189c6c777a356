"""The model card (`README.md`): `huggingface_hub.ModelCard.from_template` with `ModelCardData` for the YAML front
matter and hfl3's Jinja template `model_card_template.md` for the text (title, usage, provenance table, the full
metadata)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hfl3.atomic import atomic_path, to_json_safe
from hfl3.provenance.portable import portable
from hfl3.provenance.safetensors_header import find_hashes

TEMPLATE = Path(__file__).with_name("model_card_template.md")
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def write_model_card(
    output_dir: str | os.PathLike,
    title: str,
    metadata: Mapping[str, Any],
    extra_markdown: str = "",
    *,
    library_name: str = "transformers",
    tags: Sequence[str] = ("hfl3",),
    base_model: str | None = None,
    **card_data: Any,
) -> Path:
    """Write `output_dir/README.md`: `ModelCard.from_template` with hfl3's template. The YAML front matter is a
    `ModelCardData` of `library_name`, `tags`, `base_model` when it is a Hub repository id rather than a local path
    (the Hub validates it) and any other `ModelCardData` field given in `card_data` (e.g. `eval_results` with
    `model_name`, which the Hub shows as `model-index`); the text holds the title, `extra_markdown`, a provenance
    table (every `*sha256*` value found in `metadata`, the git commit, the package versions) and the full `metadata`
    as JSON. Local paths and tokens are removed first (`portable`).

    Args:
        output_dir: folder of the artifact (created if missing).
        title: first-level heading.
        metadata: provenance dict, usually from `build_metadata`.
        extra_markdown: free text placed after the title (usage, results).
        library_name: `transformers` for full models, `peft` for adapters.
        tags: Hub tags.
        base_model: the model this one was fine-tuned from, if any.
        **card_data: further `huggingface_hub.ModelCardData` fields.

    Returns:
        The path of the README written (atomically).
    """
    from huggingface_hub import ModelCard, ModelCardData

    metadata = portable(to_json_safe(dict(metadata)))
    hub_base = base_model if base_model and _HUB_REPO_ID.match(base_model) and not Path(base_model).exists() else None
    data = ModelCardData(library_name=library_name, tags=list(tags), base_model=hub_base, **card_data)
    card = ModelCard.from_template(
        data, template_path=str(TEMPLATE), title=portable(title), summary=portable(extra_markdown.strip()),
        hashes=list(find_hashes(metadata)), git_commit=metadata.get("git_commit"),
        versions=metadata.get("versions", {}), metadata_json=json.dumps(metadata, indent=2, ensure_ascii=False),
    )
    path = Path(output_dir) / "README.md"
    with atomic_path(path) as tmp:
        card.save(tmp)
    return path
