"""Evaluation of causal LMs as nanochat does it: the CORE metric (DCLM, arXiv 2406.11794) of a base model and the
ChatCORE of a chat model.

- `bundle`: nanochat's eval bundle (`core.yaml`, `eval_data/*.jsonl`, `eval_meta_data.csv`), its seeded subsampling
  and its download into the Hugging Face cache;
- `core`: prompts, token spans, batched scoring, `evaluate_core` for any causal LM and HF tokenizer;
- `callback`: CORE during training (`CoreMetricCallback`, the recipe's argument checks);
- `python -m hfl3.evaluate core --model_name_or_path M ...`: the command line (`hfl3/evaluate/__main__.py`);
- `chat_tasks`: ChatCORE's five tasks (data, shuffle, prompts, answer checks); `chat_generation`: prompts through the
  chat template, letter scoring, batched greedy generation with nanochat's calculator; `execution`: generated code in
  a separate, limited process; `chatcore`: `evaluate_chatcore`; `chat_callback`: ChatCORE during SFT;
- `python -m hfl3.evaluate chatcore --model_name_or_path M ...`: its command line (`chatcore_cli`).
"""

from hfl3.evaluate.bundle import CoreBundle, CoreTask, load_core_bundle, resolve_bundle_dir
from hfl3.evaluate.callback import CoreMetricCallback, check_core_arguments, check_core_bundle, core_bundle_for_training
from hfl3.evaluate.chat_tasks import TASKS as CHAT_TASKS
from hfl3.evaluate.chat_tasks import load_problems
from hfl3.evaluate.chatcore import ChatCoreResults, ChatTaskResult, chatcore_eval_results, evaluate_chatcore
from hfl3.evaluate.core import CoreResults, TaskResult, core_eval_results, evaluate_core, evaluate_task

__all__ = [
    "CHAT_TASKS",
    "ChatCoreResults",
    "ChatTaskResult",
    "CoreBundle",
    "CoreMetricCallback",
    "CoreResults",
    "CoreTask",
    "TaskResult",
    "chatcore_eval_results",
    "check_core_arguments",
    "check_core_bundle",
    "core_bundle_for_training",
    "core_eval_results",
    "evaluate_chatcore",
    "evaluate_core",
    "evaluate_task",
    "load_core_bundle",
    "load_problems",
    "resolve_bundle_dir",
]
