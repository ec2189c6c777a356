"""Hub repository ids, and the upload of a finished output folder to the Hugging Face Hub."""

from __future__ import annotations

import os
from collections.abc import Sequence

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

# What an upload leaves out: checkpoints, a merged model pushed on its own, temporary files and the staging area
IGNORED = ("checkpoint-*", "checkpoint-*/**", "merged/**", "*.tmp", ".*", "_hfl3*", "optimizer/**")
"""Left out of an upload: checkpoints, a merged copy, temporary and hidden files, the staging area, and the optimizer
state a pretraining folder keeps for SFT's warm start (twice the weights' size; `hfl3.optim.state_file`)."""


def is_hub_id(value: str) -> bool:
    """Whether `value` is a valid Hub repository id (`name` or `namespace/name`, huggingface_hub's rules)."""
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    ignore_patterns: Sequence[str] = IGNORED,
    revision: str | None = None,
) -> str:
    """Upload `folder` (weights or adapter, tokenizer, metadata.json and README.md) to the Hub model repository
    `repo_id` with `huggingface_hub`, creating the repository if needed; checkpoints and temporary files are left
    out. With `revision` (`--hub_revision`), the upload is a commit on that branch, created from the default branch
    when missing (`HfApi.create_branch(exist_ok=True)`; transformers' own push would fail on a branch that does not
    exist); without it, on the default branch. Returns the commit URL.

    Raises:
        huggingface_hub errors: offline (`HF_HUB_OFFLINE=1`), no token, or no write access to `repo_id`.
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    on_branch = {}
    if revision:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
        on_branch["revision"] = revision
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=str(folder),
        commit_message="Upload from hfl3",
        ignore_patterns=list(ignore_patterns),
        **on_branch,
    )
    return str(commit)
