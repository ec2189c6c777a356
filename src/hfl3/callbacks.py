"""Trainer callbacks shared by the recipes: loss plot, throughput and MFU (of the FLOPs per token that
`configuration_l3gpt.flops_per_token` counts), samples. Where hfl3's trainers read their own step values is
`hfl3.trainers.metrics.BeforeLogSaveEvaluate`."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from transformers import TrainerCallback

from hfl3.atomic import atomic_path

logger = logging.getLogger(__name__)


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


# Dense bf16 peak FLOP/s per GPU (vendor datasheets; H100/H200 SXM 989 TFLOP/s as nanochat uses).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "4090": 165e12, "A10": 125e12}


def peak_flops_per_second() -> float | None:
    """Dense bf16 peak FLOP/s of the current CUDA GPU if known, else None (CPU, unknown GPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


class ThroughputCallback(TrainerCallback):
    """Adds `tok_per_sec` (input tokens per second across all processes, between two training logs) and, on a GPU
    with a known peak, `mfu` (%) to every training log after the first `warmup_steps` steps; logs `peak_memory_gb`
    (CUDA max allocated, or process peak RSS on CPU) at the end of training.

    Clock: the Trainer reads the loss (`.item()`, a device sync) just before each log, so the time between two logs
    covers finished device work without this callback adding a sync of its own; evaluation and checkpoint saving
    are left out (the window restarts when they end).

    The one throughput of a training log, named as nanochat names it (`tok_per_sec`, `mfu`: its console's `tok/sec`
    and its W&B keys `train/tok_per_sec`, `train/mfu`, which transformers' W&B integration also makes of these
    names). transformers adds another when it counts input tokens: `train_tokens_per_second`, the tokens of this
    session over the wall time since `train()` began (`Trainer.log`, `speed_metrics`), which also counts start-up,
    warm-up and compilation, the step-0 and later evaluations and the checkpoint saves. It lags the training speed
    (7,754 beside 9,502 tok/s in a demo log line) and is no basis for MFU, so `PretrainTrainer.log` leaves it out.
    `PretrainTrainer` runs this callback first: the Trainer puts its reporting integrations before the callbacks passed
    to it, and they would report the logs without these keys. With another Trainer, insert it first
    (`trainer.callback_handler.callbacks.insert(0, callback)`).
    """

    def __init__(self, flops_per_token: float | None = None, warmup_steps: int = 10):
        self.flops_per_token = flops_per_token
        self.warmup_steps = warmup_steps
        self.peak = peak_flops_per_second()
        self._mark: tuple[float, int, int] | None = None  # (seconds, tokens seen, step) at the last log

    def on_log(self, args, state, control, logs=None, **kwargs):
        import time

        if logs is None or "loss" not in logs:
            return
        now, tokens = time.perf_counter(), state.num_input_tokens_seen
        mark, self._mark = self._mark, (now, tokens, state.global_step)
        if mark is None or mark[2] < self.warmup_steps:
            return
        seconds, new_tokens = now - mark[0], tokens - mark[1]
        if seconds <= 0 or new_tokens <= 0:
            return
        extra = {"tok_per_sec": round(new_tokens / seconds, 1)}
        if self.peak and self.flops_per_token:
            extra["mfu"] = round(100 * extra["tok_per_sec"] * self.flops_per_token / (self.peak * args.world_size), 2)
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def _restart_window(self) -> None:
        import time

        if self._mark is not None:
            self._mark = (time.perf_counter(), *self._mark[1:])

    def exclude_time(self, seconds: float) -> None:
        """Leave `seconds` of work that is not training out of the current window (another callback's evaluation
        between two training logs, e.g. `hfl3.evaluate.CoreMetricCallback`)."""
        if self._mark is not None:
            self._mark = (self._mark[0] + seconds, *self._mark[1:])

    def on_evaluate(self, args, state, control, **kwargs):
        self._restart_window()

    def on_save(self, args, state, control, **kwargs):
        self._restart_window()

    def on_train_end(self, args, state, control, **kwargs):
        import resource

        import torch

        if torch.cuda.is_available():
            peak_bytes = torch.cuda.max_memory_allocated()
        else:
            peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        state.log_history.append({"step": state.global_step, "peak_memory_gb": round(peak_bytes / 2**30, 3)})


class SampleCallback(TrainerCallback):
    """Prints greedy continuations of fixed prompts after every evaluation (main process), so a run shows what
    the model has learned; the samples are also kept in `self.samples` (step → list of texts)."""

    def __init__(self, tokenizer, prompts: Sequence[str], max_new_tokens: int = 32):
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.samples: dict[int, list[str]] = {}

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        import torch

        if not state.is_world_process_zero or model is None or not self.prompts:
            return
        from hfl3.fp8 import float8_disabled

        was_training = model.training
        model.eval()
        texts = []
        with torch.no_grad(), float8_disabled(model):
            for prompt in self.prompts:
                ids = [self.tokenizer.bos_token_id, *self.tokenizer(prompt, add_special_tokens=False)["input_ids"]]
                input_ids = torch.tensor([ids], device=model.device)
                output = model.generate(
                    input_ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                )
                texts.append(prompt + self.tokenizer.decode(output[0, len(ids):], skip_special_tokens=True))
        model.train(was_training)
        self.samples[state.global_step] = texts
        print(f"--- samples at step {state.global_step} ---")
        for text in texts:
            print(repr(text))
