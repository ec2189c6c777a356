"""Provenance that travels with every artifact (docs/design.md, decision 10).

The same facts go to three places: `metadata.json` beside the weights, the `__metadata__` header of the
`.safetensors` files, and the model card (`README.md`) that a push uploads. Both recipes, the nanochat converters and
the trainers' output folders (`hfl3.trainers.outputs`) use it. One module per concern:

- `hashing`: `sha256_records` (`canonical_json`), `sha256_file`, `config_sha256` — what was trained on;
- `versions`: `package_versions`, `git_commit`, `git_dirty` — the software that produced it;
- `portable`: `portable` — no token and no absolute path of this machine in anything written; `is_secret` and
  `redact` — no token in a message;
- `metadata`: `build_metadata` (the dict), `stamp_folder` (written to all three places);
- `lineage`: `base_lineage` (an output's `lineage`: its base's provenance, recursively, back to the corpus),
  `read_chain` and `format_chain` (`python -m hfl3.provenance show FOLDER`);
- `safetensors_header`: `provenance_header`, `add_safetensors_metadata` — the header, without rewriting the tensors;
- `card`: `write_model_card` — `huggingface_hub.ModelCard.from_template`; `l3gpt_model_card`, `sft_model_card` —
  what the trainers' outputs' cards say;
- `hub`: `push_folder_to_hub`.

Atomic writes, which every output uses, are `hfl3.atomic`.
"""

from hfl3.provenance.card import l3gpt_model_card, sft_model_card, write_model_card
from hfl3.provenance.hashing import canonical_json, config_sha256, sha256_file, sha256_records
from hfl3.provenance.hub import push_folder_to_hub
from hfl3.provenance.lineage import base_lineage, format_chain, read_chain
from hfl3.provenance.metadata import METADATA_FORMAT_VERSION, build_metadata, stamp_folder
from hfl3.provenance.portable import REDACTED, is_secret, portable, redact
from hfl3.provenance.safetensors_header import add_safetensors_metadata, provenance_header
from hfl3.provenance.versions import TRACKED_PACKAGES, git_commit, git_dirty, package_versions

__all__ = [
    "METADATA_FORMAT_VERSION",
    "REDACTED",
    "TRACKED_PACKAGES",
    "add_safetensors_metadata",
    "base_lineage",
    "canonical_json",
    "build_metadata",
    "config_sha256",
    "format_chain",
    "git_commit",
    "git_dirty",
    "is_secret",
    "l3gpt_model_card",
    "package_versions",
    "portable",
    "provenance_header",
    "push_folder_to_hub",
    "read_chain",
    "redact",
    "sha256_file",
    "sha256_records",
    "sft_model_card",
    "stamp_folder",
    "write_model_card",
]
