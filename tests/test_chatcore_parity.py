"""ChatCORE equals nanochat's own numbers: a nanochat chat checkpoint (random weights, nanochat master's format) and its
tokenizer are evaluated by nanochat's `scripts/chat_eval.py` code (its Engine, tasks and tokenizer, run from a
checkout in a subprocess: tests/nanochat_chat_eval.py) and, converted with `hfl3.nanochat`, by `hfl3.evaluate`, on the
fixture rows of every task (tests/fixtures/chatcore), greedy, same max tokens. Per problem: the same prompt tokens,
the same answer (letter or completion text) and outcome; per task: the same accuracy; and the same calculator values.

It needs a nanochat checkout at build/nanochat (git-ignored; or `HFL3_NANOCHAT_DIR`) and tiktoken, which nanochat's
tokenizer loads; without them it is skipped (CI has neither).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nanochat_chat_eval import write_nanochat_task_data
from nanochat_reference import Spec, random_weights, train_ranks, write_checkpoint, write_tokenizer_pickle
from transformers import AutoModelForCausalLM, AutoTokenizer

from hfl3.evaluate.chat_generation import calculate, prompt_ids
from hfl3.evaluate.chat_tasks import TASKS, load_problems
from hfl3.evaluate.chatcore import evaluate_chatcore
from hfl3.nanochat.convert_nanochat_to_hf import convert

REPO = Path(__file__).resolve().parents[1]
NANOCHAT = Path(os.environ.get("HFL3_NANOCHAT_DIR", REPO / "build" / "nanochat"))
FIXTURES = REPO / "tests" / "fixtures" / "chatcore"
MAX_NEW_TOKENS = 48
BATCH_SIZE = 4
SPEC = Spec("master", vocab=500, sequence_len=1024)  # short window 256: long prompts cross it
EXPRESSIONS = ["16 - 3 - 4", "9 * 2", "3/2", "10/5", "7 // 2", "-(4 - 10)", "1,000 + 1", "2 ** 8", "()", "1/0",
               "'strawberry'.count('r')", "\"a b a\".count('a')", "'abc'.upper().count('A')", "len('abc')",
               "'x'.__class__", "import os", "05 + 1", "0.1 + 0.2", "1 2", "abc.count('a')"]

pytestmark = [
    pytest.mark.skipif(not (NANOCHAT / "scripts" / "chat_eval.py").is_file(),
                       reason=f"no nanochat checkout at {NANOCHAT.name}/ (set HFL3_NANOCHAT_DIR)"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, assets):
    pytest.importorskip("tiktoken", reason="nanochat's tokenizer needs tiktoken (pip install tiktoken)")
    base = tmp_path_factory.mktemp("nanochat_base")
    ranks = train_ranks((assets / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:300_000], 491)
    write_tokenizer_pickle(base / "tokenizer", ranks)
    folder = write_checkpoint(base / "chatsft_checkpoints" / "d3", random_weights(SPEC, seed=3), SPEC, step=20)
    write_nanochat_task_data(base, FIXTURES)
    return base, convert(folder, base / "tokenizer", base / "hf")


@pytest.fixture(scope="module")
def nanochat_results(checkpoint):
    base, _ = checkpoint
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, str(REPO / "tests" / "nanochat_chat_eval.py"), str(NANOCHAT), str(MAX_NEW_TOKENS),
         str(BATCH_SIZE), json.dumps(EXPRESSIONS)], env=env, capture_output=True, text=True, timeout=240)
    assert completed.returncode == 0, completed.stderr[-3000:]
    line = next(line for line in completed.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_chatcore_equals_nanochats_chat_eval(checkpoint, nanochat_results):
    _, folder = checkpoint
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    problems = {name: load_problems(name, FIXTURES) for name in TASKS}
    results = evaluate_chatcore(model, tokenizer, problems, max_new_tokens=MAX_NEW_TOKENS, batch_size=BATCH_SIZE)
    ran_out = 0
    for result in results.tasks:
        reference = nanochat_results["tasks"][result.name]
        assert prompt_ids(tokenizer, [p.prompt for p in problems[result.name]]) == reference["prompts"], result.name
        assert result.passed == [p["passed"] for p in reference["problems"]], result.name
        assert result.accuracy == pytest.approx(reference["accuracy"], abs=1e-12), result.name
        if result.kind == "generative":
            assert [result.replies[i] for i in range(len(result.passed))] == [
                p["answer"] for p in reference["problems"]], result.name
            ran_out += result.cut_at_max_new_tokens
    # the guard: replies long enough to differ (most run to the limit), a model that is not constant
    assert ran_out > 0 and len({reply for task in results.tasks for reply in task.replies.values()}) > 5


def test_calculator_equals_nanochats(nanochat_results):
    ours = [None if (value := calculate(expression)) is None else str(value) for expression in EXPRESSIONS]
    assert ours == nanochat_results["calculator"]
    assert sum(value is not None for value in ours) >= 8  # the guard: most expressions give a value
