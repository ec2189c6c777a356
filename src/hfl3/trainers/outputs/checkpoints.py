"""A run's checkpoints, as its output folder (`hfl3.trainers.outputs.run.RunOutputs`) writes and checks them; each
function takes the trainer, for its arguments, state and process group.

- Every checkpoint is written to `output_dir/_hfl3_staging/checkpoints/checkpoint-N` and renamed to
  `checkpoint-N` in the run's checkpoint folder once complete (`save_checkpoint`), with `hfl3_run.json`
  (`save_resume_state`: the run's fingerprint and its loss and time so far); across machines every rank's state is
  gathered into global rank 0's copy first (`hfl3.distributed`), so the checkpoint on machine 0's disk resumes the
  whole run alone.
- A resume refuses a checkpoint of another model config, tokenizer or data, naming the difference
  (`check_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hfl3.atomic import write_json_atomic
from hfl3.distributed import gather_files_to_main
from hfl3.provenance import sha256_records
from hfl3.trainers.outputs.folder import CHECKPOINT_FOLDER, RUN_STATE, STAGING, OutputFolder

logger = logging.getLogger(__name__)

NO_TOTALS = {"train_loss_sum": 0.0, "train_runtime": 0.0, "global_step": 0}
"""The run totals of a run started from scratch (`RunOutputs.run_totals`)."""


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


def check_checkpoint(trainer, checkpoint: str | os.PathLike) -> dict:
    """The run totals saved in `checkpoint` (`NO_TOTALS` when it has no `hfl3_run.json`), after refusing it when it
    belongs to another run.

    Raises:
        ValueError: the model config, tokenizer or data differ from the checkpoint's (each difference named).
    """
    path = Path(checkpoint) / RUN_STATE
    if not path.is_file():
        logger.warning("%s has no %s (written before hfl3 checked resumes): not checked", checkpoint, RUN_STATE)
        return dict(NO_TOTALS)
    saved = json.loads(path.read_text())
    differences = _differences(saved["fingerprint"], run_fingerprint(trainer))
    if differences:
        raise ValueError(f"{checkpoint} belongs to another run; it differs in " + "; ".join(differences[:8]) +
                         ". Resume with the model, tokenizer and data it was trained with, or start a new "
                         "--output_dir")
    return saved["totals"]


def save_checkpoint(trainer, folder: OutputFolder, totals: Callable[[], dict], write: Callable[[], None]) -> None:
    """The Trainer's checkpoint (`write()`: `Trainer._save_checkpoint`), written into the staging folder
    (`args.output_dir` points there meanwhile) and renamed to `checkpoint-N` in `folder.run_dir` when complete (every
    process has written its files, `save_resume_state` with the run's `totals()` included); then the old checkpoints
    rotate as usual. Across machines, what the ranks of a machine without global rank 0's disk wrote (their RNG and
    data-stream states) is moved into rank 0's staged checkpoint first (`gather_files_to_main`): the committed
    checkpoint holds every rank's state, and no staging is left there."""
    args, state, accelerator = trainer.args, trainer.state, trainer.accelerator
    run_dir, disks = folder.run_dir, folder.disks
    name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    staging = folder.path / STAGING / "checkpoints"
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
    save_resume_state(trainer, staged, totals)
    accelerator.wait_for_everyone()
    gather_files_to_main(staged, disks, stop=folder.path)
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


def save_resume_state(trainer, folder: Path, totals: Callable[[], dict]) -> None:
    """What a resume needs beyond the Trainer's own checkpoint, written on every process into the staged checkpoint
    `folder` before the rename that completes it: `hfl3_run.json` (the run's fingerprint, and `totals()`: its loss
    sum, seconds and steps so far; a collective, called on every process), and a streamed dataset's progress
    (`trainer.streamed_data.save`: `data_state_rank{R}.safetensors`)."""
    run_totals = totals()
    if trainer.args.should_save:
        write_json_atomic(folder / RUN_STATE, {"fingerprint": run_fingerprint(trainer), "totals": run_totals})
    if trainer.streamed_data is not None:
        trainer.streamed_data.save(folder)


@contextlib.contextmanager
def output_dir_as(trainer, folder: str | os.PathLike) -> Iterator[None]:
    """`args.output_dir` is `folder` inside the block: the Trainer writes a checkpoint or the final folder there."""
    previous, trainer.args.output_dir = trainer.args.output_dir, str(folder)
    try:
        yield
    finally:
        trainer.args.output_dir = previous
