"""Pretraining L3GPT with the HF Trainer: the training data as the trainer holds it (the packed-row collator and
`StreamedTrainingData`, with its config section `DataLoaderConfig`), bits-per-byte evaluation and `PretrainTrainer`
(the host token count, FLOPs, weight decay on matrices). The arguments are `hfl3.trainers.pretraining.config`'s; the
hooks both trainers share, `hfl3.trainers.hooks`'. The data's component lives here, beside the collator, because a
step consumes its batch state: a step enters this file anyway (docs/design.md, One step)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers import EvalPrediction, Trainer

from hfl3.data.packing import PackingReport
from hfl3.data.streaming import DATA_STATE_KEY, PackedStream, StreamBatch, StreamProgress, stream_dataloader
from hfl3.evaluate.callback import CoreMetricCallback
from hfl3.evaluate.core import core_eval_results
from hfl3.provenance.card import l3gpt_model_card
from hfl3.trainers.hooks import TrainerHooks
from hfl3.trainers.metrics import BeforeLogSaveEvaluate

logger = logging.getLogger(__name__)

class PackedCollator:
    """Stacks packed rows (`input_ids` lists or arrays of equal length) into `input_ids`, `labels` (= input_ids; the
    model shifts) and, unless `attend_across_documents`, `position_ids` restarting at every BOS so that transformers'
    masks keep packed documents apart (block-causal attention).

    Also takes a `StreamBatch` (`hfl3.data.streaming`, the streamed training data): its rows, and its worker's
    stream state under `data_state`, which `StreamedTrainingData.consume` takes out of the batch before the model sees
    it."""

    def __init__(self, bos_token_id: int, attend_across_documents: bool = False):
        self.bos_token_id = bos_token_id
        self.attend_across_documents = attend_across_documents

    def __call__(self, rows: list[dict] | StreamBatch) -> dict:
        if isinstance(rows, StreamBatch):
            input_ids = torch.from_numpy(rows.input_ids.astype(np.int64))  # (B, T)
        else:
            input_ids = torch.as_tensor(np.stack([np.asarray(row["input_ids"]) for row in rows]), dtype=torch.long)
        batch = {"input_ids": input_ids, "labels": input_ids.clone()}
        if not self.attend_across_documents:
            batch["position_ids"] = document_position_ids(input_ids, self.bos_token_id)
        if isinstance(rows, StreamBatch):
            batch[DATA_STATE_KEY] = rows.state
        return batch


def document_position_ids(input_ids: torch.LongTensor, bos_token_id: int) -> torch.LongTensor:
    """Positions `(B, T)` that restart at 0 on every BOS token (and at the start of each row)."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    is_start = input_ids == bos_token_id
    is_start[:, 0] = True
    last_start = torch.where(is_start, positions, torch.zeros_like(positions)).cummax(dim=1).values
    return positions - last_start


@dataclasses.dataclass(frozen=True)
class DataLoaderConfig:
    """The training arguments the streamed data's DataLoader is built from (`from_args`), taken when the trainer is
    built. `ignore_data_skip` must be True: the stream resumes from the state saved in the checkpoint.

    Attributes:
        train_batch_size: rows per batch of this process (`TrainingArguments.train_batch_size`).
        dataloader_num_workers, dataloader_pin_memory, dataloader_persistent_workers, dataloader_prefetch_factor,
            dataloader_multiprocessing_context: the DataLoader's (the last three only with workers).
        process_index, world_size: which stream of how many processes this one reads.
        ignore_data_skip: the Trainer's; False would skip batches by re-reading the stream.
    """

    train_batch_size: int
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    process_index: int = 0
    world_size: int = 1
    ignore_data_skip: bool = True

    @classmethod
    def from_args(cls, args) -> DataLoaderConfig:
        """The fields of `args` (`TrainingArguments`, its process group set up) named as here."""
        return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


class StreamedTrainingData:
    """The streamed training data as the trainer holds it (`trainer.streamed_data`), built by the builder from the
    stream, its collator and the DataLoader's config section: the DataLoader (`dataloader`), the progress read from
    each consumed batch (`consume`: worker states, chained sha256 of the rows) and saved into every checkpoint
    (`save`: `data_state_rank{R}.safetensors`), and what the run consumed on all processes (`summary`). A resumed run
    (`train(resume_from_checkpoint=...)`) consumes exactly the rows an uninterrupted run would have.

    A plain DataLoader per process and worker (`hfl3.data.streaming.stream_dataloader`): accelerate would otherwise
    read an IterableDataset on rank 0 and dispatch its batches, or give every rank the whole stream.

    Args:
        stream: the training stream (`PackedStream`), the trainer's `train_dataset`.
        collator: the trainer's `data_collator` (`PackedCollator`: it puts each batch's stream state under
            `data_state`).
        config: the DataLoader's arguments (`DataLoaderConfig.from_args`).

    Attributes:
        progress: what this process consumed (`hfl3.data.streaming.StreamProgress`), new or loaded from the resumed
            checkpoint by `dataloader`; None before it.

    Raises:
        ValueError: `config.ignore_data_skip` False (before any data is read).
    """

    def __init__(self, stream: PackedStream, collator, config: DataLoaderConfig):
        if not config.ignore_data_skip:
            raise ValueError("a streamed train_dataset resumes from the state saved in the checkpoint: set "
                             "ignore_data_skip=True (PretrainConfig's default); skipping batches would re-read it")
        self.stream, self.collator, self.config = stream, collator, config
        self.progress: StreamProgress | None = None

    def dataloader(self, resume_checkpoint: str | os.PathLike | None = None) -> torch.utils.data.DataLoader:
        """A plain DataLoader over the stream, starting where `resume_checkpoint`'s progress left off
        (`StreamProgress.load`), else at the start.

        Raises:
            FileNotFoundError, ValueError: the checkpoint has no data state for this process, or was written by
                another stream, world size or number of workers (`StreamProgress.load`).
        """
        config, workers = self.config, self.config.dataloader_num_workers
        key = (self.stream.fingerprint(), config.process_index, config.world_size, workers)
        self.progress = StreamProgress.load(resume_checkpoint, *key) if resume_checkpoint else StreamProgress(*key)
        extra = dict(persistent_workers=config.dataloader_persistent_workers,
                     prefetch_factor=config.dataloader_prefetch_factor,
                     multiprocessing_context=config.dataloader_multiprocessing_context) if workers else {}
        return stream_dataloader(self.stream, config.train_batch_size, self.collator, self.progress, workers,
                                 pin_memory=config.dataloader_pin_memory, **extra)

    def consume(self, batch: dict) -> None:
        """Moves `batch`'s stream state (`data_state`) into `progress`, with its `input_ids` (host rows) chained into
        the digest; called on every batch the Trainer takes, before the model sees it."""
        state = batch.pop(DATA_STATE_KEY, None)
        if state is not None:
            self.progress.consume(state, batch["input_ids"])

    def save(self, folder: str | os.PathLike) -> None:
        """`progress` into the checkpoint `folder` (`data_state_rank{R}.safetensors`); nothing before
        `dataloader`."""
        if self.progress is not None:
            self.progress.save(folder)

    def summary(self) -> dict | None:
        """What the streamed training consumed on all processes (a collective: call it on every rank): per-rank
        `summary()`s, the packing report summed, and `sha256`, the sha256 over the ranks' chained digests (32 bytes
        each, in rank order). None before `dataloader`."""
        if self.progress is None:
            return None
        ranks = sorted(gather_object([self.progress.summary()]), key=lambda summary: summary["rank"])
        packing = sum((PackingReport.from_dict(r["packing"]) for r in ranks), PackingReport()).as_dict()
        combined = hashlib.sha256(b"".join(bytes.fromhex(r["sha256"]) for r in ranks)).hexdigest()
        return {"sha256": combined, "ranks": ranks, "packing": packing,
                "documents": sum(r["documents"] for r in ranks),
                **{key: sum(r[key] for r in ranks) for key in ("held_out_documents", "duplicate_documents",
                                                               "missing_text_documents", "empty_text_documents")}}


class BitsPerByte:
    """Validation bits per byte: Σ nats / (ln 2 · Σ target bytes) over targets whose token has ≥ 1 byte (special
    tokens, 0 bytes, are left out of both sums; nanochat `evaluate_bpb`). Tokenizer-independent, unlike loss.

    Use `preprocess_logits_for_metrics` (per-target nats `(B, T-1)`, so no logits are kept) and `compute_metrics`
    with the Trainer's evaluation loop.
    """

    def __init__(self, token_bytes: torch.LongTensor):
        self.token_bytes = token_bytes.numpy()

    @staticmethod
    def preprocess_logits_for_metrics(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = labels[:, 1:]
        nats = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), targets.clamp(min=0), reduction="none"
        )
        return nats.masked_fill(targets == -100, 0.0)

    def __call__(self, prediction: EvalPrediction) -> dict[str, float]:
        nats = np.asarray(prediction.predictions, dtype=np.float64)
        targets = np.asarray(prediction.label_ids)[:, 1:]
        counted = targets >= 0
        target_bytes = np.where(counted, self.token_bytes[np.clip(targets, 0, None)], 0)
        counted &= target_bytes > 0
        total_bytes = target_bytes[counted].sum()
        return {"bpb": float(nats[counted].sum() / (math.log(2) * max(total_bytes, 1)))}


class PretrainTrainer(TrainerHooks, Trainer):
    """HF Trainer for pretraining, with hfl3's hooks (`hfl3.trainers.hooks.TrainerHooks`: the optimizer and its WSD
    schedule, the NaN/inf guard, staged checkpoints and output folders with provenance). Its own: the streamed
    training data's DataLoader (handed to `streamed_data`), the input-token count (no device sync per step) and
    weight decay on matrices only.

    Args (besides the Trainer's and `TrainerHooks`'):
        streamed_data: with a `PackedStream` as `train_dataset`, the streamed data over it, as the builder
            constructed it (`StreamedTrainingData`); without it, one built from the trainer's `data_collator` and
            arguments (`DataLoaderConfig.from_args`). With a `datasets.Dataset`, none: the Trainer's own DataLoader.

    Attributes:
        streamed_data: the streamed training data (`StreamedTrainingData`: DataLoader, progress saved into every
            checkpoint, the run's `summary`), or None.

    Private Trainer hook: `_track_num_input_tokens` (see its docstring; signature pinned by
    `tests/test_trainer_hooks.py`); the rest are public (`get_train_dataloader`, `floating_point_ops`,
    `get_decay_parameter_names`) or `TrainerHooks`'."""

    drops_session_throughput = True  # a training log's throughput is `tok_per_sec` alone (metrics.Throughput)
    batches_to_device = True

    def hand_over_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments the Trainer is built with: those given (`TrainerHooks.__init__`), but `streamed_data`, kept
        for `set_up`."""
        self.streamed_data = kwargs.pop("streamed_data", None)
        return args, kwargs

    def set_up(self) -> None:
        """After the Trainer's `__init__`: the streamed training data (the one given, else one built over a streamed
        `train_dataset`), the host token count and the callback that sums it at every log, save and evaluation.

        Raises:
            ValueError: a streamed `train_dataset` with `ignore_data_skip` False (`StreamedTrainingData`); a
                `streamed_data` over another stream than `train_dataset`."""
        self._non_embedding_parameters = None
        self.add_callback(BeforeLogSaveEvaluate(lambda control: self.step_metrics.sum_input_tokens(self)))
        if self.streamed_data is None and isinstance(self.train_dataset, PackedStream):
            self.streamed_data = StreamedTrainingData(self.train_dataset, self.data_collator,
                                                      DataLoaderConfig.from_args(self.args))
        if self.streamed_data is not None and self.streamed_data.stream is not self.train_dataset:
            raise ValueError("streamed_data reads another stream than train_dataset: build it over train_dataset")

    def model_card(self, metadata: Mapping[str, Any], name: str) -> dict:
        """`write_model_card` arguments for the pretrained L3GPT loaded as `name` (`l3gpt_model_card`)."""
        return l3gpt_model_card(metadata, name, model_index=core_eval_results)

    def hub_files(self, folder: Path) -> dict[str, Any]:
        """Files of `folder` whose pushed copy differs from the local one: none."""
        return {}

    def get_train_dataloader(self):
        """With a streamed `train_dataset`: `streamed_data`'s DataLoader, resumed where the resumed checkpoint's
        progress left off (`train(resume_from_checkpoint=...)`), else at the start; otherwise the Trainer's."""
        if self.streamed_data is None:
            return super().get_train_dataloader()
        return self.streamed_data.dataloader(self.outputs.resume_checkpoint)

    def floating_point_ops(self, inputs: dict) -> int:
        """The Trainer's `total_flos` term, 6 × input tokens × non-embedding parameters (`Trainer.floating_point_ops`),
        with the parameters counted once: the Trainer asks at every micro-batch, and `num_parameters(
        exclude_embeddings=True)` walks every module and parameter each time (host work on the step's critical path;
        the throughput's own FLOPs are `ThroughputConfig.flops_per_token`, `hfl3.trainers.metrics`)."""
        if self._non_embedding_parameters is None:
            self._non_embedding_parameters = self.model.num_parameters(exclude_embeddings=True)
        main_input = getattr(self.model, "main_input_name", "input_ids")
        return 6 * inputs[main_input].numel() * self._non_embedding_parameters if main_input in inputs else 0

    def get_decay_parameter_names(self, model) -> list[str]:
        """The >= 2-D weights (norm-free model: the 1-D parameters are the per-layer scalars, not decayed)."""
        return [name for name, parameter in model.named_parameters() if parameter.ndim >= 2]

    def _track_num_input_tokens(self, inputs):
        """Count input tokens on the host (`numel` is metadata: no device sync). transformers 5.23 gathers the count
        across processes and calls `.item()` after every micro-batch, which stalls the host behind the device each
        step, and offers no public hook in its place (`include_num_input_tokens_seen="no"` drops the count from the
        logs and the state); here the count is summed across processes only where the Trainer logs, saves,
        evaluates or stops (`StepMetrics.sum_input_tokens`), so `state.num_input_tokens_seen` is exact whenever it is
        read or written."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if self.args.include_num_input_tokens_seen != "all" or main_input not in inputs:
            return super()._track_num_input_tokens(inputs)
        self.step_metrics.count_input_tokens(inputs[main_input].numel())

    @property
    def core_metric(self) -> CoreMetricCallback | None:
        """The CORE metric's callback (`--core_metric_every`), or None."""
        return next((c for c in self.callback_handler.callbacks if isinstance(c, CoreMetricCallback)), None)

    def run_results(self) -> dict:
        """What `hfl3.trainers.training.train_and_evaluate` adds to the results: the CORE metric of the final model,
        when it was evaluated."""
        core = self.core_metric
        return core.latest.metrics() if core is not None and core.latest is not None else {}
