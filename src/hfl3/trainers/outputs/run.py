"""`RunOutputs`: the output folder of one run, as an object the builder constructs (with its config section,
`OutputConfig`) and the trainer holds (`trainer.outputs`); the trainer's hooks (`hfl3.trainers.hooks.TrainerHooks`)
hand it their work in one line each:

| hook | `RunOutputs` |
|---|---|
| `train` | `start` (the folder and resume checkpoint resolved and checked), `end` (the best model to every machine) |
| `_save_checkpoint` | `save_checkpoint` (staged, renamed when whole: `hfl3.trainers.outputs.checkpoints`) |
| `save_model` | `after_save_model` (no `training_args.bin`, provenance and card, an adapter's local base path) |
| `save_state` | `after_save_state` (no local path in the final `trainer_state.json`) |
| `log` | `whole_run_log` (the run's loss sum; whole-run figures after a resume) |
| `finish_output`, `push_output` | `finish` (the final folder staged and committed whole), `push` (uploaded once) |
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from transformers.trainer_utils import speed_metrics

from hfl3.atomic import write_json_atomic
from hfl3.distributed import broadcast_model_from_main, from_main, remove_empty_parents
from hfl3.provenance import portable, stamp_folder
from hfl3.trainers.metrics import LossTally
from hfl3.trainers.outputs import checkpoints
from hfl3.trainers.outputs.folder import STAGING, OutputFolder, commit_folder, prepare_output_dir
from hfl3.trainers.outputs.hub import local_base_model, push_folder

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    """The training arguments the output folder acts on during the run (`from_args`), taken when the trainer is built,
    before it takes `push_to_hub` over (`TrainerHooks.__init__`). Where the run writes and what it resumes from are
    resolved before the run from the same arguments (`prepare_output_dir`).

    Attributes:
        output_dir: the output folder (`--output_dir`), where the final folder is committed.
        push_to_hub, hub_model_id, hub_private_repo, hub_token, hub_revision: the one push, at the end
            (`hub_strategy` "end").
    """

    output_dir: str
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private_repo: bool | None = None
    hub_token: str | None = dataclasses.field(default=None, repr=False)
    hub_revision: str | None = None

    @classmethod
    def from_args(cls, args) -> OutputConfig:
        """The fields of `args` (`TrainingArguments`) named as here."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


class RunOutputs:
    """What a run writes into its output folder, held by the trainer (`trainer.outputs`): staged checkpoints with
    what a resume needs, provenance and card on every saved folder, the final folder committed whole, one push at the
    end. Each method that takes `trainer` is called by one of its hooks (module docstring).

    Args:
        config: the output, save and Hub arguments (`OutputConfig.from_args`).
        folder: where the run writes, as the recipe's `prepare_output_dir` resolved it before any work (the resume
            checkpoint, the replacing run's checkpoint folder, the machines' disks); without it, `start` resolves
            it once, the same way, from the trainer's arguments and `train`'s `resume_from_checkpoint`.

    Attributes:
        folder: the `OutputFolder` of the current `train()` (None before it, unless given).
        resume_checkpoint: the checkpoint `train()` resumes from, or None.
        run_totals: the resumed checkpoint's `{"train_loss_sum", "train_runtime", "global_step"}`, zeros when the run
            started from scratch.
        train_started: when `train()` began (`time.time()`).

    The card of a saved folder is `trainer.model_card(metadata, name)` with the name the output is loaded by
    (`usage_name`); the files whose pushed copy differs are `trainer.hub_files(folder)`: each trainer says what its
    output is.
    """

    def __init__(self, config: OutputConfig, folder: OutputFolder | None = None):
        self.config = config
        self.given_folder = self.folder = folder
        self.resume_checkpoint: str | None = None
        self.run_totals = dict(checkpoints.NO_TOTALS)
        self.train_started = time.time()

    @property
    def path(self) -> Path:
        """The output folder (`--output_dir`)."""
        return Path(self.config.output_dir)

    def usage_name(self, folder: str | os.PathLike | None = None) -> str:
        """The name a card's snippet loads the output by: `hub_model_id` when the run pushes, else the output folder
        (or `folder`) as a path relative to the working directory (`portable`)."""
        if self.config.push_to_hub:
            return self.config.hub_model_id
        return portable(str(Path(folder if folder is not None else self.path)))

    # ---- the run ----

    def start(self, trainer, resume_from_checkpoint: str | bool | None) -> str | None:
        """Before `Trainer.train`: the output folder (the one given, else `prepare_output_dir(args, refuse=False)`
        with `resume_from_checkpoint`: `latest`/`True` = the newest complete checkpoint), the resume checkpoint
        after `checkpoints.check_checkpoint` (`resume_checkpoint`, or None), the run totals and the loss tally reset.
        Returns the checkpoint to resume from."""
        self.folder = self.given_folder
        if self.folder is None:
            asked = copy.copy(trainer.args)
            asked.resume_from_checkpoint = resume_from_checkpoint
            self.folder = prepare_output_dir(asked, refuse=False)
        checkpoint = self.folder.resume_checkpoint
        self.run_totals = dict(checkpoints.NO_TOTALS)
        if checkpoint:
            self.run_totals = checkpoints.check_checkpoint(trainer, checkpoint)
            logger.info("resuming from %s", Path(checkpoint).name)
        self.resume_checkpoint = checkpoint
        self.train_started = time.time()
        trainer.step_metrics.loss = LossTally()
        return checkpoint

    def end(self, trainer, output):
        """After `Trainer.train`: when the best model was loaded at the end (`load_best_model_at_end`), machines that
        do not see rank 0's disk, and so lack the best checkpoint, take rank 0's weights; after a resume the returned
        `training_loss` is the whole run's."""
        if self.folder.disks.writers and from_main(lambda: bool(trainer.args.load_best_model_at_end and
                                                                trainer.state.best_model_checkpoint)):
            broadcast_model_from_main(trainer.accelerator.unwrap_model(trainer.model))
        return output._replace(training_loss=output.metrics["train_loss"]) if self.run_totals["global_step"] else output

    def whole_run_log(self, trainer, logs: dict[str, float]) -> None:
        """Keep the run's loss sum (a training log's `loss` is the mean over the steps since the last one) and, after
        a resume, turn the end-of-training `train_loss` and throughput in `logs` (transformers reports the steps of
        this `train()` call) into whole-run figures, with the checkpoint's `run_totals`."""
        state, totals = trainer.state, self.run_totals
        if "loss" in logs:
            trainer.step_metrics.loss.logged(logs["loss"], state.global_step)
        if "train_loss" in logs and totals["global_step"]:
            steps, resumed = state.global_step, totals["global_step"]
            logs["train_loss"] = (totals["train_loss_sum"] + logs["train_loss"] * (steps - resumed)) / steps
            runtime = logs["train_runtime"] + totals["train_runtime"]
            logs.update(speed_metrics("train", time.time() - runtime, num_steps=steps,
                                      num_samples=trainer.get_total_train_batch_size(trainer.args) * steps))

    # ---- saved folders ----

    def save_checkpoint(self, trainer, write: Callable[[], None]) -> None:
        """`checkpoints.save_checkpoint`: `write()` (`Trainer._save_checkpoint`) staged, renamed when whole, with
        the run's totals so far."""
        checkpoints.save_checkpoint(trainer, self.folder, lambda: self._totals(trainer), write)

    def _totals(self, trainer) -> dict:
        """The run's loss sum, seconds and steps so far (a collective: the loss not yet logged is summed over the
        processes)."""
        loss = trainer.step_metrics.loss
        undrained = loss.undrained(trainer.accelerator)
        return {"train_loss_sum": self.run_totals["train_loss_sum"] + loss.logged_sum + undrained,
                "train_runtime": self.run_totals["train_runtime"] + time.time() - self.train_started,
                "global_step": trainer.state.global_step}

    def after_save_model(self, trainer, folder: Path) -> None:
        """After `Trainer.save_model` into `folder`, on the saving process: the pickled `training_args.bin` removed
        (it would carry `hub_token`; `metadata.json` holds the arguments); when `trainer.provenance` is set, the
        folder stamped (`stamp_folder`: `metadata.json`, the safetensors header, the card of
        `trainer.model_card(provenance, usage_name())`); an adapter's `adapter_config.json` names a local base by its
        absolute path (`local_base_model`)."""
        if not trainer.args.should_save:
            return
        (folder / "training_args.bin").unlink(missing_ok=True)
        if trainer.provenance is not None:
            stamp_folder(folder, trainer.provenance, trainer.model_card(trainer.provenance, self.usage_name()))
        config = folder / "adapter_config.json"
        if config.is_file():
            values = json.loads(config.read_text())
            if values.get("base_model_name_or_path"):
                values["base_model_name_or_path"] = local_base_model(values["base_model_name_or_path"])
                write_json_atomic(config, values)

    def after_save_state(self, trainer) -> None:
        """After `Trainer.save_state`: the written `trainer_state.json` made `portable` (its `best_model_checkpoint`
        is a local path; a checkpoint's own copy keeps it, for resuming)."""
        path = Path(trainer.args.output_dir) / "trainer_state.json"
        if trainer.args.should_save and path.is_file():
            write_json_atomic(path, portable(json.loads(path.read_text())))

    @contextlib.contextmanager
    def finish(self, trainer) -> Iterator[Path]:
        """`with outputs.finish(trainer) as folder:` everything the block writes to `args.output_dir` (`save_model`,
        `save_metrics`, `save_state`, extra files) goes to `_hfl3_staging/final` and replaces the output folder's
        files only when the block completes (`commit_folder`); on an exception nothing is committed. A run that
        replaces another run's folder (`OutputFolder.replacing`) moves its checkpoints in with the final folder and
        every old file out, in the same commit. Call on every process (it synchronises them) after `train`. A machine
        without global rank 0's disk then removes its staging area (a resume copy) and its `output_dir` when that is
        left empty: only machine 0 keeps outputs."""
        args, accelerator, final = trainer.args, trainer.accelerator, self.path
        staged = final / STAGING / "final"
        if args.should_save:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        accelerator.wait_for_everyone()
        with checkpoints.output_dir_as(trainer, staged):
            yield staged
        accelerator.wait_for_everyone()
        folder = self.folder or OutputFolder(final, final)  # finished without train(): nothing to resolve
        if args.should_save:
            commit_folder(staged, final, replace_all=folder.replacing,
                          checkpoints_from=folder.run_dir if folder.replacing else None)
        if args.process_index in folder.disks.writers:
            shutil.rmtree(final / STAGING, ignore_errors=True)
            remove_empty_parents(final / STAGING, stop=final)
        accelerator.wait_for_everyone()

    def push(self, trainer, folder: str | os.PathLike | None = None) -> str | None:
        """Upload the committed output folder (or `folder` inside it, e.g. `merged`) to `hub_model_id` when
        `--push_to_hub` was given (main process; `hub.push_folder`), on the branch `--hub_revision` when given. This
        is `--hub_strategy end`, the one strategy hfl3 runs (the others are refused when the arguments are checked).
        Files that `trainer.hub_files` rewrites are uploaded from a copy in `_hfl3_staging/upload`. Returns the
        commit URL, or None when nothing was pushed."""
        if not (self.config.push_to_hub and trainer.is_world_process_zero()):
            return None
        source = self.path / (folder or "")
        config = self.config
        return push_folder(source, self.path / STAGING / "upload", trainer.hub_files(source), config.hub_model_id,
                           private=config.hub_private_repo, token=config.hub_token, revision=config.hub_revision)
