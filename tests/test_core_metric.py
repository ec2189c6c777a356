"""The CORE metric (hfl3.evaluate) on tests/fixtures/core_bundle: hand-written items in nanochat's eval-bundle layout,
scored by a stub model whose next-token distribution the test sets, with the real Qwen3 tokenizer.

The stub (`BigramStub`) knows five transitions: " dog"→" runs", " runs"→" fast", " bird"→" sings",
" fish"→" swims", " cat"→" sleeps" (each word one Qwen3 token). At a position holding token t its logits are
S = `STRENGTH` for the token t is known to precede ("!", id 0, when t has none) and 0 for every other token. So
every position has the same log-normaliser Z, a token costs Z - S nats when it is the known successor and Z
otherwise, and the argmax is the known successor. The items only tie where the rows compared are identical (the same
token before every choice), so the ties are exact. Hand-computed outcomes (Qwen3 has no BOS token: nothing is
prepended):

multiple choice (baseline 25 %), span = each choice's tokens after the choices' common prefix:
  The dog: runs* / sings / swims / flies                 → runs, gold     ✓
  The bird: swims / sings* / runs / flies                → sings, gold    ✓
  The fish: flies / runs / swims* / sleeps               → swims, gold    ✓
  The cat: runs / sleeps / flies / sings*                → sleeps         ✗
  The cow: walks* / runs / sleeps / flies                → all tie, first ✓ (nanochat: the first lowest loss)
  The dog: runs away / sings / runs fast*                → means Z-S/2, Z, Z-S: runs fast ✓
  The dog: sings / runs away*                            → means Z, Z-S/2: runs away ✓ (summed losses: sings)
  accuracy 6/7, centered (6/7 - 1/4)/(3/4) = 17/21; the 3-shot task on the same file scores the same (a bigram
  model sees one token back).
schema (baseline 50 %), span = the continuation after the options:
  The dog* / The bird + "runs fast"   → Z-S vs (Z + Z-S)/2: dog ✓
  The fish* / The cat + "sleeps"      → cat ✗;  The cow* / The dog + "runs" → dog ✗
  The bird / The fish* + "swims"      → fish ✓;  accuracy 2/4, centered 0
language modelling (baseline 0), 1-shot, correct when every continuation token is the argmax:
  The dog + runs fast ✓; The bird + sings ✓; The cat + runs ✗ (sleeps); The cow + walks ✗ ("!");
  "The dog  " (trimmed) + runs away ✗ (fast); The fish + swims ✓  → accuracy 3/6, centered 1/2
CORE = (17/21 + 17/21 + 0 + 1/2) / 4.
"""

import json
import math
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PretrainedConfig
from transformers.modeling_outputs import CausalLMOutput

from hfl3.evaluate import bundle as bundle_module
from hfl3.evaluate import evaluate_core, evaluate_task, load_core_bundle, resolve_bundle_dir
from hfl3.evaluate.core import fewshot_examples, render_prompts

BUNDLE = Path(__file__).parent / "fixtures" / "core_bundle"
STRENGTH = 10.0
KNOWN = {" dog": " runs", " runs": " fast", " bird": " sings", " fish": " swims", " cat": " sleeps"}
EXPECTED_ACCURACY = {"mc_animals": 6 / 7, "mc_animals_fewshot": 6 / 7, "schema_animals": 2 / 4, "lm_animals": 3 / 6}
EXPECTED_WRONG = {"mc_animals": ["The cat"], "mc_animals_fewshot": ["The cat"],
                  "schema_animals": [["The fish", "The cat"], ["The cow", "The dog"]],
                  "lm_animals": ["The cat", "The cow", "The dog  "]}
EXPECTED_CORE = (17 / 21 + 17 / 21 + 0 + 1 / 2) / 4


@pytest.fixture(scope="module")
def qwen3(assets):
    return AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")


class BigramStub(torch.nn.Module):
    """A causal LM whose logits at a position depend only on the token there (see the module docstring); it records
    every `input_ids` batch it is given."""

    def __init__(self, tokenizer, known: dict[str, str], max_position_embeddings: int | None = None):
        super().__init__()
        ids = {word: tokenizer(word, add_special_tokens=False)["input_ids"] for word in {*known, *known.values()}}
        assert all(len(token_ids) == 1 for token_ids in ids.values()), ids  # one token per word, as designed
        successor = torch.zeros(len(tokenizer), dtype=torch.long)  # 0 = "!", the successor of unknown tokens
        for word, next_word in known.items():
            successor[ids[word][0]] = ids[next_word][0]
        self.register_buffer("successor", successor)
        self.vocab_size = len(tokenizer)
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # a device to put inputs on
        self.config = PretrainedConfig(max_position_embeddings=max_position_embeddings)
        self.batches: list[torch.Tensor] = []

    def forward(self, input_ids, use_cache=False):
        self.batches.append(input_ids.clone())
        logits = torch.zeros(*input_ids.shape, self.vocab_size)  # (B, T, V)
        logits.scatter_(-1, self.successor[input_ids].unsqueeze(-1), STRENGTH)
        return CausalLMOutput(logits=logits)


def wrong_items(task, result) -> list:
    key = {"multiple_choice": "query", "schema": "context_options", "language_modeling": "context"}[task.task_type]
    return sorted(item[key] for item, correct in zip(task.items, result.correct) if not correct)


def test_accuracies_of_a_bigram_model_are_the_hand_computed_ones(qwen3):
    bundle = load_core_bundle(BUNDLE)
    results = evaluate_core(BigramStub(qwen3, KNOWN), qwen3, bundle)
    assert [task.label for task in results.tasks] == list(EXPECTED_ACCURACY)
    for task, result in zip(bundle.tasks, results.tasks):
        assert result.accuracy == pytest.approx(EXPECTED_ACCURACY[task.label], abs=1e-12), task.label
        assert wrong_items(task, result) == sorted(EXPECTED_WRONG[task.label]), task.label
        baseline = task.random_baseline / 100
        assert result.centered == pytest.approx((result.accuracy - baseline) / (1 - baseline), abs=1e-12)
    assert results.core_metric == pytest.approx(EXPECTED_CORE, abs=1e-12)
    metrics = results.metrics()
    assert metrics["core_metric"] == results.core_metric
    assert metrics["core_accuracy/schema_animals"] == 0.5 and metrics["core_centered/lm_animals"] == 0.5
    assert "CORE" in results.table().splitlines()[-1]


def test_a_model_that_knows_nothing_scores_each_task_on_its_first_choices(qwen3):
    """Guard: without the known transitions every multiple-choice/schema item ties (the first option wins) and
    every language-modelling item fails, so the accuracies above come from the model's knowledge."""
    bundle = load_core_bundle(BUNDLE)
    results = evaluate_core(BigramStub(qwen3, {}), qwen3, bundle)
    for task, result in zip(bundle.tasks, results.tasks):
        expected = 0.0 if task.task_type == "language_modeling" else (
            sum(item["gold"] == 0 for item in task.items) / len(task.items))
        assert result.accuracy == pytest.approx(expected, abs=1e-12), task.label
    assert results.core_metric != pytest.approx(EXPECTED_CORE)


def test_items_are_shuffled_and_cut_as_nanochat_does():
    # Orders from nanochat 92d63d4: random.Random(1337).shuffle of the file's items, then the first max_per_task
    bundle = load_core_bundle(BUNDLE)
    by_label = {task.label: task for task in bundle.tasks}
    assert [item["query"] for item in by_label["mc_animals"].items] == [
        "The dog", "The dog", "The cat", "The bird", "The fish", "The dog", "The cow"]
    assert [item["context"] for item in by_label["lm_animals"].items] == [
        "The bird", "The dog", "The cow", "The cat", "The fish", "The dog  "]
    cut = load_core_bundle(BUNDLE, max_per_task=4)
    assert [f"{item['query']}|{item['choices'][0]}" for item in cut.tasks[1].items] == [
        "The dog|runs", "The dog|runs away", "The cat|runs", "The bird|swims"]
    assert cut.tasks[1].total_items == 7 and cut.sha256 == bundle.sha256
    assert bundle.describe()["tasks"]["mc_animals_fewshot"] == {
        "task_type": "multiple_choice", "num_fewshot": 3, "items": 7, "total_items": 7, "random_baseline": 25.0}


# (task label, item index, continuation delimiter, the prompts nanochat 92d63d4's render_prompts_* make for it with the
# few-shot examples its evaluate_example samples: random.Random(1234 + index).sample(other indices, k))
PROMPT_CASES = [
    ("mc_animals_fewshot", 0, " ", [
        "The fish swims\n\nThe dog runs fast\n\nThe dog runs away\n\nThe dog runs",
        "The fish swims\n\nThe dog runs fast\n\nThe dog runs away\n\nThe dog sings",
        "The fish swims\n\nThe dog runs fast\n\nThe dog runs away\n\nThe dog swims",
        "The fish swims\n\nThe dog runs fast\n\nThe dog runs away\n\nThe dog flies"]),
    ("mc_animals_fewshot", 4, " ", [
        "The dog runs\n\nThe bird sings\n\nThe dog runs fast\n\nThe fish flies",
        "The dog runs\n\nThe bird sings\n\nThe dog runs fast\n\nThe fish runs",
        "The dog runs\n\nThe bird sings\n\nThe dog runs fast\n\nThe fish swims",
        "The dog runs\n\nThe bird sings\n\nThe dog runs fast\n\nThe fish sleeps"]),
    ("schema_animals", 0, " ", ["The fish sleeps", "The cat sleeps"]),
    ("lm_animals", 0, " ", ["The fish swims\n\nThe bird", "The fish swims\n\nThe bird sings"]),
    # contexts are trimmed, shots included ("The dog  "), and the prompt without the continuation is stripped
    ("lm_animals", 2, "\nAnswer: ", ["The dog\nAnswer: runs away\n\nThe cow\nAnswer:",
                                     "The dog\nAnswer: runs away\n\nThe cow\nAnswer: walks"]),
    ("lm_animals", 5, "\nAnswer: ", ["The bird\nAnswer: sings\n\nThe dog\nAnswer:",
                                     "The bird\nAnswer: sings\n\nThe dog\nAnswer: runs away"]),
]


@pytest.mark.parametrize("label, index, delimiter, expected", PROMPT_CASES)
def test_fewshot_prompts_are_nanochats(label, index, delimiter, expected):
    task = next(task for task in load_core_bundle(BUNDLE).tasks if task.label == label)
    shots = fewshot_examples(task.items, index, task.num_fewshot)
    assert render_prompts(task.task_type, task.items[index], delimiter, shots) == expected


def test_rows_alone_or_cropped_to_max_length_give_the_same_answers(qwen3):
    bundle = load_core_bundle(BUNDLE)
    model = BigramStub(qwen3, KNOWN)
    together = [evaluate_task(model, qwen3, task) for task in bundle.tasks]
    forwards = len(model.batches)
    alone = [evaluate_task(model, qwen3, task, batch_tokens=1) for task in bundle.tasks]
    rows = sum(len(item.get("choices", item.get("context_options", [None]))) for task in bundle.tasks
               for item in task.items)
    assert forwards == len(bundle.tasks)  # every task's rows fit one forward of 8192 tokens
    assert len(model.batches) - forwards == rows and all(batch.shape[0] == 1 for batch in model.batches[forwards:])
    assert [r.correct for r in alone] == [r.correct for r in together]
    # The 0-shot multiple-choice rows keep their last 3 tokens ("The dog runs away" loses "The"): one token still
    # precedes each choice; with 2, "runs away" has nothing before it
    model.batches.clear()
    cropped = evaluate_task(model, qwen3, bundle.tasks[0], max_length=3)
    assert max(batch.shape[1] for batch in model.batches) == 3 and cropped.correct == together[0].correct
    with pytest.raises(ValueError, match="nothing precedes the scored tokens within max_length=2"):
        evaluate_task(model, qwen3, bundle.tasks[0], max_length=2)


def test_bos_is_prepended_when_the_tokenizer_has_one(qwen3):
    bundle = load_core_bundle(BUNDLE)
    with_bos = AutoTokenizer.from_pretrained(qwen3.name_or_path, bos_token="<|endoftext|>")
    model = BigramStub(qwen3, KNOWN)
    result = evaluate_task(model, with_bos, bundle.tasks[3])
    assert all((batch[:, 0] == with_bos.bos_token_id).all() for batch in model.batches)
    assert result.correct == evaluate_task(model, qwen3, bundle.tasks[3]).correct
    model.batches.clear()
    evaluate_task(model, with_bos, bundle.tasks[3], prepend_bos=False)
    assert not any((batch[:, 0] == with_bos.bos_token_id).any() for batch in model.batches)
    with pytest.raises(ValueError, match="no bos_token"):
        evaluate_task(model, qwen3, bundle.tasks[3], prepend_bos=True)


def test_a_continuation_off_a_token_boundary_is_scored_from_the_first_difference(qwen3):
    # "The do" + "g runs": Qwen3 encodes "The do" as [The, " do"] but "The dog runs" as [The, " dog", " runs"]
    task = bundle_module.CoreTask("split", "language_modeling", 0, "", "x.jsonl", 0.0,
                                  [{"context": "The do", "continuation": "g runs"}], 1)
    model = BigramStub(qwen3, KNOWN)
    result = evaluate_task(model, qwen3, task)
    assert result.boundary_moved == 1 and result.correct == [False]  # " dog" is not the argmax after "The"
    assert model.batches[0].tolist() == [qwen3("The dog runs", add_special_tokens=False)["input_ids"]]


def write_bundle(folder: Path, edit=None) -> Path:
    shutil.copytree(BUNDLE, folder)
    if edit:
        edit(folder)
    return folder


def replace_line(file: str, line: int, text: str):
    def edit(folder: Path):
        path = folder / file
        lines = path.read_text().splitlines()
        lines[line - 1] = text
        path.write_text("\n".join(lines) + "\n")
    return edit


BAD_BUNDLES = [
    ("no core.yaml", lambda folder: (folder / "core.yaml").unlink(), "has no core.yaml"),
    ("gold out of range", replace_line("eval_data/animals/schema.jsonl", 3,
                                       '{"context_options": ["a", "b"], "continuation": "c", "gold": 2}'),
     r"eval_data/animals/schema.jsonl:3: gold 2 is not an index of its 2 context_options"),
    ("not JSON", replace_line("eval_data/animals/language_modeling.jsonl", 2, '{"context": "x",'),
     r"eval_data/animals/language_modeling.jsonl:2: not JSON"),
    ("missing field", replace_line("eval_data/animals/multiple_choice.jsonl", 1, '{"query": "q", "gold": 0}'),
     r"multiple_choice.jsonl:1: multiple_choice items need 'choices'"),
    ("unknown type", lambda folder: (folder / "core.yaml").write_text(
        (folder / "core.yaml").read_text().replace("icl_task_type: schema", "icl_task_type: generation")),
     r"icl_tasks\[2\] \(schema_animals\): icl_task_type 'generation'"),
    ("no baseline", replace_line("eval_meta_data.csv", 4, "other,test,schema,0,4,50,,x"),
     "no 'Random baseline' row for task 'schema_animals'"),
]


@pytest.mark.parametrize("name, edit, message", BAD_BUNDLES, ids=[case[0] for case in BAD_BUNDLES])
def test_a_bad_bundle_is_refused_naming_the_file_and_record(tmp_path, name, edit, message):
    folder = write_bundle(tmp_path / "bundle", edit)
    with pytest.raises(ValueError, match=message):
        load_core_bundle(folder)


def test_fewer_items_than_the_shots_need_are_refused():
    with pytest.raises(ValueError, match="mc_animals_fewshot: 3-shot prompts need at least 4 items, 3 kept"):
        load_core_bundle(BUNDLE, max_per_task=3)


def test_the_bundle_is_downloaded_once_into_the_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    archive = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for file in BUNDLE.rglob("*"):
            zipped.write(file, Path("eval_bundle") / file.relative_to(BUNDLE))
    fetched = []

    def fetch(url, file):
        fetched.append(url)
        file.write(archive.read_bytes())

    monkeypatch.setattr(constants, "HF_ASSETS_CACHE", str(tmp_path / "assets"))
    monkeypatch.setattr(bundle_module, "fetch", fetch)
    with pytest.raises(ValueError, match="pass --core_bundle_dir DIR"):  # offline (conftest) and nothing cached
        resolve_bundle_dir(None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    first, second = resolve_bundle_dir(None), resolve_bundle_dir(None)
    assert fetched == [bundle_module.EVAL_BUNDLE_URL] and first == second
    assert first.is_relative_to(tmp_path / "assets" / "hfl3")
    assert load_core_bundle(first).sha256 == load_core_bundle(BUNDLE).sha256
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_bundle_dir(None) == first  # the cached copy, offline


def test_results_go_to_the_model_cards_model_index(qwen3, tmp_path):
    from huggingface_hub import ModelCard

    from hfl3.evaluate import core_eval_results
    from hfl3.provenance import write_model_card

    results = evaluate_core(BigramStub(qwen3, KNOWN), qwen3, load_core_bundle(BUNDLE))
    path = write_model_card(tmp_path, "m", {"evaluation": {"core": results.summary()}},
                            eval_results=core_eval_results(results.summary()), model_name="m")
    card = ModelCard.load(path)
    values = {(r.dataset_type, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert values[("core", "core_metric")] == round(EXPECTED_CORE, 4)
    assert values[("lm_animals", "accuracy")] == 0.5
    assert values[("mc_animals", "centered_accuracy")] == round(17 / 21, 4)
    assert len(values) == 1 + 2 * 4 and math.isfinite(sum(values.values()))
    assert json.loads(json.dumps(results.summary()))["results"]["schema_animals"] == 0.5


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, assets):
    """A tiny random L3GPT in float64 and a tiny random GPT-2 (16 learned positions), saved as folders with a BPE
    trained on Tiny Shakespeare."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hfl3 import L3GPTConfig, L3GPTForCausalLM
    from hfl3.tokenization import train_tokenizer

    folder = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer([(assets / "text" / "tinyshakespeare.txt").read_text()[:50_000]], vocab_size=512)
    torch.manual_seed(0)
    config = L3GPTConfig.from_depth(2, vocab_size=len(tokenizer), aspect_ratio=32, head_dim=32,
                                    max_position_embeddings=64, window_pattern="SL", l3_after_layers=[0],
                                    l3_n_emb=4 * 512, l3_k_max=8, l3_d_up=64, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    L3GPTForCausalLM(config).to(torch.float64).save_pretrained(folder / "l3gpt")
    tokenizer.save_pretrained(folder / "l3gpt")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=32, n_layer=2, n_head=2))
    gpt2.save_pretrained(folder / "gpt2")
    tokenizer.save_pretrained(folder / "gpt2")
    return folder


@pytest.mark.parametrize("name", ["l3gpt", "gpt2"])
def test_the_command_line_prints_the_table_and_writes_json(saved_models, tmp_path, capsys, name):
    from transformers import AutoModelForCausalLM

    from hfl3.evaluate.__main__ import main

    output = tmp_path / "core.json"
    returned = main(["core", "--model_name_or_path", str(saved_models / name), "--core_bundle_dir", str(BUNDLE),
                     "--max_per_task", "6", "--output_json", str(output)])
    printed = capsys.readouterr().out
    written = json.loads(output.read_text())
    assert written == json.loads(json.dumps(returned))
    assert str(tmp_path) not in output.read_text() and str(saved_models) not in output.read_text()
    # The same numbers as the library call on the same model (GPT-2: prompts cropped to its 16 positions; L3GPT:
    # whole, and its BPE's <|bos|> first)
    model = AutoModelForCausalLM.from_pretrained(saved_models / name)
    tokenizer = AutoTokenizer.from_pretrained(saved_models / name)
    expected = evaluate_core(model, tokenizer, load_core_bundle(BUNDLE, max_per_task=6),
                             max_length=16 if name == "gpt2" else None)
    assert written["results"] == {task.label: task.accuracy for task in expected.tasks}
    assert written["core_metric"] == expected.core_metric
    assert written["settings"]["max_length"] == (16 if name == "gpt2" else None)
    assert written["settings"]["bos_token"] == "<|bos|>"
    assert written["bundle"]["max_per_task"] == 6 and f"{expected.core_metric:.4f}" in printed.splitlines()[-2]


def test_the_command_line_refuses_a_bad_bundle_in_one_line(tmp_path, capsys):
    from hfl3.evaluate.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["core", "--model_name_or_path", "unused", "--core_bundle_dir", str(tmp_path)])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and "error: --core_bundle_dir: " in error and "has no core.yaml" in error
    with pytest.raises(SystemExit) as stopped:
        main(["--model_name_or_path", "x"])
    assert stopped.value.code == 2 and "usage: python -m hfl3.evaluate core" in capsys.readouterr().err


def test_training_evaluates_every_n_steps_and_at_the_end(saved_models, assets, tmp_path):
    import datasets

    from hfl3 import L3GPTForCausalLM
    from hfl3.evaluate import CoreMetricCallback
    from hfl3.tokenization import load_tokenizer
    from hfl3.trainers.pretraining.trainer import PretrainTrainer, PackedCollator
    from hfl3.trainers.pretraining.config import PretrainConfig

    tokenizer = load_tokenizer(str(saved_models / "l3gpt"))
    model = L3GPTForCausalLM.from_pretrained(saved_models / "l3gpt", dtype=torch.float32)
    text = (assets / "text" / "tinyshakespeare.txt").read_text()[:20_000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = [[tokenizer.bos_token_id, *ids[i:i + 31]] for i in range(0, 31 * 16, 31)]
    args = PretrainConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
                          eval_strategy="no", report_to="none", disable_tqdm=True, core_metric_every=2,
                          core_bundle_dir=str(BUNDLE))
    trainer = PretrainTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                           data_collator=PackedCollator(tokenizer.bos_token_id), processing_class=tokenizer)
    bundle = load_core_bundle(BUNDLE)
    core = CoreMetricCallback(trainer, bundle, every=2)
    trainer.add_callback(core)
    excluded = []  # each evaluation's seconds, left out of the trainer's throughput window
    exclude_time = trainer.step_metrics.throughput.exclude_time
    trainer.step_metrics.throughput.exclude_time = lambda seconds: (excluded.append(seconds), exclude_time(seconds))
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "core_metric" in entry]
    assert [entry["step"] for entry in logged] == [2, 3]
    assert len(excluded) == 2 and all(seconds > 0 for seconds in excluded)
    # the Trainer's own loss log of every step (logging_steps=1) survives the CORE log of the same step
    assert [entry["step"] for entry in trainer.state.log_history if "loss" in entry] == [1, 2, 3]
    assert {key: logged[-1][key] for key in core.latest.metrics()} == core.latest.metrics()
    after = evaluate_core(trainer.model, tokenizer, bundle)  # the trained model evaluated again: the same numbers
    assert core.latest.metrics() == after.metrics() and core.latest.bundle == bundle.describe()


def test_recipe_arguments_for_core_are_checked_before_any_work(pretrain_recipe, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    from recipe_setup import set_up_recipe

    monkeypatch.setattr(constants, "HF_ASSETS_CACHE", str(tmp_path / "assets"))  # nothing cached
    cases = [(["--core_metric_every", "0"], "core_metric_every=0: expected N > 0"),
             (["--core_metric_every", "5", "--core_metric_max_per_task", "0"], "core_metric_max_per_task=0"),
             (["--core_metric_every", "5", "--core_bundle_dir", str(tmp_path / "missing")], "is not a folder"),
             (["--core_metric_every", "5"], "downloads are off (HF_HUB_OFFLINE=1): pass --core_bundle_dir DIR")]
    for args, message in cases:
        with pytest.raises(SystemExit, match="2") as stopped:
            set_up_recipe(pretrain_recipe, ["--output_dir", str(tmp_path / "out"), *args])
        error = capsys.readouterr().err
        assert stopped.value.code == 2 and message in error, (args, error)
        assert len(error.strip().splitlines()) == 2  # the usage line, then the error
    _, training_args, _, _ = set_up_recipe(pretrain_recipe, [
        "--output_dir", str(tmp_path / "out"), "--core_metric_every", "5", "--core_bundle_dir", str(BUNDLE)])
    assert training_args.core_metric_every == 5 and training_args.core_metric_max_per_task == 500


DISTRIBUTED_WORKER = """
import json, os, sys
sys.path.insert(0, {tests!r})
from accelerate import PartialState
from transformers import AutoTokenizer
from test_core_metric import BUNDLE, KNOWN, BigramStub
from hfl3.evaluate import evaluate_core, load_core_bundle
from hfl3.distributed import end_distributed_run

state = PartialState(cpu=True)  # gloo across torchrun's processes
tokenizer = AutoTokenizer.from_pretrained({tokenizer!r})
model = BigramStub(tokenizer, KNOWN)
results = evaluate_core(model, tokenizer, load_core_bundle(BUNDLE), batch_tokens=1)  # one row per forward
with open(os.path.join({out!r}, f"rank{{state.process_index}}.json"), "w") as f:
    json.dump({{"world_size": state.num_processes, "forwards": len(model.batches),
               "rows": [batch.tolist() for batch in model.batches], "summary": results.summary(),
               "correct": [task.correct for task in results.tasks]}}, f)
end_distributed_run()  # as `python -m hfl3.evaluate core` ends
"""


@pytest.mark.distributed
def test_two_processes_score_their_shares_and_gather_the_results(assets, qwen3, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(DISTRIBUTED_WORKER.format(tests=str(Path(__file__).parent), out=str(tmp_path),
                                                tokenizer=str(assets / "tokenizers" / "qwen3")))
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # --standalone: a free rendezvous port (torchrun's default, 29500, may be a launch's of another test)
    completed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                str(script)],
                               capture_output=True, text=True, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    for rank in ranks:  # every process gets the hand-computed results of the whole bundle
        assert rank["summary"]["results"] == pytest.approx(EXPECTED_ACCURACY, abs=1e-12)
        assert rank["summary"]["core_metric"] == pytest.approx(EXPECTED_CORE, abs=1e-12)
    bundle = load_core_bundle(BUNDLE)
    rows = sum(len(item.get("choices", item.get("context_options", [None]))) for task in bundle.tasks
               for item in task.items)
    # Both processes run as many forwards (ZeRO-3/FSDP gather weights in each): the one with fewer rows pads with
    # two-token forwards of the pad token; the real rows are split between them, each scored once
    assert ranks[0]["forwards"] == ranks[1]["forwards"]
    padding = [[qwen3.pad_token_id] * 2]
    real = [[row for row in rank["rows"] if row != padding] for rank in ranks]
    assert len(real[0]) + len(real[1]) == rows and len(real[0]) != len(real[1]) and all(real)
    # Guard: each process holds correct items of its own (odd items are rank 1's), so a result not gathered would
    # have differed from the hand-computed one
    assert any(flag for flags in ranks[0]["correct"] for flag in flags[1::2])
