"""Assets the repository cannot hold: where the suite looks for them, and the one line a test skips with.

Only the Gemma 3 tokenizer is such an asset (the Gemma Terms of Use do not allow redistributing it with hfl3); what
the tests read otherwise is in `tests/fixtures/`. It is looked up in order:
1. `$HFL3_ASSETS/tokenizers/gemma3/` (a folder laid out like `tests/fixtures/`),
2. `shared/assets/tokenizers/gemma3/` in the folder that holds the clone (the layout CI provides),
3. `GEMMA3_HUB_ID` in the Hugging Face cache, or on the Hub itself when `HF_HUB_OFFLINE` is off.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_ASSETS = REPO_ROOT.parent / "shared" / "assets"
# A multimodal instruction-tuned Gemma 3, chosen from what the files the tests were written against say of themselves
# (262,145 tokens with the image token, processor_class Gemma3Processor, the stock chat template); not compared with
# the Hub's files (no network here). The repository is gated: the Hub serves it to a token that accepted the terms.
GEMMA3_HUB_ID = "google/gemma-3-4b-it"
GEMMA3_FILES = ("tokenizer.json", "tokenizer_config.json")


def find_gemma3_tokenizer(hfl3_assets: str | None, shared_assets: Path = SHARED_ASSETS, cache_dir: Path | None = None,
                          hub: bool | None = None) -> Path | None:
    """The folder holding the Gemma 3 tokenizer files (`GEMMA3_FILES`), or None where it is found nowhere.

    Args:
        hfl3_assets: the value of `HFL3_ASSETS` (None: unset); its `tokenizers/gemma3/` is looked at first.
        shared_assets: looked at second (default: `shared/assets` beside the clone).
        cache_dir: the Hugging Face cache to look in for `GEMMA3_HUB_ID` (default: huggingface_hub's own).
        hub: whether a snapshot missing from the cache may be downloaded (default: unless `HF_HUB_OFFLINE` is on).
            A Hub failure (gated without an accepted token, no network) counts as not found.
    """
    roots = ([Path(hfl3_assets).expanduser()] if hfl3_assets else []) + [shared_assets]
    for folder in (root / "tokenizers" / "gemma3" for root in roots):
        if all((folder / name).is_file() for name in GEMMA3_FILES):
            return folder
    from huggingface_hub import constants, snapshot_download

    if hub is None:
        hub = not constants.HF_HUB_OFFLINE
    try:
        folder = Path(snapshot_download(GEMMA3_HUB_ID, cache_dir=cache_dir, local_files_only=not hub,
                                        allow_patterns=[*GEMMA3_FILES, "special_tokens_map.json", "chat_template.*"]))
    except OSError:  # huggingface_hub's errors for a missing cache entry, a gated repository or no network
        return None
    return folder if all((folder / name).is_file() for name in GEMMA3_FILES) else None


def gemma3_skip_reason(hfl3_assets: str | None) -> str:
    """The line a `gemma3` test is skipped with: what is missing and what to set."""
    where = f"HFL3_ASSETS={hfl3_assets} has no" if hfl3_assets else "set HFL3_ASSETS to a folder with"
    return (f"needs the Gemma 3 tokenizer (Gemma terms: not in the repository): {where} tokenizers/gemma3/"
            f"{{{','.join(GEMMA3_FILES)}}}, or run with HF_HUB_OFFLINE=0 and a token that may read {GEMMA3_HUB_ID}")
