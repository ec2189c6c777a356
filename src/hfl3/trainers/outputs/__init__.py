"""The output folder of a run: resolved before any work, written during the run, committed whole at its end, pushed
once. Nothing is lost, and nothing of this machine leaks (docs/design.md, decisions 10 and 13).

- `folder`: where a run writes (`prepare_output_dir` -> `OutputFolder`, checked and resolved before any work, the
  resume checkpoint included), which checkpoints are complete, and `commit_folder` (a staged folder moved in whole);
- `run`: `RunOutputs`, the object the builder constructs with its config section (`OutputConfig`) and the trainer
  holds (`trainer.outputs`), to which the trainer's hooks hand the run's outputs: resume, checkpoints, provenance
  and card on every save, the final folder, the push;
- `checkpoints`: the staged checkpoint and what a resume needs (the run's fingerprint and totals);
- `hub`: the push, and an adapter's base named by its Hub id or its absolute path.

The model card's text is `hfl3.provenance.card`'s.
"""

from hfl3.trainers.outputs.folder import (
    CHECKPOINT_FOLDER,
    COMPLETE,
    RUN_STATE,
    STAGING,
    OutputFolder,
    checkpoint_problem,
    commit_folder,
    latest_checkpoint,
    prepare_output_dir,
    resolve_checkpoint,
    safetensors_problem,
    work_dir,
    write_problem,
)
from hfl3.trainers.outputs.hub import base_model_hub_id, local_base_model
from hfl3.trainers.outputs.run import OutputConfig, RunOutputs

__all__ = [
    "CHECKPOINT_FOLDER",
    "COMPLETE",
    "RUN_STATE",
    "STAGING",
    "OutputConfig",
    "OutputFolder",
    "RunOutputs",
    "base_model_hub_id",
    "checkpoint_problem",
    "commit_folder",
    "latest_checkpoint",
    "local_base_model",
    "prepare_output_dir",
    "resolve_checkpoint",
    "safetensors_problem",
    "work_dir",
    "write_problem",
]
