"""`TrainerHooks`: every `Trainer` method that both hfl3 trainers change, overridden once, in one class.

`PretrainTrainer(TrainerHooks, Trainer)` and `ChatSFTTrainer(TrainerHooks, SFTTrainer)`: the hfl3 part of each
trainer's bases is this one class, directly before the library's, so no method depends on an order of bases, and no
`Trainer` method is defined in more than one place of hfl3 (`tests/test_trainer_hooks.py`). Each override is a few
lines around `super()` that hand the work to what the trainer holds:

| hook | what it adds |
|---|---|
| `__init__` | the trainer's own `hand_over_arguments` first, the output folder (`outputs`, built from the arguments when not given) and its push taken over (uploaded once at the end), then after the Trainer's: the step metrics (`metrics.StepMetrics`, with the throughput's config), the optimizer's component (`optimizers.OptimizerSetup`: Muon's refusal of what it cannot run under), the NaN/inf check, the trainer's own `set_up` |
| `train` | the output folder and resume checkpoint resolved and checked (`outputs.start`), a new throughput window, and after it the peak memory record (`metrics.Throughput`) and the best model to every machine (`outputs.end`) |
| `get_batch_samples` | a finished run trains nothing more; a streamed batch's state into the streamed data's progress (`streamed_data.consume`), tensors copied without blocking |
| `training_step` | the loss tallied and checked for NaN/inf on the device (`metrics.StepMetrics`) |
| `_get_grad_norm` (private, pinned) | the pre-clipping gradient norm checked on the device |
| `log` | metrics the trainer gathered since the last log (`micro_batch_metrics`), the session throughput left out where the trainer says so, the training log's `tok_per_sec` and `mfu` (`metrics.Throughput`, before any callback or reporting integration sees the log), the run's loss and whole-run figures after a resume (`outputs.whole_run_log`) |
| `evaluate` | hfl3 FP8 layers run in high precision; the throughput window restarts after it |
| `create_optimizer_and_scheduler`, `create_optimizer`, `create_scheduler` | handed to `optimizer_setup` (`hfl3.trainers.optimizers.OptimizerSetup`): MuonAdamW or the Trainer's optimizer, scaled, warm-started; the WSD schedule's steps |
| `_save_checkpoint` (private, pinned) | the staged checkpoint, renamed when whole (`outputs.save_checkpoint`); the throughput window restarts after it |
| `save_model`, `create_model_card`, `save_metrics`, `save_state` | no `training_args.bin`, provenance and card on every saved folder (`outputs.after_save_model`), local paths out of the saved results (`outputs.after_save_state`) |
| `finish_output`, `push_output` (hfl3's) | the final folder staged and committed whole (`outputs.finish`), uploaded once (`outputs.push`) |

`outputs` is the output folder, `hfl3.trainers.outputs.RunOutputs`; `streamed_data`, pretraining's streamed data
(`hfl3.trainers.pretraining.trainer.StreamedTrainingData`), or None. What each trainer adds it defines once, in its
own class: `hand_over_arguments` and `set_up` (around the Trainer's `__init__`), `model_card` and `hub_files` (what
its output folder says), and the Trainer methods only it overrides.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from transformers.trainer_utils import speed_metrics

from hfl3 import fp8
from hfl3.provenance import portable
from hfl3.trainers.metrics import NonFiniteCheck, StepMetrics, ThroughputConfig, save_loss_png
from hfl3.trainers.optimizers import OptimizerSetup
from hfl3.trainers.outputs import OutputConfig, RunOutputs

logger = logging.getLogger(__name__)


class TrainerHooks:
    """The `Trainer` methods hfl3's trainers override (module docstring), for a subclass
    `class MyTrainer(TrainerHooks, Trainer)` that defines `hand_over_arguments`, `set_up`, `model_card` and
    `hub_files`.

    Args:
        outputs: the output folder, as the recipe's builder constructed it (`RunOutputs` with the folder the
            recipe's `prepare_output_dir` resolved before any work); without it, one built from the arguments
            (`OutputConfig.from_args`), which `train` resolves once, the same way, from `args.output_dir` and its
            `resume_from_checkpoint` argument.
        optimizer_setup: the run's optimizer (`hfl3.trainers.optimizers.OptimizerSetup`, built from `args`; it then
            reads the trainer's `self.args`); without it, one is built from them (no warm start).
        provenance: a `build_metadata` dict stamped into every saved folder, or None (nothing stamped).
        throughput: what each training log's `tok_per_sec` and `mfu` are computed from (default `ThroughputConfig()`:
            no FLOPs per token, so no `mfu`).

    `TrainingArguments.push_to_hub` is taken over at construction: the Trainer would otherwise upload unfinished
    checkpoint folders and re-save the model into `output_dir`; `push_output()` uploads the committed folder once, at
    the end (`hub_strategy` "end"), with the same `hub_model_id`, `hub_private_repo`, `hub_token` and `hub_revision`
    (the output folder's `OutputConfig`, taken before).

    Attributes:
        outputs: the output folder (`RunOutputs`): resume checkpoint, run totals, staged checkpoints, final folder.
        optimizer_setup: what the optimizer hooks hand their work to.
        step_metrics: what each step records without a device sync, and the throughput of each training log
            (`hfl3.trainers.metrics.StepMetrics`).
        streamed_data: a streamed training dataset as the trainer holds it (pretraining's `StreamedTrainingData`:
            its DataLoader, progress and summary), else None.
        micro_batch_metrics: `{"train"|"eval": {name: [value per micro-batch]}}`, averaged into the next log of that
            mode.
    """

    drops_session_throughput = False
    """True: a training log carries no `train_tokens_per_second` of this `train()` call (its one throughput is
    `tok_per_sec`, `hfl3.trainers.metrics.Throughput`)."""
    batches_to_device = False
    """True: `get_batch_samples` copies each batch's tensors to the device itself, without blocking."""
    streamed_data = None
    provenance: dict | None = None  # read by `create_model_card` and `save_model` whenever they run

    def __init__(self, *args, outputs: RunOutputs | None = None, optimizer_setup: OptimizerSetup | None = None,
                 provenance: dict | None = None, throughput: ThroughputConfig | None = None, **kwargs):
        args, kwargs = self.hand_over_arguments(args, kwargs)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            outputs = outputs or RunOutputs(OutputConfig.from_args(training_args))
            training_args.push_to_hub = False  # the output folder pushes, once, at the end
        super().__init__(*args, **kwargs)
        self.outputs = outputs or RunOutputs(OutputConfig.from_args(self.args))
        self.provenance = provenance
        self.step_metrics = StepMetrics(throughput)
        self.optimizer_setup = optimizer_setup or OptimizerSetup(self.args)  # refuses what Muon cannot run under
        self.optimizer_setup.args = self.args  # the arguments the Trainer reads (`hand_over_arguments` may copy them)
        self.add_callback(NonFiniteCheck(lambda control: self.check_finite(parameters=control.should_save),
                                         at_train_begin=self.step_metrics.nonfinite.clear))
        self.micro_batch_metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.set_up()

    # ---- the run ----

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, resuming from the checkpoint the output folder resolved (`RunOutputs.start`: the folder,
        or None, is `outputs.resume_checkpoint` while it runs). After a resume, `train_loss` and the throughput cover the whole
        run (`log`). At the end, a `peak_memory_gb` record in the log history (`Throughput.record_peak_memory`)."""
        checkpoint = self.outputs.start(self, resume_from_checkpoint)
        self.step_metrics.throughput.start()
        output = super().train(checkpoint or None, *args, **kwargs)
        self.step_metrics.throughput.record_peak_memory(self.state)
        return self.outputs.end(self, output)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The Trainer's batches for the next optimizer step; none once `max_steps` is reached (transformers 5.23,
        resuming a finished run whose dataset has no length, a stream, would train one step past `max_steps`). With
        `batches_to_device`, a streamed batch's state moves into `streamed_data` (from the host rows), then each
        batch's tensors are copied to `device` without blocking (the DataLoader pins them), so that the Trainer
        counts `num_items_in_batch` on the device and its `_prepare_inputs` finds them there: no host wait per
        tensor, where a blocking copy of each (and of the count) would drain the GPU's queue every step."""
        if 0 < self.state.max_steps <= self.state.global_step:
            logger.info("step %d of max_steps %d: nothing left to train", self.state.global_step, self.state.max_steps)
            self.control.should_training_stop = True
            return [], None
        if self.batches_to_device:
            epoch_iterator = self._batches_on_device(epoch_iterator, num_batches, device)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _batches_on_device(self, epoch_iterator, num_batches: int, device: torch.device):
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                return
            if self.streamed_data is not None:
                self.streamed_data.consume(batch)
            yield {key: value.to(device, non_blocking=True) if torch.is_tensor(value) else value
                   for key, value in batch.items()}

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_metrics.record_loss(loss, self.state.global_step, self.args.device)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and self._gradients_are_plain_tensors():
            # without clipping, transformers measures the norm with clip_grad_norm_(inf), which also multiplies every
            # gradient by 1 (a read and a write of all of them per step): measure it alone
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.step_metrics.record_grad_norm(grad_norm, self.state.global_step, self.args.device)
        return grad_norm

    def _gradients_are_plain_tensors(self) -> bool:
        """Whole, unscaled gradients in `.grad` (one process or DDP, no fp16 loss scaling): their norm is the norm of
        the model's gradient."""
        plain = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        return self.accelerator.distributed_type in plain and self.accelerator.scaler is None

    def check_finite(self, parameters: bool = False) -> None:
        """Raise `NonFiniteTrainingError` if a loss or gradient norm was not finite since `train()` began (with
        `parameters`: or a parameter is now); `NonFiniteFlags.check`."""
        self.step_metrics.nonfinite.check(self, parameters)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """`Trainer.log` with, in this order: the `micro_batch_metrics` of the current mode averaged over the
        micro-batches since the last log (`eval_`-prefixed in evaluation, as TRL adds its own); without the session's
        `train_tokens_per_second` when `drops_session_throughput` (`train_runtime`, the seconds since `train()` began,
        stays); a training log's `tok_per_sec` and `mfu` (`metrics.Throughput`: here, so that every callback and
        reporting integration the Trainer calls in `super().log` sees them); the run's loss sum and, after a resume,
        whole-run figures (`RunOutputs.whole_run_log`)."""
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        logs.update({prefix + key: sum(values) / len(values) for key, values in self.micro_batch_metrics[mode].items()})
        self.micro_batch_metrics[mode].clear()
        if self.drops_session_throughput and start_time is not None:
            logs.update(speed_metrics("train", start_time))
            start_time = None
        self.step_metrics.throughput.add_to(logs, self.state, self.args.world_size)
        self.outputs.whole_run_log(self, logs)
        super().log(logs, start_time)

    def evaluate(self, *args, **kwargs):
        """`Trainer.evaluate` with hfl3 FP8 layers run in high precision (`fp8.float8_disabled`); the evaluation (and
        its callbacks: samples, ...) is left out of the throughput window."""
        with fp8.float8_disabled(self.model):
            metrics = super().evaluate(*args, **kwargs)
        self.step_metrics.throughput.restart_window()
        return metrics

    # ---- the optimizer ----

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.optimizer_setup.num_training_steps = num_training_steps
        super().create_optimizer_and_scheduler(num_training_steps)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = self.optimizer_setup.create_optimizer(
                model or self.model, functools.partial(super().create_optimizer, model),
                self.outputs.resume_checkpoint)
            return self.optimizer
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        self.optimizer_setup.set_schedule_defaults(num_training_steps)
        return super().create_scheduler(num_training_steps, optimizer)

    def save_optimizer_state(self) -> Path | None:
        """`OptimizerSetup.save_state`: `optimizer/optimizer.safetensors` in the (staged) output folder."""
        return self.optimizer_setup.save_state(self)

    # ---- saved folders ----

    def _save_checkpoint(self, model, trial):
        self.outputs.save_checkpoint(self, lambda: super(TrainerHooks, self)._save_checkpoint(model, trial))
        self.step_metrics.throughput.restart_window()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """`Trainer.save_model` (every checkpoint and the final folder), then `RunOutputs.after_save_model`: no
        `training_args.bin`, the provenance and card when `provenance` is set, an adapter's local base path."""
        super().save_model(output_dir, _internal_call)
        self.outputs.after_save_model(self, Path(output_dir if output_dir is not None else self.args.output_dir))

    def create_model_card(self, *args, **kwargs):
        """The Trainer's card when there is no `provenance`; else nothing here: the card travels with the saved
        weights (`save_model`), and TRL calls this into `output_dir` before every checkpoint."""
        if self.provenance is None:
            return super().create_model_card(*args, **kwargs)
        return None

    def save_metrics(self, split, metrics, combined=True):
        """`Trainer.save_metrics` with the values made `portable` (a `best_model_checkpoint` is a local path)."""
        super().save_metrics(split, portable(metrics), combined)

    def save_state(self):
        """`Trainer.save_state`, then the written `trainer_state.json` made `portable` (`RunOutputs.after_save_state`:
        its `best_model_checkpoint` is a local path; a checkpoint's own copy keeps it, for resuming)."""
        super().save_state()
        self.outputs.after_save_state(self)

    @contextlib.contextmanager
    def finish_output(self) -> Iterator[Path]:
        """`with trainer.finish_output() as folder:` the final folder, staged and committed whole
        (`RunOutputs.finish`)."""
        with self.outputs.finish(self) as folder:
            yield folder

    def save_loss_plot(self, metrics: Sequence[str] = ("loss", "eval_loss")) -> None:
        """`loss.png` in `args.output_dir` (inside `finish_output`, the staged folder): `metrics` over the steps of
        the log history, written by the main process (`hfl3.trainers.metrics.save_loss_png`: a warning when none was
        logged)."""
        if self.is_world_process_zero():
            save_loss_png(self.state.log_history, self.args.output_dir, metrics)

    def push_output(self, folder: str | os.PathLike | None = None) -> str | None:
        """`RunOutputs.push`: the committed folder uploaded with `--push_to_hub`; the commit URL, or None."""
        return self.outputs.push(self, folder)
