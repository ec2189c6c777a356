"""What a run writes into its output folder, as the trainer's hooks (`hfl3.trainers.hooks.TrainerHooks`) call it;
each function takes the trainer. `hfl3.trainers.outputs` resolves the folder before the run.

- Every checkpoint is written to `output_dir/_hfl3_staging/checkpoints/checkpoint-N` and renamed to
  `output_dir/checkpoint-N` once complete (`save_checkpoint`), with `hfl3_run.json` (`save_resume_state`: the run's
  fingerprint and its loss and time so far); across machines every rank's state is gathered into global rank 0's copy
  first (`hfl3.distributed`), so the checkpoint on machine 0's disk resumes the whole run alone.
- A resume refuses a checkpoint of another model config, tokenizer or data, naming the difference
  (`check_checkpoint`), and reports `train_loss` and throughput over the whole run (`whole_run_log`).
- Every saved folder is stamped with the run's provenance and its card (`after_save_model`); `finish_output` stages
  the final folder and commits it; `push_output` uploads it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, speed_metrics

from hfl3.atomic import write_json_atomic
from hfl3.distributed import broadcast_model_from_main, from_main, gather_files_to_main, remove_empty_parents
from hfl3.provenance import push_folder_to_hub, sha256_records, stamp_folder
from hfl3.trainers.metrics import LossTally
from hfl3.trainers.outputs import (
    CHECKPOINT_FOLDER,
    RUN_STATE,
    STAGING,
    OutputFolder,
    commit_folder,
    local_base_model,
    prepare_output_dir,
)

logger = logging.getLogger(__name__)

NO_TOTALS = {"train_loss_sum": 0.0, "train_runtime": 0.0, "global_step": 0}


def _differences(saved: Mapping, current: Mapping, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {json.dumps(a)[:60]} (checkpoint) vs {json.dumps(b)[:60]} (now)")
    return out


def run_fingerprint(trainer) -> dict:
    """What a resumed run must share with its checkpoint: the model config (without where it was loaded from), the
    tokenizer's sha256 (vocabulary, merges, chat template) and the data (a streamed dataset's `fingerprint()`, else
    the `*_sha256` entries and the `options` of `provenance["data"]`)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Not the architecture: where it was loaded from, what save_pretrained adds, the special-token ids the
    # Trainer aligns with the tokenizer at train start (the tokenizer's sha256 covers them)
    skip = ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "auto_map",
            "bos_token_id", "eos_token_id", "pad_token_id")
    config = {k: v for k, v in model.config.to_dict().items() if k not in skip}
    tokenizer = trainer.processing_class
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tokenizer_text = [backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items()),
                      getattr(tokenizer, "chat_template", None)] if tokenizer is not None else []
    if callable(getattr(trainer.train_dataset, "fingerprint", None)):
        data = trainer.train_dataset.fingerprint()
    else:
        section = (trainer.provenance or {}).get("data") or {}
        data = {k: v for k, v in section.items() if k.endswith("_sha256") and isinstance(v, str)}
        if "options" in section:  # what shaped the rows (masks, truncation, samples): another run's otherwise
            data["options"] = section["options"]
    return json.loads(json.dumps({"model_config": config, "tokenizer_sha256": sha256_records(tokenizer_text),
                                  "data": data}, default=str))


def check_checkpoint(trainer, checkpoint: str | os.PathLike) -> None:
    """Load the run totals of `checkpoint` into `trainer.run_totals` and refuse it when it belongs to another run.

    Raises:
        ValueError: the model config, tokenizer or data differ from the checkpoint's (each difference named).
    """
    path = Path(checkpoint) / RUN_STATE
    if not path.is_file():
        logger.warning("%s has no %s (written before hfl3 checked resumes): not checked", checkpoint, RUN_STATE)
        return
    saved = json.loads(path.read_text())
    differences = _differences(saved["fingerprint"], run_fingerprint(trainer))
    if differences:
        raise ValueError(f"{checkpoint} belongs to another run; it differs in " + "; ".join(differences[:8]) +
                         ". Resume with the model, tokenizer and data it was trained with, or start a new "
                         "--output_dir")
    trainer.run_totals = saved["totals"]


def start_run(trainer, resume_from_checkpoint: str | bool | None) -> str | None:
    """Before `Trainer.train`: the output folder (the one given to the trainer, else `prepare_output_dir(args,
    refuse=False)` with `resume_from_checkpoint`: `latest`/`True` = the newest complete checkpoint), the resume
    checkpoint after `check_checkpoint` (`trainer.resume_checkpoint`, or None), the run totals and the loss tally
    reset. Returns the checkpoint to resume from."""
    trainer.output_folder = trainer.given_output_folder
    if trainer.output_folder is None:
        asked = copy.copy(trainer.args)
        asked.resume_from_checkpoint = resume_from_checkpoint
        trainer.output_folder = prepare_output_dir(asked, refuse=False)
    checkpoint = trainer.output_folder.resume_checkpoint
    trainer.run_totals = dict(NO_TOTALS)
    if checkpoint:
        check_checkpoint(trainer, checkpoint)
        logger.info("resuming from %s", Path(checkpoint).name)
    trainer.resume_checkpoint = checkpoint
    trainer.train_started = time.time()
    trainer.step_metrics.loss = LossTally()
    return checkpoint


def end_run(trainer, output):
    """After `Trainer.train`: when the best model was loaded at the end (`load_best_model_at_end`), machines that do
    not see rank 0's disk, and so lack the best checkpoint, take rank 0's weights; after a resume the returned
    `training_loss` is the whole run's."""
    if trainer.output_folder.disks.writers and from_main(lambda: bool(trainer.args.load_best_model_at_end and
                                                                      trainer.state.best_model_checkpoint)):
        broadcast_model_from_main(trainer.accelerator.unwrap_model(trainer.model))
    return output._replace(training_loss=output.metrics["train_loss"]) if trainer.run_totals["global_step"] else output


def whole_run_log(trainer, logs: dict[str, float]) -> None:
    """Keep the run's loss sum (a training log's `loss` is the mean over the steps since the last one) and, after a
    resume, turn the end-of-training `train_loss` and throughput in `logs` (transformers reports the steps of this
    `train()` call) into whole-run figures, with the checkpoint's `run_totals`."""
    state = trainer.state
    if "loss" in logs:
        trainer.step_metrics.loss.logged(logs["loss"], state.global_step)
    if "train_loss" in logs and trainer.run_totals["global_step"]:
        steps, resumed = state.global_step, trainer.run_totals["global_step"]
        logs["train_loss"] = (trainer.run_totals["train_loss_sum"] + logs["train_loss"] * (steps - resumed)) / steps
        runtime = logs["train_runtime"] + trainer.run_totals["train_runtime"]
        logs.update(speed_metrics("train", time.time() - runtime, num_steps=steps,
                                  num_samples=trainer.get_total_train_batch_size(trainer.args) * steps))


def save_checkpoint(trainer, write) -> None:
    """The Trainer's checkpoint (`write()`: `Trainer._save_checkpoint`), written into the staging folder
    (`args.output_dir` points there meanwhile) and renamed to `checkpoint-N` when complete (every process has written
    its files, `save_resume_state` included); then the old checkpoints rotate as usual. Across machines, what the
    ranks of a machine without global rank 0's disk wrote (their RNG and data-stream states) is moved into rank 0's
    staged checkpoint first (`gather_files_to_main`): the committed checkpoint holds every rank's state, and no staging
    is left there."""
    args, state, accelerator = trainer.args, trainer.state, trainer.accelerator
    run_dir, disks = trainer.output_folder.run_dir, trainer.output_folder.disks
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging = trainer.output_folder.path / STAGING / "checkpoints"
    staged, final = staging / name, run_dir / name
    if (args.should_save or args.process_index in disks.writers) and staged.exists():
        shutil.rmtree(staged)
    accelerator.wait_for_everyone()
    with output_dir_as(trainer, staging):
        write()
    staged_best = state.best_model_checkpoint and Path(state.best_model_checkpoint) == staged
    if staged_best:  # on every process: under DeepSpeed all of them load the best checkpoint at the end
        state.best_model_checkpoint = str(final)
    if args.should_save and staged_best:
        state.save_to_json(str(staged / "trainer_state.json"))
    save_resume_state(trainer, staged)
    accelerator.wait_for_everyone()
    gather_files_to_main(staged, disks, stop=trainer.output_folder.path)
    if args.should_save:
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
        rotate_checkpoints(str(run_dir), args.save_total_limit, state.best_model_checkpoint, use_mtime=False)


def save_resume_state(trainer, folder: Path) -> None:
    """What a resume needs beyond the Trainer's own checkpoint, written on every process into the staged checkpoint
    `folder` before the rename that completes it: `hfl3_run.json` (the run's fingerprint, and its loss sum, seconds
    and steps so far), and a streamed dataset's progress (`trainer.data_progress`: `data_state_rank{R}.safetensors`)."""
    undrained = trainer.step_metrics.loss.undrained(trainer.accelerator)  # a collective: every process is here
    if trainer.args.should_save:
        totals = {"train_loss_sum": trainer.run_totals["train_loss_sum"] + trainer.step_metrics.loss.logged_sum + undrained,
                  "train_runtime": trainer.run_totals["train_runtime"] + time.time() - trainer.train_started,
                  "global_step": trainer.state.global_step}
        write_json_atomic(folder / RUN_STATE, {"fingerprint": run_fingerprint(trainer), "totals": totals})
    if trainer.data_progress is not None:
        trainer.data_progress.save(folder)


@contextlib.contextmanager
def output_dir_as(trainer, folder: str | os.PathLike) -> Iterator[None]:
    """`args.output_dir` is `folder` inside the block: the Trainer writes a checkpoint or the final folder there."""
    previous, trainer.args.output_dir = trainer.args.output_dir, str(folder)
    try:
        yield
    finally:
        trainer.args.output_dir = previous


def after_save_model(trainer, folder: Path) -> None:
    """After `Trainer.save_model` into `folder`, on the saving process: the pickled `training_args.bin` removed (it
    would carry `hub_token`; `metadata.json` holds the arguments); when `provenance` is set, the folder stamped
    (`stamp_folder`: `metadata.json`, the safetensors header, the card of `trainer.model_card(provenance)`); an
    adapter's `adapter_config.json` names a local base by its absolute path (`local_base_model`)."""
    if not trainer.args.should_save:
        return
    (folder / "training_args.bin").unlink(missing_ok=True)
    if trainer.provenance is not None:
        stamp_folder(folder, trainer.provenance, trainer.model_card(trainer.provenance))
    config = folder / "adapter_config.json"
    if config.is_file():
        values = json.loads(config.read_text())
        if values.get("base_model_name_or_path"):
            values["base_model_name_or_path"] = local_base_model(values["base_model_name_or_path"])
            write_json_atomic(config, values)


@contextlib.contextmanager
def finish_output(trainer) -> Iterator[Path]:
    """`with finish_output(trainer) as folder:` everything the block writes to `args.output_dir` (`save_model`,
    `save_metrics`, `save_state`, extra files) goes to `_hfl3_staging/final` and replaces the output folder's files
    only when the block completes (`commit_folder`); on an exception nothing is committed. A run that replaces another
    run's folder (`OutputFolder.replacing`) moves its checkpoints in with the final folder and every old file out, in
    the same commit. Call on every process (it synchronises them) after `train`. A machine without global rank 0's
    disk then removes its staging area (a resume copy) and its `output_dir` when that is left empty: only machine 0
    keeps outputs."""
    args, accelerator = trainer.args, trainer.accelerator
    final = Path(trainer.final_output_dir)
    staged = final / STAGING / "final"
    if args.should_save:
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
    accelerator.wait_for_everyone()
    with output_dir_as(trainer, staged):
        yield staged
    accelerator.wait_for_everyone()
    folder = trainer.output_folder or OutputFolder(final, final)  # finished without train(): nothing to resolve
    if args.should_save:
        commit_folder(staged, final, replace_all=folder.replacing,
                      checkpoints_from=folder.run_dir if folder.replacing else None)
    if args.process_index in folder.disks.writers:
        shutil.rmtree(final / STAGING, ignore_errors=True)
        remove_empty_parents(final / STAGING, stop=final)
    accelerator.wait_for_everyone()


def push_output(trainer, folder: str | os.PathLike | None = None) -> str | None:
    """Upload the committed output folder (or `folder` inside it, e.g. `merged`) to `hub_model_id` when
    `--push_to_hub` was given (main process; huggingface_hub's `upload_folder`, checkpoints and staging left out), on
    the branch `--hub_revision` when given (created if missing: `push_folder_to_hub`). This is `--hub_strategy end`,
    the one strategy hfl3 runs (the others are refused when the arguments are checked). Files that
    `trainer.hub_files` rewrites are uploaded from a copy in `_hfl3_staging/upload` (the other files hard-linked
    there), which is removed afterwards. Returns the commit URL, or None when nothing was pushed."""
    if not (trainer.push_at_end and trainer.is_world_process_zero()):
        return None
    args = trainer.args
    source = Path(trainer.final_output_dir) / (folder or "")
    replaced = trainer.hub_files(source)
    upload = Path(trainer.final_output_dir) / STAGING / "upload"
    if replaced:
        shutil.rmtree(upload, ignore_errors=True)
        shutil.copytree(source, upload, copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(f"{PREFIX_CHECKPOINT_DIR}-*", "merged", STAGING))
        for name, value in replaced.items():
            (upload / name).unlink()  # a hard link: writing through it would change the local file
            write_json_atomic(upload / name, value)
    try:
        return push_folder_to_hub(upload if replaced else source, args.hub_model_id, private=args.hub_private_repo,
                                  token=args.hub_token, revision=args.hub_revision)
    finally:
        if replaced:
            shutil.rmtree(upload, ignore_errors=True)
            with contextlib.suppress(OSError):
                upload.parent.rmdir()


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # the weights are not copied
    except OSError:
        shutil.copy2(source, target)
