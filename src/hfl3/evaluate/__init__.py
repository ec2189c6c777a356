"""Evaluation of causal LMs: the CORE metric (DCLM, arXiv 2406.11794) as nanochat computes it.

- `bundle`: nanochat's eval bundle (`core.yaml`, `eval_data/*.jsonl`, `eval_meta_data.csv`), its seeded subsampling
  and its download into the Hugging Face cache;
- `core`: prompts, token spans, batched scoring, `evaluate_core` for any causal LM and HF tokenizer;
- `callback`: CORE during training (`CoreMetricCallback`, the recipe's argument checks);
- `python -m hfl3.evaluate core --model_name_or_path M ...`: the command line (`hfl3/evaluate/__main__.py`).
"""

from hfl3.evaluate.bundle import CoreBundle, CoreTask, load_core_bundle, resolve_bundle_dir
from hfl3.evaluate.callback import CoreMetricCallback, check_core_arguments, check_core_bundle, core_bundle_for_training
from hfl3.evaluate.core import CoreResults, TaskResult, core_eval_results, evaluate_core, evaluate_task

__all__ = [
    "CoreBundle",
    "CoreMetricCallback",
    "CoreResults",
    "CoreTask",
    "TaskResult",
    "check_core_arguments",
    "check_core_bundle",
    "core_bundle_for_training",
    "core_eval_results",
    "evaluate_core",
    "evaluate_task",
    "load_core_bundle",
    "resolve_bundle_dir",
]
