"""Guards of a training run: the tokenizer-fits-the-model check of SFT (`check_vocabulary_fits`) and the non-finite
loss / gradient-norm stop (`NonFiniteFlags`, held by the trainer). How a recipe ends when it stops on an error is
`hfl3.trainers.exits`.

The NaN/inf guard costs no device→host synchronisation per step (the pretraining step is kept free of them, decision
12 of docs/design.md): each step compares the loss and the gradient norm with `torch.isfinite` on the device and keeps
the first bad step number in a device tensor (`masked_fill_` with a Python int: no copy, no sync). The flags are read
only where the Trainer synchronises anyway (when it logs, evaluates, saves or stops: `BeforeLogSaveEvaluate`), and
before a save the parameters are checked too, so no checkpoint holds a non-finite tensor and the last good checkpoint
stays the newest one.
"""

from __future__ import annotations

import logging
import math
import os

import pyarrow.compute as pc
import torch
from transformers.trainer_utils import get_last_checkpoint

from hfl3.callbacks import BeforeLogSaveEvaluate

logger = logging.getLogger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """The training loss, the gradient norm or a parameter became NaN or infinite. `step` is the first optimizer
    step (1-based, `state.global_step` after it) where it was seen."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def check_vocabulary_fits(tokenizer, model, datasets=()) -> None:
    """Refuse token ids the model has no embedding row for (the forward would fail with an IndexError, or on a GPU a
    device-side assert, deep in the first step).

    Without `datasets`, every id of the tokenizer (`len(tokenizer)`, added tokens included) must have a row. With
    `datasets` (tokenized `datasets.Dataset`s with `input_ids`; None entries are skipped), the ids that will be fed
    must: the largest id in them and the pad id. A tokenizer larger than the embeddings whose extra ids never occur
    (a GGUF file's tokenizer can carry one more added token than the model has rows) then only warns.

    Raises:
        ValueError: an id that will be (or, without `datasets`, may be) fed is >= the rows of the model's input
            embeddings.
    """
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 (zero.Init) leaves an empty partition here
    if len(tokenizer) <= rows:
        return
    fix = ("Use the model's own tokenizer (drop --tokenizer_name_or_path), or resize the model's embeddings "
           "(model.resize_token_embeddings(len(tokenizer))) and save it first")
    name = model.config.name_or_path or type(model).__name__
    datasets = [dataset for dataset in datasets if dataset is not None]
    if not datasets:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens (with added ones) but the model {name} has {rows} "
                         f"embedding rows: token ids >= {rows} have no embedding. {fix}")
    used = max(_largest_id(dataset) for dataset in datasets)
    used = max(used, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1)
    if used >= rows:
        raise ValueError(f"the data hold token id {used} (tokenizer: {len(tokenizer)} tokens with added ones) but the "
                         f"model {name} has {rows} embedding rows: token ids >= {rows} have no embedding. {fix}")
    logger.warning("the tokenizer has %d tokens but the model %s has %d embedding rows; the data and the pad id "
                   "stay below %d, so training runs", len(tokenizer), name, rows, rows)


def _largest_id(dataset) -> int:
    """The largest token id in a dataset's `input_ids`, read in Arrow batches (memory flat in the data)."""
    largest = -1
    for batch in dataset.with_format("arrow").iter(batch_size=1024):
        value = pc.max(pc.list_flatten(batch["input_ids"])).as_py()
        largest = max(largest, -1 if value is None else value)
    return largest


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor (FSDP2), else the tensor: a non-finite shard makes the whole non-finite, and
    the flags are combined across processes when read."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class NonFiniteCheck(BeforeLogSaveEvaluate):
    """`NonFiniteFlags`' hook: a class of its own, since the Trainer warns when one callback class is added twice
    (the pretraining trainer adds another `BeforeLogSaveEvaluate`)."""


class NonFiniteFlags:
    """The NaN/inf guard's state, held by the trainer (`trainer.nonfinite`, `hfl3.trainers.hooks.TrainerHooks`): the
    first step at which the loss (every micro-batch, as `training_step` returns it) or the gradient norm (the
    pre-clipping norm transformers 5.23 computes at every optimizer step and hands to no public hook: the hooks'
    `_get_grad_norm`, pinned by `tests/test_trainer_hooks.py`) was not finite, kept on the device (module docstring:
    how, without a per-step device sync). `check` reads them, and raises `NonFiniteTrainingError` naming the step,
    from a `NonFiniteCheck` callback at the first log, evaluation, save or end of training after the bad step, on
    every process at once (they are gathered); `clear` when `train()` starts."""

    def __init__(self):
        self.first: dict[str, torch.Tensor] | None = None

    def clear(self) -> None:
        self.first = None  # a new run (or a resumed one) starts clean

    def _slot(self, name: str, device: torch.device) -> torch.Tensor:
        if self.first is None:
            self.first = {}
        if name not in self.first:
            self.first[name] = torch.full((), -1, dtype=torch.long, device=device)
        return self.first[name]

    def record(self, name: str, value, step: int, device: torch.device) -> None:
        """Remember `step` (on the device) under `name` if `value` is not finite and none was before; `device` holds
        the flag of a value that is a Python number (DeepSpeed's gradient norm)."""
        if value is None:
            return
        if torch.is_tensor(value):
            value = _local(value.detach())
            first = self._slot(name, value.device)
            bad = ~torch.isfinite(value).all()
            first.masked_fill_(bad.to(first.device) & (first < 0), step)
        elif not math.isfinite(value):  # already a Python number (DeepSpeed's gradient norm)
            first = self._slot(name, device)
            first.masked_fill_(first < 0, step)

    def check(self, trainer, parameters: bool = False) -> None:
        """Read the flags (one device sync; a gather across processes when distributed) and raise if a loss or a
        gradient norm was not finite; with `parameters`, also check every parameter of `trainer.model` (before a
        save).

        Raises:
            NonFiniteTrainingError: naming the first bad step, what was not finite, and what to do.
        """
        device = trainer.args.device
        names = ["loss", "gradient norm"]
        flags = [self._slot(name, device).to(device) for name in names]
        if parameters:
            # ZeRO-3 leaves empty placeholders here (the shards live in the engine's flat buffers)
            checks = [torch.isfinite(_local(p.detach())).all().to(device) for p in trainer.model.parameters()
                      if p.numel()]
            finite = torch.stack(checks).all() if checks else torch.ones((), dtype=torch.bool, device=device)
            names.append("parameters")
            flags.append(torch.where(finite, -1, trainer.state.global_step))
        steps = torch.stack(flags)  # (k,)
        if trainer.args.world_size > 1:
            gathered = trainer.accelerator.gather(steps).view(-1, len(names))  # (world_size, k)
            steps = torch.where(gathered < 0, torch.iinfo(torch.long).max, gathered).min(dim=0).values
            steps = torch.where(steps == torch.iinfo(torch.long).max, -1, steps)
        bad = {name: step for name, step in zip(names, steps.tolist()) if step >= 0}
        if bad:
            raise NonFiniteTrainingError(_nonfinite_message(trainer, bad), min(bad.values()))


def _nonfinite_message(trainer, bad: dict[str, int]) -> str:
    args = trainer.args
    if len(bad) > 1:  # a non-finite loss or gradient makes the parameters non-finite: name the cause
        bad.pop("parameters", None)
    first = min(bad.values())
    parts = [("a parameter" if name == "parameters" else f"the {name}") + ("" if step == first else
             f" (at step {step})") for name, step in sorted(bad.items(), key=lambda item: item[1])]
    newest = None
    if os.path.isdir(args.output_dir):
        newest = get_last_checkpoint(args.output_dir)
    kept = f"the newest checkpoint is {os.path.basename(newest)}" if newest else "no checkpoint was saved"
    return (f"training diverged at step {first}: {' and '.join(parts)} became NaN or infinite; stopped at step "
            f"{trainer.state.global_step} before logging or saving anything from the diverged run ({kept}). Lower "
            f"--learning_rate (now {args.learning_rate:g}), raise --warmup_steps (now {args.warmup_steps}), keep "
            f"--max_grad_norm above 0 (now {args.max_grad_norm:g}), or check the batch of step {first}; then restart "
            "or resume from the newest checkpoint")
