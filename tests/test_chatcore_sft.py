"""ChatCORE during SFT (`--chatcore_every`, hfl3.evaluate.chat_callback): when it runs, where its values go (the
evaluations, so that the best model can be picked by it; the log history; all_results.json; metadata.json and the
adapter's model card), and the arguments refused before any work. The recipe runs in this process on a tiny L3GPT
(tests/test_sft_recipe.py's) with the fixture rows of each task."""

import json

import pytest
from recipe_setup import parse_and_set_up
from test_sft_recipe import chats, l3gpt_folder, run_recipe  # noqa: F401  (l3gpt_folder: a fixture)

from hfl3.data.chat import write_chat_jsonl
from hfl3.evaluate.chat_tasks import TASKS

pytestmark = pytest.mark.timeout(300)
CHATCORE = ["--chatcore_max_cat", "3", "--chatcore_max_sample", "2", "--chatcore_max_new_tokens", "4"]


@pytest.fixture(scope="module")
def data_dir(assets):
    return str(assets / "chatcore")


def chatcore_steps(folder) -> list[int]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [entry["step"] for entry in history if "eval_chatcore_metric" in entry]


def test_chatcore_runs_in_the_evaluations_and_picks_the_best_model(tmp_path, l3gpt_folder, data_dir, sft_recipe,
                                                                    caplog):
    train = write_chat_jsonl(chats("good", 12, seed=0), tmp_path / "train.jsonl")
    out = tmp_path / "out"
    results, args = run_recipe(
        sft_recipe, caplog, "--model_name_or_path", str(l3gpt_folder), "--train_file", str(train), "--val_split",
        "0.25", "--output_dir", str(out), "--eval_strategy", "steps", "--eval_steps", "2", "--max_steps", "4",
        "--per_device_train_batch_size", "3", "--chatcore_every", "2", "--chatcore_data_dir", data_dir, *CHATCORE,
        "--metric_for_best_model", "chatcore_metric")
    assert args.greater_is_better  # transformers' rule for a metric that is not a loss
    # steps 2 and 4 inside their evaluations (not at step 0, as nanochat), then the final evaluation of the best model
    assert chatcore_steps(out) == [2, 4, 4]
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    at_2, at_4 = [entry["eval_chatcore_metric"] for entry in history if "eval_chatcore_metric" in entry][:2]
    assert results["best_model_checkpoint"].endswith("checkpoint-2" if at_2 >= at_4 else "checkpoint-4")
    assert set(results) >= {"eval_chatcore_metric", "eval_chatcore_cat", *(f"eval_chatcore/{n}" for n in TASKS)}
    assert json.loads((out / "all_results.json").read_text())["eval_chatcore_metric"] == results["eval_chatcore_metric"]
    summary = json.loads((out / "metadata.json").read_text())["evaluation"]["chatcore"]
    assert summary["tasks"]["ARC-Easy"]["problems"] == 3 and summary["tasks"]["HumanEval"]["problems"] == 2
    assert "chatcore_metric" in (out / "README.md").read_text()  # the card's model-index
    assert "ChatCORE: ARC-Easy 3, ARC-Challenge 3, MMLU 3, GSM8K 2, HumanEval 2 problems" in caplog.text


def test_chatcore_without_evaluation_data_is_logged_on_its_own(tmp_path, l3gpt_folder, data_dir, sft_recipe, caplog):
    train = write_chat_jsonl(chats("good", 9, seed=0), tmp_path / "train.jsonl")
    out = tmp_path / "out"
    results, _ = run_recipe(sft_recipe, caplog, "--model_name_or_path", str(l3gpt_folder), "--train_file", str(train),
                            "--output_dir", str(out), "--max_steps", "3", "--per_device_train_batch_size", "3",
                            "--logging_steps", "1", "--chatcore_every", "2", "--chatcore_data_dir", data_dir,
                            *CHATCORE)
    assert chatcore_steps(out) == [2, 3]  # every 2 steps, and the final model
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3]  # the step's own loss log is kept
    final = [entry for entry in history if "eval_chatcore_metric" in entry][-1]
    assert "eval_loss" not in results and results["eval_chatcore_metric"] == final["eval_chatcore_metric"]


def test_chatcore_arguments_are_refused_before_any_work(tmp_path, l3gpt_folder, data_dir, sft_recipe):
    train = write_chat_jsonl(chats("good", 4, seed=0), tmp_path / "train.jsonl")
    base = ["--model_name_or_path", str(l3gpt_folder), "--train_file", str(train), "--output_dir", str(tmp_path / "o")]
    for flags, expected in (
            (["--chatcore_max_sample", "5"], "--chatcore_max_sample 5: acts only with --chatcore_every N"),
            (["--chatcore_every", "0"], "chatcore_every=0: expected N > 0"),
            (["--chatcore_every", "2", "--chatcore_data_dir", str(tmp_path)], "has no copy of ARC-Easy"),
            (["--chatcore_every", "2", "--chatcore_data_dir", data_dir, "--val_split", "0.5", "--eval_strategy",
              "steps", "--eval_steps", "3", "--metric_for_best_model", "eval_chatcore/MMLU"],
             "every evaluation must compute ChatCORE")):
        with pytest.raises(ValueError, match=expected):
            parse_and_set_up(sft_recipe, [*base, *flags])
    assert not (tmp_path / "o").exists()
