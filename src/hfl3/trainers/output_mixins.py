"""The Trainer side of output folders (`hfl3.trainers.outputs` has the functions): `OutputFolderMixin` and its two
flavours, `PretrainOutputs` (pretraining) and `SFTOutputs` (LoRA adapters).

- Every checkpoint is written to `output_dir/_hfl3_staging/checkpoints/checkpoint-N` and renamed to
  `output_dir/checkpoint-N` once complete, with `hfl3_run.json` (the run's fingerprint and its loss and time so far);
  across machines every rank's state is gathered into global rank 0's copy first (`hfl3.distributed`), so the
  checkpoint on machine 0's disk resumes the whole run alone.
- Every saved folder is stamped with the run's provenance (`hfl3.provenance`); a resume refuses a checkpoint of
  another model config, tokenizer or data, naming the difference, and reports `train_loss` and throughput over the
  whole run; `finish_output()` stages the final folder and commits it; `push_output()` uploads it.
- `PretrainOutputs` and `SFTOutputs` add their model's card (`hfl3.trainers.cards`); `SFTOutputs` names the adapter's base
  model as `hfl3.trainers.outputs.local_base_model` / `base_model_hub_id` say.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, speed_metrics

from hfl3.atomic import write_json_atomic
from hfl3.callbacks import save_loss_png
from hfl3.distributed import broadcast_model_from_main, from_main, gather_files_to_main, remove_empty_parents
from hfl3.provenance import portable, push_folder_to_hub, sha256_records, stamp_folder
from hfl3.trainers.cards import l3gpt_model_card, sft_model_card, usage_name
from hfl3.trainers.outputs import (
    CHECKPOINT_FOLDER,
    RUN_STATE,
    STAGING,
    OutputFolder,
    base_model_hub_id,
    commit_folder,
    local_base_model,
    prepare_output_dir,
)

logger = logging.getLogger(__name__)

_NO_TOTALS = {"train_loss_sum": 0.0, "train_runtime": 0.0, "global_step": 0}


def _differences(saved: Mapping, current: Mapping, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {json.dumps(a)[:60]} (checkpoint) vs {json.dumps(b)[:60]} (now)")
    return out


class OutputFolderMixin:
    """Trainer mixin (before `Trainer`/`SFTTrainer` in the bases) for crash-safe output folders that carry their
    provenance; see the module docstring.

    Public hooks only, but one: `train` (resolves `latest`, refuses another run's checkpoint), `training_step` and
    `log` (the run's loss, reported over the whole run after a resume), `get_batch_samples` (a finished run trains
    nothing more), `save_model` (no `training_args.bin`; `metadata.json`, safetensors header and model card when
    `provenance` is set), `create_model_card`, `save_metrics`, `save_state`. `_save_checkpoint` stays overridden:
    the staged write and the rename that completes it must wrap the Trainer's whole checkpoint, which no public hook
    does (`on_save` runs after it; `tests/test_trainer_hooks.py` pins its signature).

    `TrainingArguments.push_to_hub` is taken over at construction: the Trainer would otherwise upload unfinished
    checkpoint folders and re-save the model into `output_dir`; `push_output()` uploads the committed folder once,
    at the end (`hub_strategy` "end"), with the same `hub_model_id`, `hub_private_repo`, `hub_token` and
    `hub_revision` (the branch, created if missing).

    Args:
        output_folder: where the run writes, as the recipe's `prepare_output_dir` resolved it before any work (the
            resume checkpoint, the replacing run's checkpoint folder, the machines' disks); without it, `train`
            resolves it once, the same way, from `args.output_dir` and its `resume_from_checkpoint` argument.

    Attributes:
        provenance: a `build_metadata` dict stamped into every saved folder, or None (nothing stamped).
        run_totals: the resumed checkpoint's `{"train_loss_sum", "train_runtime", "global_step"}`, zeros when the
            run started from scratch.
    """

    provenance: dict | None = None

    def __init__(self, *args, output_folder: OutputFolder | None = None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.push_at_end = bool(training_args is not None and training_args.push_to_hub)
        if self.push_at_end:
            training_args.push_to_hub = False
        super().__init__(*args, **kwargs)
        self.output_folder = self._given_output_folder = output_folder
        self.final_output_dir = self.args.output_dir
        self.run_totals = dict(_NO_TOTALS)
        self._train_started = time.time()
        self._run_loss = _LossTally()

    # ---- fingerprint and resume ----

    def run_fingerprint(self) -> dict:
        """What a resumed run must share with its checkpoint: the model config (without where it was loaded from),
        the tokenizer's sha256 (vocabulary, merges, chat template) and the data (a streamed dataset's
        `fingerprint()`, else the `*_sha256` entries and the `options` of `provenance["data"]`)."""
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        # Not the architecture: where it was loaded from, what save_pretrained adds, the special-token ids the
        # Trainer aligns with the tokenizer at train start (the tokenizer's sha256 covers them)
        skip = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "auto_map",
                "bos_token_id", "eos_token_id", "pad_token_id")
        config = {k: v for k, v in model.config.to_dict().items() if k not in skip}
        tokenizer = self.processing_class
        backend = getattr(tokenizer, "backend_tokenizer", None)
        tokenizer_text = [backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
                          getattr(tokenizer, "chat_template", None)] if tokenizer is not None else []
        if callable(getattr(self.train_dataset, "fingerprint", None)):
            data = self.train_dataset.fingerprint()
        else:
            section = (self.provenance or {}).get("data") or {}
            data = {k: v for k, v in section.items() if k.endswith("_sha256") and isinstance(v, str)}
            if "options" in section:  # what shaped the rows (masks, truncation, samples): another run's otherwise
                data["options"] = section["options"]
        return json.loads(json.dumps({"model_config": config, "tokenizer_sha256": sha256_records(tokenizer_text),
                                      "data": data}, default=str))

    def check_checkpoint(self, checkpoint: str | os.PathLike) -> None:
        """Load the run totals of `checkpoint` and refuse it when it belongs to another run.

        Raises:
            ValueError: the model config, tokenizer or data differ from the checkpoint's (each difference named).
        """
        path = Path(checkpoint) / RUN_STATE
        if not path.is_file():
            logger.warning("%s has no %s (written before hfl3 checked resumes): not checked", checkpoint, RUN_STATE)
            return
        saved = json.loads(path.read_text())
        differences = _differences(saved["fingerprint"], self.run_fingerprint())
        if differences:
            raise ValueError(f"{checkpoint} belongs to another run; it differs in " + "; ".join(differences[:8]) +
                             ". Resume with the model, tokenizer and data it was trained with, or start a new "
                             "--output_dir")
        self.run_totals = saved["totals"]

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, resuming from the checkpoint the output folder resolved (`output_folder`, else
        `prepare_output_dir(args, refuse=False)` with `resume_from_checkpoint`: `latest`/`True` = the newest complete
        checkpoint), after `check_checkpoint`; the folder (or None) is `self.resume_checkpoint` while it runs. After a
        resume, `train_loss` and the throughput cover the whole run (`log`). When the best model was loaded at the
        end (`load_best_model_at_end`), machines that do not see rank 0's disk, and so lack the best checkpoint, take
        rank 0's weights."""
        self.output_folder = self._given_output_folder
        if self.output_folder is None:
            asked = copy.copy(self.args)
            asked.resume_from_checkpoint = resume_from_checkpoint
            self.output_folder = prepare_output_dir(asked, refuse=False)
        checkpoint = self.output_folder.resume_checkpoint
        self.run_totals = dict(_NO_TOTALS)
        if checkpoint:
            self.check_checkpoint(checkpoint)
            logger.info("resuming from %s", Path(checkpoint).name)
        self.resume_checkpoint = checkpoint
        self._train_started = time.time()
        self._run_loss = _LossTally()
        output = super().train(checkpoint or None, *args, **kwargs)
        if self.output_folder.disks.writers and from_main(lambda: bool(self.args.load_best_model_at_end and
                                                                       self.state.best_model_checkpoint)):
            broadcast_model_from_main(self.accelerator.unwrap_model(self.model))
        return output._replace(training_loss=output.metrics["train_loss"]) if self.run_totals["global_step"] else output

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._run_loss.add(loss, self.state.global_step)
        return loss

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The Trainer's batches for the next optimizer step; none once `max_steps` is reached. transformers 5.23,
        resuming a finished run whose dataset has no length (a stream: the epochs are then unbounded), would train
        one step past `max_steps`; with no batch its loop stops before a step."""
        if 0 < self.state.max_steps <= self.state.global_step:
            logger.info("step %d of max_steps %d: nothing left to train", self.state.global_step, self.state.max_steps)
            self.control.should_training_stop = True
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log`, keeping the run's loss sum (a training log's `loss` is the mean over the steps since the
        last one) and, after a resume, turning the end-of-training `train_loss` and throughput (transformers reports
        the steps of this `train()` call) into whole-run figures, with the checkpoint's `run_totals`."""
        if "loss" in logs:
            self._run_loss.logged(logs["loss"], self.state.global_step)
        if "train_loss" in logs and self.run_totals["global_step"]:
            steps, resumed = self.state.global_step, self.run_totals["global_step"]
            logs["train_loss"] = (self.run_totals["train_loss_sum"] + logs["train_loss"] * (steps - resumed)) / steps
            runtime = logs["train_runtime"] + self.run_totals["train_runtime"]
            logs.update(speed_metrics("train", time.time() - runtime, num_steps=steps,
                                      num_samples=self.get_total_train_batch_size(self.args) * steps))
        super().log(logs, start_time)

    # ---- checkpoints ----

    def _save_checkpoint(self, model, trial):
        """The Trainer's checkpoint, written into the staging folder (`args.output_dir` points there meanwhile) and
        renamed to `checkpoint-N` when complete (every process has written its files, `save_resume_state`
        included); then the old checkpoints rotate as usual. Across machines, what the ranks of a machine without
        global rank 0's disk wrote (their RNG and data-stream states) is moved into rank 0's staged checkpoint first
        (`gather_files_to_main`): the committed checkpoint holds every rank's state, and no staging is left there."""
        run_dir, disks = self.output_folder.run_dir, self.output_folder.disks
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = self.output_folder.path / STAGING / "checkpoints"
        staged, final = staging / name, run_dir / name
        if (self.args.should_save or self.args.process_index in disks.writers) and staged.exists():
            shutil.rmtree(staged)
        self.accelerator.wait_for_everyone()
        with self._output_dir(staging):
            super()._save_checkpoint(model, trial)
        staged_best = self.state.best_model_checkpoint and Path(self.state.best_model_checkpoint) == staged
        if staged_best:  # on every process: under DeepSpeed all of them load the best checkpoint at the end
            self.state.best_model_checkpoint = str(final)
        if self.args.should_save and staged_best:
            self.state.save_to_json(str(staged / "trainer_state.json"))
        self.save_resume_state(staged)
        self.accelerator.wait_for_everyone()
        gather_files_to_main(staged, disks, stop=self.output_folder.path)
        if self.args.should_save:
            if final.exists():
                shutil.rmtree(final)
            run_dir.mkdir(parents=True, exist_ok=True)
            staged.rename(final)
            for entry in staging.iterdir():  # what the Trainer wrote beside the checkpoint (TRL's card) goes on
                if not CHECKPOINT_FOLDER.match(entry.name):
                    entry.replace(run_dir / entry.name)
            for empty in (staging, staging.parent):  # leave no staging folder behind once nothing is staged
                with contextlib.suppress(OSError):
                    empty.rmdir()
            rotate_checkpoints(str(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint,
                               use_mtime=False)

    def save_resume_state(self, folder: Path) -> None:
        """What a resume needs beyond the Trainer's own checkpoint, written on every process into the staged
        checkpoint `folder` before the rename that completes it: `hfl3_run.json` (the run's fingerprint, and its loss
        sum, seconds and steps so far). Subclasses add their own state (`PretrainTrainer`: the data stream's)."""
        undrained = self._run_loss.undrained(self.accelerator)  # a collective: every process is here
        if self.args.should_save:
            totals = {"train_loss_sum": self.run_totals["train_loss_sum"] + self._run_loss.logged_sum + undrained,
                      "train_runtime": self.run_totals["train_runtime"] + time.time() - self._train_started,
                      "global_step": self.state.global_step}
            write_json_atomic(folder / RUN_STATE, {"fingerprint": self.run_fingerprint(), "totals": totals})

    # ---- saved folders ----

    @contextlib.contextmanager
    def _output_dir(self, folder: str | os.PathLike) -> Iterator[None]:
        """`args.output_dir` is `folder` inside the block: the Trainer writes a checkpoint or the final folder there."""
        previous, self.args.output_dir = self.args.output_dir, str(folder)
        try:
            yield
        finally:
            self.args.output_dir = previous

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        """Keyword arguments of `write_model_card` besides the folder and metadata; subclasses describe their model."""
        return {"title": Path(self.final_output_dir).name, "tags": ("hfl3",)}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model` (every checkpoint and the final folder), then, on the saving process: the pickled
        `training_args.bin` removed (it would carry `hub_token`; `metadata.json` holds the arguments) and, when
        `provenance` is set, the folder stamped (`stamp_folder`: `metadata.json`, the safetensors header, the card
        of `model_card(provenance)`)."""
        super().save_model(output_dir, _internal_call)
        folder = Path(output_dir if output_dir is not None else self.args.output_dir)
        if self.args.should_save:
            (folder / "training_args.bin").unlink(missing_ok=True)
            if self.provenance is not None:
                stamp_folder(folder, self.provenance, self.model_card(self.provenance))

    def create_model_card(self, *args, **kwargs):
        """The Trainer's card when there is no `provenance`; else nothing here: the card travels with the saved
        weights (`save_model`), and TRL calls this into `output_dir` before every checkpoint."""
        if self.provenance is None:
            return super().create_model_card(*args, **kwargs)
        return None

    @contextlib.contextmanager
    def finish_output(self) -> Iterator[Path]:
        """`with trainer.finish_output() as folder:` everything the block writes to `args.output_dir` (`save_model`,
        `save_metrics`, `save_state`, extra files) goes to `_hfl3_staging/final` and replaces the output folder's
        files only when the block completes (`commit_folder`); on an exception nothing is committed. A run that
        replaces another run's folder (`OutputFolder.replacing`) moves its checkpoints in with the final folder and
        every old file out, in the same commit. Call on every process (it synchronises them) after `train`. A
        machine without global rank 0's disk then removes its staging area (a resume copy) and its `output_dir` when
        that is left empty: only machine 0 keeps outputs."""
        final = Path(self.final_output_dir)
        staged = final / STAGING / "final"
        if self.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        with self._output_dir(staged):
            yield staged
        self.accelerator.wait_for_everyone()
        folder = self.output_folder or OutputFolder(final, final)  # finished without train(): nothing to resolve
        if self.args.should_save:
            commit_folder(staged, final, replace_all=folder.replacing,
                          checkpoints_from=folder.run_dir if folder.replacing else None)
        if self.args.process_index in folder.disks.writers:
            shutil.rmtree(final / STAGING, ignore_errors=True)
            remove_empty_parents(final / STAGING, stop=final)
        self.accelerator.wait_for_everyone()

    def save_loss_plot(self, metrics: Sequence[str] = ("loss", "eval_loss")) -> None:
        """`loss.png` in `args.output_dir` (inside `finish_output`, the staged folder): `metrics` over the steps of
        the log history, written by the main process (`hfl3.callbacks.save_loss_png`: a warning when none was
        logged)."""
        if self.is_world_process_zero():
            save_loss_png(self.state.log_history, self.args.output_dir, metrics)

    def save_metrics(self, split, metrics, combined=True):
        """`Trainer.save_metrics` with the values made `portable` (a `best_model_checkpoint` is a local path)."""
        super().save_metrics(split, portable(metrics), combined)

    def save_state(self):
        """`Trainer.save_state`, then the written `trainer_state.json` made `portable` (its `best_model_checkpoint`
        is a local path; a checkpoint's own copy keeps it, for resuming)."""
        super().save_state()
        path = Path(self.args.output_dir) / "trainer_state.json"
        if self.args.should_save and path.is_file():
            write_json_atomic(path, portable(json.loads(path.read_text())))

    def hub_files(self, folder: Path) -> dict[str, Any]:
        """Files of `folder` whose pushed copy differs from the local one: `{name: JSON value}` (none here)."""
        return {}

    def push_output(self, folder: str | os.PathLike | None = None) -> str | None:
        """Upload the committed output folder (or `folder` inside it, e.g. `merged`) to `hub_model_id` when
        `--push_to_hub` was given (main process; huggingface_hub's `upload_folder`, checkpoints and staging left
        out), on the branch `--hub_revision` when given (created if missing: `push_folder_to_hub`). This is
        `--hub_strategy end`, the one strategy hfl3 runs (the others are refused when the arguments are checked).
        Files that `hub_files` rewrites are uploaded from a copy in `_hfl3_staging/upload` (the other files
        hard-linked there), which is removed afterwards. Returns the commit URL, or None when nothing was pushed."""
        if not (self.push_at_end and self.is_world_process_zero()):
            return None
        source = Path(self.final_output_dir) / (folder or "")
        replaced = self.hub_files(source)
        upload = Path(self.final_output_dir) / STAGING / "upload"
        if replaced:
            shutil.rmtree(upload, ignore_errors=True)
            shutil.copytree(source, upload, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns(f"{PREFIX_CHECKPOINT_DIR}-*", "merged", STAGING))
            for name, value in replaced.items():
                (upload / name).unlink()  # a hard link: writing through it would change the local file
                write_json_atomic(upload / name, value)
        try:
            return push_folder_to_hub(upload if replaced else source, self.args.hub_model_id,
                                      private=self.args.hub_private_repo, token=self.args.hub_token,
                                      revision=self.args.hub_revision)
        finally:
            if replaced:
                shutil.rmtree(upload, ignore_errors=True)
                with contextlib.suppress(OSError):
                    upload.parent.rmdir()


class _LossTally:
    """The training loss of one `train()` call as the Trainer reports it, kept without its private accumulators:
    `logged_sum`, the sum of the per-step losses already logged (a log's `loss` times the steps it averages), and on
    the device the micro-batch losses since the last log (no host sync per step)."""

    def __init__(self):
        self.logged_sum, self.since_log, self.last_logged_step = 0.0, None, None

    def add(self, loss: torch.Tensor, step: int) -> None:
        if self.since_log is None:
            self.since_log, self.last_logged_step = torch.zeros((), device=loss.device), step
        self.since_log += loss.detach()

    def logged(self, mean_loss: float, step: int) -> None:
        if self.since_log is not None:
            self.logged_sum += mean_loss * (step - self.last_logged_step)
            self.last_logged_step = step
            self.since_log.zero_()

    def undrained(self, accelerator) -> float:
        """The not yet logged part, averaged over processes as the Trainer's next log will (a collective)."""
        if self.since_log is None:
            return 0.0
        return accelerator.gather(self.since_log[None]).mean().item()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # the weights are not copied
    except OSError:
        shutil.copy2(source, target)


class PretrainOutputs(OutputFolderMixin):
    """`OutputFolderMixin` with the pretrained L3GPT's model card."""

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        return l3gpt_model_card(metadata, usage_name(self))


class SFTOutputs(OutputFolderMixin):
    """`OutputFolderMixin` for LoRA adapters: the adapter card, and `adapter_config.json`'s
    `base_model_name_or_path`: locally the base's absolute path when it is a local folder (`local_base_model`), in the
    copy pushed to the Hub the base's Hub id (`hub_files`). The Hub id comes from `provenance["base_model"]["hub_id"]`
    (the recipe's `--base_model_hub_id`, or `base_model_hub_id`)."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        config = Path(output_dir if output_dir is not None else self.args.output_dir) / "adapter_config.json"
        if self.args.should_save and config.is_file():
            values = json.loads(config.read_text())
            if values.get("base_model_name_or_path"):
                values["base_model_name_or_path"] = local_base_model(values["base_model_name_or_path"])
                write_json_atomic(config, values)

    def base_hub_id(self, local_name: str | None = None) -> str | None:
        """The base model's Hub id: `provenance["base_model"]["hub_id"]`, else `base_model_hub_id(local_name)`."""
        known = ((self.provenance or {}).get("base_model") or {}).get("hub_id")
        return known or (base_model_hub_id(local_name) if local_name else None)

    def hub_files(self, folder: Path) -> dict[str, Any]:
        """The pushed `adapter_config.json` names the base's Hub id, never a local path.

        Raises:
            ValueError: the base is a local folder with no known Hub id (the recipe refuses this before training).
        """
        config = folder / "adapter_config.json"
        if not config.is_file():
            return {}
        values = json.loads(config.read_text())
        hub_id = self.base_hub_id(values.get("base_model_name_or_path"))
        if hub_id is None:
            raise ValueError(f"not pushed: the base model {portable(values.get('base_model_name_or_path'))} is a "
                             "local folder with no Hub id; pass --base_model_hub_id USER/NAME")
        return {"adapter_config.json": {**values, "base_model_name_or_path": hub_id}}

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        return sft_model_card(metadata, usage_name(self), adapter=True)
