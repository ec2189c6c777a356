"""The provenance dict of an artifact (`build_metadata`) and the three places it is written (`stamp_folder`):
`metadata.json`, the `.safetensors` headers and the model card."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfl3.atomic import to_json_safe, write_json_atomic
from hfl3.provenance.card import write_model_card
from hfl3.provenance.portable import portable
from hfl3.provenance.safetensors_header import add_safetensors_metadata, provenance_header
from hfl3.provenance.versions import git_commit, git_dirty, package_versions

METADATA_FORMAT_VERSION = 1


def build_metadata(**sections: Any) -> dict:
    """One JSON-safe provenance dict: the given named sections (e.g. `data=...`, `base_model=...`, `lora=...`,
    `training_args=...`, `lineage=base_lineage(...)` for an output trained from a base) plus `format_version`,
    `created_at` (UTC, ISO 8601), `versions` (`package_versions()`) and `git_commit` / `git_dirty` (of the checkout
    hfl3 runs from; None for an installed wheel). A section named like one of the added keys replaces it."""
    source = Path(__file__).resolve().parent
    added = {
        "format_version": METADATA_FORMAT_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "git_commit": git_commit(source),
        "git_dirty": git_dirty(source),
    }
    return to_json_safe({**added, **sections})


def stamp_folder(folder: str | os.PathLike, metadata: Mapping[str, Any], card: Mapping[str, Any]) -> None:
    """Write `metadata.json`, add `provenance_header(metadata)` to each `*.safetensors` file of `folder` (in place:
    call it on a folder not yet published, as hfl3's staged checkpoints and output folders are) and write the model
    card (`write_model_card(folder, metadata=metadata, **card)`); all through `portable`."""
    folder = Path(folder)
    metadata = portable(to_json_safe(dict(metadata)))
    write_json_atomic(folder / "metadata.json", metadata)
    header = provenance_header(metadata)
    for file in sorted(folder.glob("*.safetensors")):
        add_safetensors_metadata(file, header)
    write_model_card(folder, metadata=metadata, **card)
