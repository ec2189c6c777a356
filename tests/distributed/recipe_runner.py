"""Run several recipe invocations inside one `accelerate launch`, for tests/distributed.

    accelerate launch --config_file accelerate_configs/zero2.yaml tests/distributed/recipe_runner.py PLAN.json

On a 2-core CPU, starting the processes (torchrun, then importing torch/transformers/TRL in each rank) costs more
than training the tiny models, so each launch runs a list of runs. A run is exactly what the command line would do:
the recipe file's own `make_parser().parse_args_and_config(args)` and `main(..., given=...)` (which checks them first),
with a fresh parser per run.

PLAN.json: `{"results_dir": DIR, "runs": [{"name": ..., "recipe": "pretrain" | "sft_lora" | "core", "args": [...],
"continue_on_error": false, "as_script": false, "record_rows": false, "record_gradients": false}, ...]}` ("core":
`python -m hfl3.evaluate core ARGS`; `as_script`: inside the recipe's `exit_on_training_error`, as its command line
runs it). Every rank writes `DIR/rank<R>.pid` first (its process id), then per run
`DIR/<name>.rank<R>.json`: the world size that the recipe's `TrainingArguments` set up, the torch.distributed world
size, the metrics `main` returned, and `error` (the exception as text, or null); with `record_rows`, also
`DIR/<name>.rank<R>.rows.jsonl`: per optimizer step, the sha256 (16 hex digits) of every training row the rank
consumed; with `record_gradients`, rank 0 writes `DIR/<name>.gradients.pt`: the gradients of the first optimizer
step, averaged over the ranks and accumulated over the micro-batches, before clipping (`recording_gradients`). A
failing run stops the launch unless it has `continue_on_error` (for runs that fail the same way on every rank: a rank
that failed alone would leave the others waiting in a collective).
"""

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hfl3.distributed import end_distributed_run

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def recording_rows(path: Path):
    """While active, `PretrainTrainer.get_batch_samples` appends the hashes of each step's rows to `path`."""
    from hfl3.trainers.pretraining.trainer import PretrainTrainer

    original = PretrainTrainer.get_batch_samples

    def recording(self, *args):
        batches, num_items_in_batch = original(self, *args)
        rows = [hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16] for b in batches for row in b["input_ids"]]
        with path.open("a") as f:
            f.write(json.dumps(rows) + "\n")
        return batches, num_items_in_batch

    PretrainTrainer.get_batch_samples = recording
    try:
        yield
    finally:
        PretrainTrainer.get_batch_samples = original


@contextlib.contextmanager
def recording_gradients(path: Path):
    """While active, the first optimizer step's gradients of the trainable parameters, as the optimizer would see
    them before clipping, are saved by rank 0 to `path` (`{name: float32 tensor}`, names of the unwrapped model).
    Under DDP or in one process they are read where the Trainer is about to clip them (`Trainer._clip_grad_norm`,
    called with --max_grad_norm > 0, the default); under DeepSpeed, whose `engine.step()` runs inside the backward
    of the last micro-batch, when that step starts (`deepspeed.utils.safe_get_full_grad`, a collective on every
    rank)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad
    from transformers import Trainer

    clip, step = Trainer._clip_grad_norm, DeepSpeedEngine.step
    done = []

    def save(named_parameters, gradient) -> None:
        gradients = {name: gradient(param).detach().float().clone() for name, param in named_parameters
                     if param.requires_grad}
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(gradients, path)
        done.append(True)

    def recording_clip(self, model):
        if not done and not self.is_deepspeed_enabled:
            save(self.model.named_parameters(), lambda param: param.grad)
        return clip(self, model)

    def recording_step(self, *args, **kwargs):
        if not done and self.is_gradient_accumulation_boundary():
            save(self.module.named_parameters(), safe_get_full_grad)
        return step(self, *args, **kwargs)

    Trainer._clip_grad_norm, DeepSpeedEngine.step = recording_clip, recording_step
    try:
        yield
    finally:
        Trainer._clip_grad_norm, DeepSpeedEngine.step = clip, step


def run(plan_path: str) -> None:
    from hfl3.evaluate.__main__ import main as evaluate
    from hfl3.trainers.cli.exits import recipe_exits

    plan = json.loads(Path(plan_path).read_text())
    results_dir = Path(plan["results_dir"])
    rank = int(os.environ.get("RANK", "0"))
    (results_dir / f"rank{rank}.pid").write_text(str(os.getpid()))  # a test stops a lost machine's ranks by these
    for entry in plan["runs"]:
        record = {"name": entry["name"], "rank": rank, "args": entry["args"], "error": None, "metrics": None}
        try:
            if entry["recipe"] == "core":
                record["metrics"] = evaluate(["core", *entry["args"]])
            else:
                recipe = load_recipe(entry["recipe"])
                parser = recipe.make_parser()
                script_args, training_args, model_args = parser.parse_args_and_config(entry["args"])
                record["world_size"] = training_args.world_size
                record["torch_world_size"] = dist.get_world_size() if dist.is_initialized() else 1
                rows = results_dir / f"{entry['name']}.rank{rank}.rows.jsonl"
                gradients = results_dir / f"{entry['name']}.gradients.pt"
                with contextlib.ExitStack() as recording:
                    if entry.get("as_script"):
                        recording.enter_context(recipe_exits())
                    if entry.get("record_rows"):
                        recording.enter_context(recording_rows(rows))
                    if entry.get("record_gradients"):
                        recording.enter_context(recording_gradients(gradients))
                    record["metrics"] = recipe.main(script_args, training_args, model_args,
                                                    parser.given_arguments(entry["args"]))
        except Exception as error:  # recorded for the test, which asserts on the message
            record["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
            if not entry.get("continue_on_error"):
                raise
        finally:
            path = results_dir / f"{entry['name']}.rank{rank}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record, indent=1, default=str))
            path.with_suffix(".tmp").replace(path)
        print(f"[recipe_runner] rank {rank} finished {entry['name']}: error={record['error']}", flush=True)


if __name__ == "__main__":
    run(sys.argv[1])
    end_distributed_run()  # as the recipes end
