"""The numbers of each training step, kept on the device and read only where the Trainer synchronises anyway:
`StepMetrics`, held by the trainer (`trainer.step_metrics`, `hfl3.trainers.hooks.TrainerHooks`): the NaN/inf guard
(`NonFiniteFlags`), the run's loss (`LossTally`) and the host count of input tokens; and `BeforeLogSaveEvaluate`, the
point where they are read.

The step is kept free of device→host synchronisations (docs/design.md, decision 12): each step compares the loss and
the gradient norm with `torch.isfinite` on the device and keeps the first bad step number in a device tensor
(`masked_fill_` with a Python int: no copy, no sync), adds the loss to a device tensor, and counts input tokens on the
host (`numel`). The flags are read, the loss drained and the tokens summed across processes only where the Trainer
synchronises anyway (when it logs, evaluates, saves or stops: `BeforeLogSaveEvaluate`); before a save the parameters
are checked too, so no checkpoint holds a non-finite tensor and the last good checkpoint stays the newest one. How a
recipe ends when it stops on a non-finite value is `hfl3.trainers.exits`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint


class StepMetrics:
    """What hfl3 records at every step, on the device or the host, without a sync (module docstring).

    Attributes:
        nonfinite: the first non-finite loss and gradient norm (`NonFiniteFlags`).
        loss: the run's training loss as the Trainer reports it (`LossTally`; a new one at every `train()`).
        pending_input_tokens: input tokens counted on this process since they were last summed
            (`sum_input_tokens`).
    """

    def __init__(self):
        self.nonfinite = NonFiniteFlags()
        self.loss = LossTally()
        self.pending_input_tokens = 0

    def record_loss(self, loss: torch.Tensor, step: int, device: torch.device) -> None:
        """A micro-batch's loss of the optimizer step after `step` (`state.global_step`): tallied, and flagged if not
        finite."""
        self.loss.add(loss, step)
        self.nonfinite.record("loss", loss, step + 1, device)

    def record_grad_norm(self, grad_norm, step: int, device: torch.device) -> None:
        """The pre-clipping gradient norm of the optimizer step after `step`: flagged if not finite."""
        self.nonfinite.record("gradient norm", grad_norm, step + 1, device)

    def count_input_tokens(self, tokens: int) -> None:
        self.pending_input_tokens += tokens

    def sum_input_tokens(self, trainer) -> None:
        """Add the input tokens counted since the last call, summed across processes (a collective: every process
        reaches it at the same step), to `trainer.state.num_input_tokens_seen`."""
        pending = self.pending_input_tokens
        if trainer.args.world_size > 1:
            pending = int(trainer.accelerator.gather(torch.tensor([pending], device=trainer.args.device)).sum())
        trainer.state.num_input_tokens_seen += pending
        self.pending_input_tokens = 0


class BeforeLogSaveEvaluate(TrainerCallback):
    """Calls `hook(control)` on every process where the Trainer is about to log, evaluate, save or stop: at the end
    of an optimizer step or of an epoch whose `control` asks for one of them (the flags that `DefaultFlowCallback`,
    first in every Trainer's list, has just set; the Trainer acts on them right after the callbacks). The Trainer
    synchronises with the device there anyway (it reads the loss to log it), so a hook may read device values or
    gather across processes (every process reaches the same points); a hook that raises stops training before
    anything of that step is logged or saved. `at_train_begin()`, when given, runs at the start of every
    `train()`."""

    def __init__(self, hook: Callable, at_train_begin: Callable | None = None):
        self.hook, self.at_train_begin = hook, at_train_begin

    def on_train_begin(self, args, state, control, **kwargs):
        if self.at_train_begin is not None:
            self.at_train_begin()

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_log or control.should_evaluate or control.should_save or control.should_training_stop:
            self.hook(control)

    on_epoch_end = on_step_end


class NonFiniteTrainingError(RuntimeError):
    """The training loss, the gradient norm or a parameter became NaN or infinite. `step` is the first optimizer
    step (1-based, `state.global_step` after it) where it was seen."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


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


class LossTally:
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
