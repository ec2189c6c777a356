"""The numbers of each training step, kept on the device and read only where the Trainer synchronises anyway:
`StepMetrics`, held by the trainer (`trainer.step_metrics`, `hfl3.trainers.hooks.TrainerHooks`): the NaN/inf guard
(`NonFiniteFlags`), the run's loss (`LossTally`), the host count of input tokens and the throughput of each training
log (`Throughput`: `tok_per_sec`, `mfu`, `peak_memory_gb`); `BeforeLogSaveEvaluate`, the point where they are read;
and the loss plot of a finished run (`save_loss_plot`, `save_loss_png`).

The step is kept free of device→host synchronisations (docs/design.md, decision 12): each step compares the loss and
the gradient norm with `torch.isfinite` on the device and keeps the first bad step number in a device tensor
(`masked_fill_` with a Python int: no copy, no sync), adds the loss to a device tensor, and counts input tokens on the
host (`numel`). The flags are read, the loss drained and the tokens summed across processes only where the Trainer
synchronises anyway (when it logs, evaluates, saves or stops: `BeforeLogSaveEvaluate`); before a save the parameters
are checked too, so no checkpoint holds a non-finite tensor and the last good checkpoint stays the newest one. How a
recipe ends when it stops on a non-finite value is `hfl3.trainers.cli.exits`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hfl3.atomic import atomic_path

logger = logging.getLogger(__name__)


class StepMetrics:
    """What hfl3 records at every step, on the device or the host, without a sync (module docstring).

    Attributes:
        nonfinite: the first non-finite loss and gradient norm (`NonFiniteFlags`).
        loss: the run's training loss as the Trainer reports it (`LossTally`; a new one at every `train()`).
        pending_input_tokens: input tokens counted on this process since they were last summed
            (`sum_input_tokens`).
        throughput: the throughput of each training log (`Throughput`, of `ThroughputConfig`).
    """

    def __init__(self, throughput: ThroughputConfig | None = None):
        self.nonfinite = NonFiniteFlags()
        self.loss = LossTally()
        self.pending_input_tokens = 0
        self.throughput = Throughput(throughput or ThroughputConfig())

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


# Dense bf16 peak FLOP/s per GPU (vendor datasheets; H100/H200 SXM 989 TFLOP/s as nanochat uses).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12, "A10": 125e12}


def peak_flops_per_second() -> float | None:
    """Dense bf16 peak FLOP/s of the current CUDA GPU if known, else None (CPU, unknown GPU)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


@dataclass
class ThroughputConfig:
    """What `Throughput` is computed from.

    Attributes:
        flops_per_token: training FLOPs per token (`configuration_l3gpt.flops_per_token`; the recipe's plan), or None:
            no `mfu`.
        warmup_steps: training logs whose window starts before this optimizer step carry no throughput (start-up,
            compilation).
        peak_flops: dense bf16 peak FLOP/s of one device (default: `peak_flops_per_second()`, None on a CPU or an
            unknown GPU: no `mfu`).

    Raises:
        ValueError: a negative `warmup_steps`, or a `flops_per_token` or `peak_flops` that is not positive.
    """

    flops_per_token: float | None = None
    warmup_steps: int = 10
    peak_flops: float | None = field(default_factory=peak_flops_per_second)

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: expected >= 0 (training logs without a throughput)")
        for name in ("flops_per_token", "peak_flops"):
            if (value := getattr(self, name)) is not None and not value > 0:
                raise ValueError(f"{name}={value}: expected a positive number of FLOPs, or None (no mfu)")


class Throughput:
    """The one throughput of a training log, added to its `logs` before the Trainer hands them to any callback or
    reporting integration (`TrainerHooks.log`): `tok_per_sec` (input tokens per second across all processes, between
    two training logs) and, with a known peak and FLOPs per token, `mfu` (%), after the first `warmup_steps` steps;
    `peak_memory_gb` (CUDA max allocated, or the process's peak RSS on a CPU) as a record of its own at the end of
    `train()`. A trainer that counts no input tokens (`include_num_input_tokens_seen="no"`) logs no throughput.

    Clock: the Trainer reads the loss (`.item()`, a device sync) just before each log, so the time between two logs
    covers finished device work without a sync of its own; evaluation and checkpoint saving are left out (the window
    restarts when they end: `restart_window`), and so is other work a callback does between two logs
    (`exclude_time`, e.g. `hfl3.evaluate.CoreMetricCallback`).

    Named as nanochat names it (`tok_per_sec`, `mfu`: its console's `tok/sec` and its W&B keys `train/tok_per_sec`,
    `train/mfu`, which transformers' W&B integration also makes of these names). transformers adds another when it
    counts input tokens: `train_tokens_per_second`, the tokens of this session over the wall time since `train()`
    began (`Trainer.log`, `speed_metrics`), which also counts start-up, warm-up and compilation, the evaluations and
    the checkpoint saves. It lags the training speed (7,754 beside 9,502 tok/s in a demo log line) and is no basis for
    MFU, so pretraining leaves it out (`TrainerHooks.drops_session_throughput`).
    """

    def __init__(self, config: ThroughputConfig):
        self.config = config
        self._mark: tuple[float, int, int] | None = None  # (seconds, tokens seen, step) at the last training log

    def start(self) -> None:
        """A new window at every `train()`: its first training log opens it."""
        self._mark = None

    def add_to(self, logs: dict[str, float], state, world_size: int) -> None:
        """Add `tok_per_sec` (and `mfu`) to a training log (one with `loss`) of `state.global_step`; other logs are
        left alone. Called before `Trainer.log` (`state.num_input_tokens_seen` is summed by then)."""
        if "loss" not in logs:
            return
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        mark, self._mark = self._mark, (now, tokens, state.global_step)
        if mark is None or mark[2] < self.config.warmup_steps:
            return
        seconds, new_tokens = now - mark[0], tokens - mark[1]
        if seconds <= 0 or new_tokens <= 0:
            return
        logs["tok_per_sec"] = round(new_tokens / seconds, 1)
        if self.config.peak_flops and self.config.flops_per_token:
            logs["mfu"] = round(100 * logs["tok_per_sec"] * self.config.flops_per_token
                                / (self.config.peak_flops * world_size), 2)

    def restart_window(self) -> None:
        """Leave the time since the last training log out (an evaluation or a checkpoint save just ended)."""
        if self._mark is not None:
            self._mark = (time.perf_counter(), *self._mark[1:])

    def exclude_time(self, seconds: float) -> None:
        """Leave `seconds` of work that is not training out of the current window (another callback's evaluation
        between two training logs, e.g. `hfl3.evaluate.CoreMetricCallback`)."""
        if self._mark is not None:
            self._mark = (self._mark[0] + seconds, *self._mark[1:])

    @staticmethod
    def record_peak_memory(state) -> None:
        """Append `{"step", "peak_memory_gb"}` to `state.log_history`: CUDA max allocated, else the process's peak
        RSS (GiB)."""
        import resource

        if torch.cuda.is_available():
            peak_bytes = torch.cuda.max_memory_allocated()
        else:
            peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        state.log_history.append({"step": state.global_step, "peak_memory_gb": round(peak_bytes / 2**30, 3)})


def save_loss_plot(log_history: Sequence[dict], path: str | os.PathLike, metrics: Sequence[str] = ("loss", "eval_loss")) -> Path:
    """Plot each metric of `metrics` found in a Trainer `log_history` against `step` and write a PNG atomically.

    Args:
        log_history: `trainer.state.log_history` (list of dicts with a `step` key).
        path: destination PNG file.
        metrics: keys to plot; each gets its own panel (keys absent from the history are left out).

    Returns:
        The path written.

    Raises:
        ValueError: if none of `metrics` occurs in `log_history`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {m: [(e["step"], e[m]) for e in log_history if m in e and "step" in e] for m in metrics}
    series = {m: points for m, points in series.items() if points}
    if not series:
        raise ValueError(f"none of {list(metrics)} was logged; nothing to plot into {path}")
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.5), squeeze=False)
    for ax, (name, points) in zip(axes[0], series.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o" if len(points) < 30 else None)
        ax.set_xlabel("step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path


def save_loss_png(log_history: Sequence[dict], folder: str | os.PathLike, metrics: Sequence[str]) -> Path | None:
    """`save_loss_plot` into `folder/loss.png`; when none of `metrics` was logged, a warning and None."""
    if not any(metric in entry for entry in log_history for metric in metrics):
        logger.warning("no %s logged (run shorter than logging_steps?): loss.png not written", tuple(metrics))
        return None
    return save_loss_plot(log_history, Path(folder) / "loss.png", metrics)
