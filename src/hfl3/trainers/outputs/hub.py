"""What of an output folder goes to the Hub, and how its adapter names its base: `push_folder` (the one push, at the
end of a run), `base_model_hub_id` and `local_base_model` (the local `adapter_config.json` names a local base by its
absolute path, the only local path in any output, because PEFT resolves `base_model_name_or_path` against the
working directory; what is pushed names the base's Hub id)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hfl3.atomic import write_json_atomic
from hfl3.provenance import push_folder_to_hub
from hfl3.provenance.hub import is_hub_id
from hfl3.trainers.outputs.folder import STAGING


def push_folder(source: Path, upload: Path, replaced: Mapping[str, Any], hub_model_id: str, *,
                private: bool | None, token: str | None, revision: str | None) -> str:
    """Upload `source` to `hub_model_id` (huggingface_hub's `upload_folder`, checkpoints and staging left out), on the
    branch `revision` when given (created if missing: `push_folder_to_hub`). The files named in `replaced` (name ->
    JSON value) are uploaded with that content instead, from a copy in `upload` (the other files hard-linked there),
    which is removed afterwards. Returns the commit URL."""
    if replaced:
        shutil.rmtree(upload, ignore_errors=True)
        shutil.copytree(source, upload, copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(f"{PREFIX_CHECKPOINT_DIR}-*", "merged", STAGING))
        for name, value in replaced.items():
            (upload / name).unlink()  # a hard link: writing through it would change the local file
            write_json_atomic(upload / name, value)
    try:
        return push_folder_to_hub(upload if replaced else source, hub_model_id, private=private, token=token,
                                  revision=revision)
    finally:
        if replaced:
            shutil.rmtree(upload, ignore_errors=True)
            with contextlib.suppress(OSError):
                upload.parent.rmdir()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # the weights are not copied
    except OSError:
        shutil.copy2(source, target)


def base_model_hub_id(name_or_path: str, given: str | None = None) -> str | None:
    """The Hub id of a base model, for what is pushed to the Hub (its `adapter_config.json` and card): `given`
    (`--base_model_hub_id`); `name_or_path` itself when it is not a local folder (a Hub id); else what the folder
    knows: the `hub_model_id` in its `metadata.json` (an hfl3 pretraining run that named its Hub repository), or the
    repository of a Hugging Face cache snapshot (`.../models--OWNER--NAME/snapshots/REVISION`). None when nothing
    names one."""
    if given:
        return given
    base = Path(name_or_path)
    if not base.is_dir():
        return name_or_path
    with contextlib.suppress(OSError, ValueError, AttributeError):
        hub_id = json.loads((base / "metadata.json").read_text()).get("training_args", {}).get("hub_model_id")
        if hub_id and is_hub_id(hub_id):
            return hub_id
    resolved = base.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name.removeprefix("models--").replace("--", "/")
    return None


def local_base_model(name_or_path: str) -> str:
    """What a locally written `adapter_config.json` names as `base_model_name_or_path`: a local folder as its
    absolute path, because PEFT (`AutoPeftModelForCausalLM`, vLLM, TRL's scripts) resolves it against the working
    directory of whoever loads the adapter; a Hub id as given. The one place an hfl3 output holds a local path: the
    copy pushed to the Hub names the base's Hub id instead (`ChatSFTTrainer.hub_files`)."""
    return str(Path(name_or_path).resolve()) if Path(name_or_path).is_dir() else name_or_path
