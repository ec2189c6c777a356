"""Output folders and checkpoints that survive a kill: nothing is lost, and nothing of this machine leaks.

- `prepare_output_dir(args)`: the recipes' first call (made while their arguments are parsed). Refuses a non-empty
  `output_dir` unless the run resumes (`--resume_from_checkpoint latest|true|PATH`) or `--overwrite_output_dir` is
  given, and a push that could not happen; resolves `latest`/`true` to the newest complete checkpoint
  (`latest_checkpoint`); finishes a final folder whose commit was interrupted. Nothing in `output_dir` is touched
  before training.
- `OutputFolderMixin` (a Trainer mixin, with `hfl3.provenance.ProvenanceMixin`): every checkpoint is written to
  `output_dir/_hfl3_staging/checkpoints/checkpoint-N` and renamed to `output_dir/checkpoint-N` once complete, with
  `hfl3_run.json` (the run's fingerprint and its loss and time so far); a resume refuses a checkpoint of another
  model config, tokenizer or data, naming the difference, and reports `train_loss` and throughput over the whole
  run; `finish_output()` stages the final folder and commits it; `push_output()` uploads it.
- An adapter's base model (`SFTOutputs`): the local `adapter_config.json` names a local base by its absolute path,
  the only local path in any output, because PEFT resolves `base_model_name_or_path` against the working directory;
  what is pushed names the base's Hub id (`base_model_hub_id`).

Layout of the staging area, ignored by `get_last_checkpoint`, `rotate_checkpoints` and the Hub upload:
`output_dir/_hfl3_staging/{checkpoints/checkpoint-N, final, previous, work, upload}`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hub_constants
from transformers.trainer_pt_utils import nested_gather
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hfl3.evaluate.core import core_eval_results
from hfl3.provenance import ProvenanceMixin, portable, sha256_records, write_json_atomic
from hfl3.trainers.inputs import is_hub_id

logger = logging.getLogger(__name__)

STAGING = "_hfl3_staging"
RUN_STATE = "hfl3_run.json"
COMPLETE = ".complete"
LATEST = ("latest", "true", "True", "1")
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt)$|.*\.index\.json$")


def work_dir(output_dir: str | os.PathLike) -> Path:
    """`output_dir/_hfl3_staging/work`: where a run shares files between its processes before training (a trained
    tokenizer, generated data) without touching `output_dir`'s own files."""
    return Path(output_dir) / STAGING / "work"


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why checkpoint `folder` cannot be resumed from (no or unreadable `trainer_state.json`, an empty file), or
    None when it is complete."""
    folder = Path(folder)
    try:
        json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError) as error:
        return f"trainer_state.json unreadable ({error.__class__.__name__})"
    empty = sorted(f.name for f in folder.rglob("*") if f.is_file() and f.stat().st_size == 0)
    return f"empty file(s) {', '.join(empty)}" if empty else None


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete `checkpoint-N` in `output_dir` (None if there is none); incomplete ones (written by a
    killed run before checkpoints were staged, or damaged since) and interrupted stagings are skipped with a
    warning."""
    output_dir = Path(output_dir)
    staged = output_dir / STAGING / "checkpoints"
    if staged.is_dir():
        for leftover in sorted(staged.iterdir()):
            logger.warning("skipping %s: interrupted while saving (incomplete, never renamed)", leftover.name)
    checkpoints = [p for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.is_dir() and _CHECKPOINT.match(p.name)]
    for folder in sorted(checkpoints, key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        logger.warning("skipping incomplete checkpoint %s: %s", folder, problem)
    return None


def resolve_checkpoint(output_dir: str | os.PathLike, resume_from_checkpoint: str | bool | None) -> str | None:
    """`resume_from_checkpoint` as a folder: `True`, `"latest"` or `"true"` give `latest_checkpoint(output_dir)`
    (None when there is none), `False`/`"false"`/empty give None, anything else is returned as is."""
    if resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str) and resume_from_checkpoint in LATEST):
        return latest_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    if resume_from_checkpoint in (False, None, "false", "False", ""):
        return None
    return str(resume_from_checkpoint)


def prepare_output_dir(args) -> str | None:
    """Check and resolve where a run writes, before any data or model work. Sets `args.resume_from_checkpoint` to
    the checkpoint folder to resume from (or None) and returns it. The recipes call it while parsing their arguments
    (so a refusal is an argument error, exit status 2) and again first in `main`, where a resolved checkpoint is a
    plain path: nothing is repeated but the checks.

    `--resume_from_checkpoint latest` (or `true`) means the newest complete checkpoint of `output_dir`; with none
    there the run starts from scratch (a warning says so), so a restart loop can always pass it.

    Raises:
        FileExistsError: `output_dir` is a file, or holds files and the run neither resumes nor has
            `--overwrite_output_dir`.
        PermissionError: `output_dir` cannot be created or written (its nearest existing folder is not writable).
        FileNotFoundError: `--resume_from_checkpoint PATH` is not a folder.
        ValueError: `--push_to_hub` without a valid `--hub_model_id`, or offline (`HF_HUB_OFFLINE=1`); the
            checkpoint given is incomplete.
    """
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"--output_dir {output_dir}: is a file; expected a folder (created if missing)")
    existing = next(folder for folder in (output_dir, *output_dir.absolute().parents) if folder.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"--output_dir {output_dir}: {'it' if existing == output_dir else existing} is not "
                              "writable; expected a folder this user can create and write")
    if args.push_to_hub:
        check_push_arguments(args)
    final = output_dir / STAGING / "final"
    if args.should_save and (final / COMPLETE).is_file():
        logger.warning("%s: finishing the commit of a final folder interrupted by a kill", output_dir)
        commit_folder(final, output_dir)
    latest = args.resume_from_checkpoint is True or args.resume_from_checkpoint in LATEST
    resume = resolve_checkpoint(output_dir, args.resume_from_checkpoint)
    if latest and resume is None:
        logger.warning("--resume_from_checkpoint latest: no complete checkpoint in %s; starting from scratch",
                       output_dir)
    elif resume is not None and not latest:
        if not Path(resume).is_dir():
            raise FileNotFoundError(f"--resume_from_checkpoint {resume}: no such folder; expected a checkpoint-N "
                                    "folder, or latest (the newest complete checkpoint in --output_dir)")
        if problem := checkpoint_problem(resume):
            raise ValueError(f"--resume_from_checkpoint {resume}: incomplete checkpoint ({problem}); pass "
                             "--resume_from_checkpoint latest for the newest complete one")
    args.resume_from_checkpoint = resume
    overwrite = getattr(args, "overwrite_output_dir", False)
    present = sorted(p.name for p in output_dir.iterdir() if p.name != STAGING) if output_dir.is_dir() else []
    if resume is None and present and not overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise FileExistsError(
            f"--output_dir {output_dir}: not empty ({shown}); pass --resume_from_checkpoint latest to continue its "
            "run, --overwrite_output_dir to replace it when this run finishes, or another --output_dir")
    return resume


def check_push_arguments(args) -> None:
    """`--push_to_hub` needs a valid `--hub_model_id` and the network, checked before training rather than found
    out at the upload that ends it.

    Raises:
        ValueError: no or an invalid `--hub_model_id`; `HF_HUB_OFFLINE=1`.
    """
    if not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id USER/NAME")
    if not is_hub_id(args.hub_model_id):
        raise ValueError(f"--hub_model_id {args.hub_model_id}: not a Hub repository id; expected USER/NAME")
    if hub_constants.is_offline_mode():
        raise ValueError("--push_to_hub: HF_HUB_OFFLINE=1 is set, so the upload that ends the run would fail; unset "
                         "it, or drop --push_to_hub and upload the output folder later")


def commit_folder(staged: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Move the complete folder `staged` into `folder`, entry by entry, such that `folder` holds weights only when
    every other file of the new version is in place: the old entries that the new ones replace (and any old weight
    file) go to `folder/_hfl3_staging/previous` first, weights first; then the new entries move in, weights last.
    A `.complete` marker in `staged` lets `prepare_output_dir` finish a commit that a kill interrupted. Then the
    whole staging area (`folder/_hfl3_staging`) is removed."""
    staged, folder = Path(staged), Path(folder)
    (staged / COMPLETE).touch()
    previous = folder / STAGING / "previous"
    previous.mkdir(parents=True, exist_ok=True)
    incoming = [p for p in staged.iterdir() if p.name != COMPLETE]
    names = {p.name for p in incoming}
    old = [p for p in folder.iterdir() if p.name != STAGING and (p.name in names or _WEIGHTS.match(p.name))]
    for entry in sorted(old, key=lambda p: not _WEIGHTS.match(p.name)):
        target = previous / entry.name
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        entry.rename(target)
    for entry in sorted(incoming, key=lambda p: bool(_WEIGHTS.match(p.name))):
        entry.rename(folder / entry.name)
    shutil.rmtree(folder / STAGING)  # the run is over: its staged checkpoints and work files go too


def base_model_hub_id(name_or_path: str, given: str | None = None) -> str | None:
    """The Hub id of a base model, for what is pushed to the Hub (its `adapter_config.json` and card): `given`
    (`--base_model_hub_id`); `name_or_path` itself when it is not a local folder (a Hub id); else what the folder
    knows: the `hub_model_id` in its `metadata.json` (an hfl3 pretraining run that named its Hub repository), or the
    repository of a Hugging Face cache snapshot (`.../models--OWNER--NAME/snapshots/REVISION`). None when nothing
    names one."""
    if given:
        return given
    base = Path(name_or_path)
    if not base.is_dir():
        return name_or_path
    with contextlib.suppress(OSError, ValueError, AttributeError):
        hub_id = json.loads((base / "metadata.json").read_text()).get("training_args", {}).get("hub_model_id")
        if hub_id and is_hub_id(hub_id):
            return hub_id
    resolved = base.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name.removeprefix("models--").replace("--", "/")
    return None


def local_base_model(name_or_path: str) -> str:
    """What a locally written `adapter_config.json` names as `base_model_name_or_path`: a local folder as its
    absolute path, because PEFT (`AutoPeftModelForCausalLM`, vLLM, TRL's scripts) resolves it against the working
    directory of whoever loads the adapter; a Hub id as given. The one place an hfl3 output holds a local path: the
    copy pushed to the Hub names the base's Hub id instead (`SFTOutputs.hub_files`)."""
    return str(Path(name_or_path).resolve()) if Path(name_or_path).is_dir() else name_or_path


def _differences(saved: Mapping, current: Mapping, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {json.dumps(a)[:60]} (checkpoint) vs {json.dumps(b)[:60]} (now)")
    return out


class OutputFolderMixin(ProvenanceMixin):
    """Trainer mixin (first in the bases) for crash-safe output folders; see the module docstring.

    `TrainingArguments.push_to_hub` is taken over at construction: the Trainer would otherwise upload unfinished
    checkpoint folders and re-save the model into `output_dir`; `push_output()` uploads the committed folder with
    the same `hub_model_id`, `hub_private_repo`, `hub_token` and `hub_revision`.
    """

    def __init__(self, *args, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.push_at_end = bool(training_args is not None and training_args.push_to_hub)
        if self.push_at_end:
            training_args.push_to_hub = False
        super().__init__(*args, **kwargs)
        self.final_output_dir = self.args.output_dir
        self.run_totals = {"train_loss_sum": 0.0, "train_runtime": 0.0, "global_step": 0}
        self._train_started = time.time()

    # ---- fingerprint and resume ----

    def run_fingerprint(self) -> dict:
        """What a resumed run must share with its checkpoint: the model config (without where it was loaded from),
        the tokenizer's sha256 (vocabulary, merges, chat template) and the data (a streamed dataset's
        `fingerprint()`, else the `*_sha256` entries of `provenance["data"]`)."""
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
        """`Trainer.train`, resuming from `latest`/`True` = the newest complete checkpoint (`latest_checkpoint`),
        after `check_checkpoint`."""
        resume_from_checkpoint = resolve_checkpoint(self.args.output_dir, resume_from_checkpoint)
        if resume_from_checkpoint:
            self.check_checkpoint(resume_from_checkpoint)
        self._stale_checkpoints = [] if resume_from_checkpoint else [
            p for p in Path(self.args.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if _CHECKPOINT.match(p.name)]
        self._train_started = time.time()
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def _run_epoch(self, *args, **kwargs):
        # transformers 5.23, resuming a finished run whose dataset has no length (a stream: num_train_epochs is then
        # unbounded) runs one step past max_steps before it stops; a resume from the last checkpoint trains nothing
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # Whole-run train_loss and throughput after a resume (transformers reports the resumed steps only)
        if self.run_totals["global_step"]:
            self._total_loss_scalar += self.run_totals["train_loss_sum"]
            self._initial_global_step = 0
            start_time -= self.run_totals["train_runtime"]
        return super()._finalize_training(trial, num_train_samples, start_time)

    # ---- checkpoints ----

    def _save_checkpoint(self, model, trial):
        """The Trainer's checkpoint, written into the staging folder and renamed to `checkpoint-N` when complete
        (every process has written its files); then the old checkpoints rotate as usual."""
        run_dir = Path(self._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / STAGING / "checkpoints"
        staged, final = staging / name, run_dir / name
        if self.args.should_save and staged.exists():
            shutil.rmtree(staged)
        self.accelerator.wait_for_everyone()
        undrained = nested_gather(self._tr_loss.detach(), self.args.parallel_mode).mean().item()  # as logged
        self._get_output_dir = lambda trial=None: str(staging)
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        staged_best = self.state.best_model_checkpoint and Path(self.state.best_model_checkpoint) == staged
        if staged_best:  # on every process: under DeepSpeed all of them load the best checkpoint at the end
            self.state.best_model_checkpoint = str(final)
        if self.args.should_save:
            if staged_best:
                self.state.save_to_json(str(staged / "trainer_state.json"))
            totals = {"train_loss_sum": self.run_totals["train_loss_sum"] + self._total_loss_scalar + undrained,
                      "train_runtime": self.run_totals["train_runtime"] + time.time() - self._train_started,
                      "global_step": self.state.global_step}
            write_json_atomic(staged / RUN_STATE, {"fingerprint": self.run_fingerprint(), "totals": totals})
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if final.exists():
                shutil.rmtree(final)
            staged.rename(final)
            for empty in (staging, staging.parent):  # leave no staging folder behind once nothing is staged
                with contextlib.suppress(OSError):
                    empty.rmdir()
            for stale in self._stale_checkpoints:  # --overwrite_output_dir: the old run's, once this one has one
                if stale != final:
                    shutil.rmtree(stale, ignore_errors=True)
            self._stale_checkpoints = []
            rotate_checkpoints(str(run_dir), self.args.save_total_limit, self.state.best_model_checkpoint,
                               use_mtime=False)

    # ---- the final folder ----

    @contextlib.contextmanager
    def finish_output(self) -> Iterator[Path]:
        """`with trainer.finish_output() as folder:` everything the block writes to `args.output_dir` (`save_model`,
        `save_metrics`, `save_state`, extra files) goes to `_hfl3_staging/final` and replaces the output folder's
        files only when the block completes (`commit_folder`); on an exception nothing is committed. Call on every
        process (it synchronises them)."""
        final = Path(self.final_output_dir)
        staged = final / STAGING / "final"
        if self.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        self.args.output_dir = str(staged)
        try:
            yield staged
        finally:
            self.args.output_dir = str(final)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            commit_folder(staged, final)
        self.accelerator.wait_for_everyone()

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
        out). Files that `hub_files` rewrites are uploaded from a copy in `_hfl3_staging/upload` (the other files
        hard-linked there), which is removed afterwards. Returns the commit URL, or None when nothing was pushed."""
        if not (self.push_at_end and self.is_world_process_zero()):
            return None
        from hfl3.provenance import push_folder_to_hub

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
                                      private=self.args.hub_private_repo, token=self.args.hub_token)
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


def usage_name(trainer: OutputFolderMixin, folder: str | os.PathLike | None = None) -> str:
    """The name a card's snippet loads the output by: `hub_model_id` when the run pushes, else the output folder (or
    `folder`) as a path relative to the working directory (`portable`)."""
    if trainer.push_at_end:
        return trainer.args.hub_model_id
    return portable(str(Path(folder if folder is not None else trainer.final_output_dir)))


class L3GPTOutputs(OutputFolderMixin):
    """`OutputFolderMixin` with the pretrained L3GPT's model card."""

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        results = metadata.get("results") or {}
        bpb = results.get("eval_bpb")
        start = results.get("initial_eval_bpb")
        core = (metadata.get("evaluation") or {}).get("core")
        text = (f"L3GPT pretrained with hfl3 on `{portable(str(metadata.get('data', {}).get('source')))}`"
                + (f": validation bpb {bpb:.4f}" if bpb is not None else "")
                + (f" (from {start:.4f} at step 0)" if start is not None else "")
                + (f"; CORE {core['core_metric']:.4f} over {len(core['results'])} tasks" if core else "") + ".\n\n"
                f"```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f"model = AutoModelForCausalLM.from_pretrained({usage_name(self)!r}, trust_remote_code=True)  "
                f"# or `import hfl3` first\n"
                "# AutoTokenizer reads config.json, whose auto_map names remote code: say so, or it asks [y/N]\n"
                f"tokenizer = AutoTokenizer.from_pretrained({usage_name(self)!r}, trust_remote_code=True)\n```")
        card = {"title": "L3GPT (hfl3)", "extra_markdown": text, "tags": ("hfl3", "l3gpt")}
        if core:  # the model-index of the Hub's evaluation results
            card.update(eval_results=core_eval_results(core), model_name=Path(usage_name(self)).name)
        return card


class SFTOutputs(OutputFolderMixin):
    """`OutputFolderMixin` for LoRA adapters: the adapter card, and `adapter_config.json`'s
    `base_model_name_or_path`: locally the base's absolute path when it is a local folder (`local_base_model`), in the
    copy pushed to the Hub the base's Hub id (`hub_files`). The Hub id comes from `provenance["base_model"]["hub_id"]`
    (the recipe's `--base_model_hub_id`, or `base_model_hub_id`)."""

    def _save(self, output_dir: str | None = None, state_dict=None):
        super()._save(output_dir, state_dict)
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


def sft_model_card(metadata: Mapping[str, Any], name: str, adapter: bool) -> dict:
    """`write_model_card` arguments for an SFT output loaded as `name` (a Hub id, or a folder relative to the working
    directory): the snippet that loads it, the results. The base is named by its Hub id when known
    (`metadata["base_model"]["hub_id"]`), else as the local folder it was."""
    base = metadata.get("base_model") or {}
    hub_id = base.get("hub_id")
    shown = hub_id or portable(str(base.get("name_or_path")))
    register = ("import hfl3  # registers L3GPT; without hfl3 pass trust_remote_code=True to from_pretrained\n"
                if base.get("model_type") == "l3gpt" else "")
    if adapter:
        usage = (f"LoRA adapter of `{shown}`{'' if hub_id else ' (a local folder)'}, trained with hfl3's "
                 f"`recipes/sft_lora.py` (loss on assistant tokens only).\n\n```python\n{register}"
                 f"from peft import AutoPeftModelForCausalLM\n"
                 f"model = AutoPeftModelForCausalLM.from_pretrained({name!r})\n```")
        if not hub_id:
            usage += ("\n\n`adapter_config.json` names the base folder by its absolute path (PEFT resolves a relative "
                      "one against the working directory), so the adapter loads from any working directory on this "
                      "machine; if the base folder moves, update `base_model_name_or_path` there.")
    else:
        usage = (f"Full model: `{shown}` with the LoRA adapter merged in, trained with hfl3's `recipes/sft_lora.py`."
                 f"\n\n```python\n{register}from transformers import AutoModelForCausalLM\n"
                 f"model = AutoModelForCausalLM.from_pretrained({name!r})\n```")
    results = metadata.get("results")
    if results:
        usage += "\n\n## Results\n\n" + "\n".join(f"- {k}: {v}" for k, v in sorted(results.items()))
    return {"title": f"{Path(name).name} (LoRA SFT of {Path(shown).name if not hub_id else hub_id})",
            "extra_markdown": usage, "library_name": "peft" if adapter else "transformers",
            "tags": ("hfl3", "sft", "lora", "trl"), "base_model": hub_id}
