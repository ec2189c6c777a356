"""The suite's assets: `tests/fixtures/` is what its README lists, its GSM8K chats are usable SFT data, the Gemma 3
tokenizer is looked for in the documented order, and a clone with nothing beside it collects the whole suite and
skips exactly the Gemma 3 tests, each with the line that says what to set."""

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
from external_assets import GEMMA3_FILES, find_gemma3_tokenizer, gemma3_skip_reason
from transformers import AutoTokenizer

from hfl3.data.sft import load_sft_data

EMPTY_THINK = "<think>\n\n</think>\n\n"  # Qwen3's stock template writes it before the last assistant reply

# Every test that needs the Gemma 3 tokenizer, as pytest names it: exactly these are skipped without it
GEMMA3_TESTS = sorted(
    ["tests/test_chat_errors.py::test_template_rejection_is_reported_with_its_reason",
     "tests/test_chat_masks.py::test_end_of_turn_comes_from_the_template[gemma3-<end_of_turn>]",
     "tests/test_chat_masks.py::test_truncation_keeps_the_start_then_drops_rows_without_supervision[gemma3]",
     "tests/test_sft_data.py::test_supervised_text_is_what_was_marked_by_hand[Gemma 3, training false]",
     "tests/test_sft_data.py::test_supervised_text_is_what_was_marked_by_hand[Gemma 3 has no tools]",
     "tests/test_sft_recipe.py::test_compact_loss_equals_trl_loss_and_gradients[False-gemma3-tiny_gemma3]",
     "tests/test_sft_recipe.py::test_compact_loss_equals_trl_loss_and_gradients[True-gemma3-tiny_gemma3]",
     "tests/test_text_data.py::test_token_bytes_counts_raw_utf8_bytes[gemma3]"]
    + [f"tests/test_chat_masks.py::test_every_assistant_turn_and_only_it_is_supervised[{conversation}-gemma3]"
       for conversation in ("single-turn", "single-turn with system", "multi-turn", "multi-turn with system",
                            "unicode", "reply with surrounding spaces")]
    + [f"tests/test_chat_masks.py::test_masks_agree_with_trl_training_templates[gemma3-{conversation}]"
       for conversation in ("single-turn", "single-turn with system", "multi-turn", "multi-turn with system",
                            "unicode", "reply with surrounding spaces")]
)


def test_the_fixtures_readme_lists_every_file_with_its_size(assets):
    rows = [re.split(r"(?<!\\)\|", line)[1:3] for line in (assets / "README.md").read_text().splitlines()
            if re.match(r"\| \S+ \| \d+ \|", line)]
    listed = {path.strip(): int(size) for path, size in rows}
    present = {path.relative_to(assets).as_posix(): path.stat().st_size for path in assets.rglob("*")
               if path.is_file() and path.name not in ("README.md", ".gitattributes")}
    assert listed == present


def test_gsm8k_fixture_chats_load_whole_and_supervise_exactly_the_answers(assets):
    qwen3 = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    chat = assets / "chat"
    data = load_sft_data(qwen3, chat / "gsm8k_messages_train.jsonl", eval_file=chat / "gsm8k_messages_test.jsonl")
    counts = data.provenance["counts"]
    assert (counts["train_file"]["read"], counts["train_file"]["kept"]) == (300, 300)
    assert (counts["eval_file"]["read"], counts["eval_file"]["kept"]) == (100, 100)
    answers = [record["messages"][-1]["content"] for name in ("train", "test")
               for record in map(json.loads, (chat / f"gsm8k_messages_{name}.jsonl").read_text().splitlines())]
    rows = list(data.train) + list(data.eval)
    for row, answer in zip(rows, answers, strict=True):
        supervised = [token for token, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert qwen3.decode(supervised) == EMPTY_THINK + answer + "<|im_end|>"


def fake_gemma3(folder):
    folder.mkdir(parents=True)
    for name in GEMMA3_FILES:
        (folder / name).write_text("{}")
    return folder


def test_gemma3_tokenizer_is_looked_up_in_order(tmp_path):
    mine, shared, cache = tmp_path / "mine", tmp_path / "shared", tmp_path / "hf_cache"
    # a snapshot in the Hugging Face cache layout: refs/main names the commit whose snapshot folder holds the files
    repo = cache / "models--google--gemma-3-4b-it"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)

    def found(hfl3_assets):
        return find_gemma3_tokenizer(hfl3_assets, shared, cache_dir=cache, hub=False)

    assert found(None) is None and found(str(mine)) is None
    cached = fake_gemma3(repo / "snapshots" / commit)
    assert found(None) == cached
    (shared / "tokenizers" / "gemma3").mkdir(parents=True)
    (shared / "tokenizers" / "gemma3" / "tokenizer.json").write_text("{}")  # incomplete: not taken
    assert found(None) == cached
    (shared / "tokenizers" / "gemma3" / "tokenizer_config.json").write_text("{}")
    assert found(None) == found(str(mine)) == shared / "tokenizers" / "gemma3"
    assert found(str(fake_gemma3(mine / "tokenizers" / "gemma3").parents[1])) == mine / "tokenizers" / "gemma3"
    assert gemma3_skip_reason(None) == (
        "needs the Gemma 3 tokenizer (Gemma terms: not in the repository): set HFL3_ASSETS to a folder with "
        "tokenizers/gemma3/{tokenizer.json,tokenizer_config.json}, or run with HF_HUB_OFFLINE=0 and a token that may "
        "read google/gemma-3-4b-it")


@pytest.mark.slow
def test_a_clone_alone_collects_everything_and_skips_exactly_the_gemma3_tests(tmp_path, repo_root):
    # The suite as a clone has it, with no `shared` folder beside it, an empty Hugging Face cache, offline
    clone = tmp_path / "clone"
    shutil.copytree(repo_root / "tests", clone / "tests", ignore=shutil.ignore_patterns("__pycache__", "fixtures"))
    (clone / "tests" / "fixtures").symlink_to(repo_root / "tests" / "fixtures")
    shutil.copy(repo_root / "pyproject.toml", clone)
    nowhere = tmp_path / "nowhere"
    env = {name: value for name, value in os.environ.items()
           if name not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "PYTEST_ADDOPTS")}
    env.update(HFL3_ASSETS=str(nowhere), HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    report = tmp_path / "report.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "gemma3", "-p", "no:cacheprovider", "-q",
                          f"--junitxml={report}"], cwd=clone, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{len(GEMMA3_TESTS)} skipped, \d+ deselected(, \d+ warnings?)? in .*", summary), summary
    cases = ElementTree.parse(report).getroot().iter("testcase")
    skipped = {f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}": case.find("skipped")
               for case in cases}
    assert sorted(skipped) == GEMMA3_TESTS
    reason = (f"needs the Gemma 3 tokenizer (Gemma terms: not in the repository): HFL3_ASSETS={nowhere} has no "
              f"tokenizers/gemma3/{{tokenizer.json,tokenizer_config.json}}, or run with HF_HUB_OFFLINE=0 and a token "
              f"that may read google/gemma-3-4b-it")
    assert {element.get("message") for element in skipped.values()} == {reason}
