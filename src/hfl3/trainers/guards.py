"""Guards of a training run: the tokenizer-fits-the-model check of SFT (`check_vocabulary_fits`) and the non-finite
loss / gradient-norm stop (`NonFiniteGuard`, a `Trainer` mixin). How a recipe ends when it stops on an error is
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
from accelerate.utils import DistributedType
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
    """`NonFiniteGuard`'s hook: a class of its own, since the Trainer warns when one callback class is added twice
    (the pretraining trainer adds another `BeforeLogSaveEvaluate`)."""


class NonFiniteGuard:
    """Mixin for a `transformers.Trainer` subclass (`class MyTrainer(NonFiniteGuard, Trainer)`): stop training at
    the first non-finite loss or gradient norm with `NonFiniteTrainingError` naming the step, before anything from
    that step on is logged or saved (module docstring: how, without a per-step device sync).

    The loss is the one `training_step` returns (every micro-batch). The gradient norm is the pre-clipping norm that
    transformers 5.23 computes at every optimizer step (also with `max_grad_norm=0`; a Python float under DeepSpeed)
    and hands to no public hook (callbacks see it only in the logs, as a host float): `_get_grad_norm` stays
    overridden to read it, its signature pinned by `tests/test_trainer_hooks.py`. The flags are read, and the error
    raised, by a `BeforeLogSaveEvaluate` callback at the first log, evaluation, save or end of training after the bad
    step, on every process at once (they are gathered); they are cleared when `train()` starts.
    """

    _nonfinite_first: dict[str, torch.Tensor] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(NonFiniteCheck(lambda control: self.check_finite(parameters=control.should_save),
                                                at_train_begin=self._clear_nonfinite))

    def _clear_nonfinite(self) -> None:
        self._nonfinite_first = None  # a new run (or a resumed one) starts clean

    def _nonfinite_slot(self, name: str, device: torch.device) -> torch.Tensor:
        if self._nonfinite_first is None:
            self._nonfinite_first = {}
        if name not in self._nonfinite_first:
            self._nonfinite_first[name] = torch.full((), -1, dtype=torch.long, device=device)
        return self._nonfinite_first[name]

    def _record_nonfinite(self, name: str, value) -> None:
        """Remember the current step (on the device) under `name` if `value` is not finite and none was before."""
        if value is None:
            return
        step = self.state.global_step + 1
        if torch.is_tensor(value):
            value = _local(value.detach())
            first = self._nonfinite_slot(name, value.device)
            bad = ~torch.isfinite(value).all()
            first.masked_fill_(bad.to(first.device) & (first < 0), step)
        elif not math.isfinite(value):  # already a Python number (DeepSpeed's gradient norm)
            first = self._nonfinite_slot(name, self.args.device)
            first.masked_fill_(first < 0, step)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._record_nonfinite("loss", loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._gradients_are_plain_tensors():
            # without clipping, transformers measures the norm with clip_grad_norm_(inf), which also multiplies every
            # gradient by 1 (a read and a write of all of them per step): measure it alone
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._record_nonfinite("gradient norm", grad_norm)
        return grad_norm

    def _gradients_are_plain_tensors(self) -> bool:
        """Whole, unscaled gradients in `.grad` (one process or DDP, no fp16 loss scaling): their norm is the
        norm of the model's gradient."""
        plain = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        return self.accelerator.distributed_type in plain and self.accelerator.scaler is None

    def check_finite(self, parameters: bool = False) -> None:
        """Read the flags (one device sync; a gather across processes when distributed) and raise if a loss or a
        gradient norm was not finite; with `parameters`, also check every parameter (before a save).

        Raises:
            NonFiniteTrainingError: naming the first bad step, what was not finite, and what to do.
        """
        device = self.args.device
        names = ["loss", "gradient norm"]
        flags = [self._nonfinite_slot(name, device).to(device) for name in names]
        if parameters:
            # ZeRO-3 leaves empty placeholders here (the shards live in the engine's flat buffers)
            checks = [torch.isfinite(_local(p.detach())).all().to(device) for p in self.model.parameters() if p.numel()]
            finite = torch.stack(checks).all() if checks else torch.ones((), dtype=torch.bool, device=device)
            names.append("parameters")
            flags.append(torch.where(finite, -1, self.state.global_step))
        steps = torch.stack(flags)  # (k,)
        if self.args.world_size > 1:
            gathered = self.accelerator.gather(steps).view(-1, len(names))  # (world_size, k)
            steps = torch.where(gathered < 0, torch.iinfo(torch.long).max, gathered).min(dim=0).values
            steps = torch.where(steps == torch.iinfo(torch.long).max, -1, steps)
        bad = {name: step for name, step in zip(names, steps.tolist()) if step >= 0}
        if bad:
            raise NonFiniteTrainingError(self._nonfinite_message(bad), min(bad.values()))

    def _nonfinite_message(self, bad: dict[str, int]) -> str:
        if len(bad) > 1:  # a non-finite loss or gradient makes the parameters non-finite: name the cause
            bad.pop("parameters", None)
        first = min(bad.values())
        parts = [("a parameter" if name == "parameters" else f"the {name}") + ("" if step == first else
                 f" (at step {step})") for name, step in sorted(bad.items(), key=lambda item: item[1])]
        newest = None
        if os.path.isdir(self.args.output_dir):
            newest = get_last_checkpoint(self.args.output_dir)
        kept = f"the newest checkpoint is {os.path.basename(newest)}" if newest else "no checkpoint was saved"
        return (f"training diverged at step {first}: {' and '.join(parts)} became NaN or infinite; stopped at step "
                f"{self.state.global_step} before logging or saving anything from the diverged run ({kept}). Lower "
                f"--learning_rate (now {self.args.learning_rate:g}), raise --warmup_steps (now "
                f"{self.args.warmup_steps}), keep --max_grad_norm above 0 (now {self.args.max_grad_norm:g}), or check "
                f"the batch of step {first}; then restart or resume from the newest checkpoint")
