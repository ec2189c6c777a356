"""Pretraining L3GPT with the HF Trainer: the packed-row collator, bits-per-byte evaluation and `PretrainTrainer`
(the streamed training data's DataLoader, the host token count, FLOPs, weight decay on matrices, evaluation without
FP8). The arguments are `hfl3.trainers.pretraining.config`'s; the hooks both trainers share, `hfl3.trainers.hooks`'."""

import hashlib
import logging
import math
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
    stream state under `data_state`, which `PretrainTrainer` takes out of the batch before the model sees it."""

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
    training data's DataLoader, the input-token count (no device sync per step) and weight decay on matrices only.

    A `PackedStream` as `train_dataset` is read per process and DataLoader worker (`hfl3.data.streaming.
    stream_dataloader`: a plain DataLoader, since accelerate would otherwise read an IterableDataset on rank 0 and
    dispatch its batches, or give every rank the whole stream); each consumed batch updates `data_progress` (worker
    states, chained sha256 of the rows), which every checkpoint saves (`data_state_rank{R}.safetensors`) and
    `train(resume_from_checkpoint=...)` restores, so a resumed run consumes exactly the rows an uninterrupted run
    would have.

    Private Trainer hook: `_track_num_input_tokens` (see its docstring; signature pinned by
    `tests/test_trainer_hooks.py`); the rest are public (`get_train_dataloader`, `floating_point_ops`,
    `get_decay_parameter_names`) or `TrainerHooks`'."""

    drops_session_throughput = True  # a training log's throughput is `tok_per_sec` alone (metrics.Throughput)
    batches_to_device = True

    def hand_over_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments the Trainer is built with: those given (`TrainerHooks.__init__`)."""
        return args, kwargs

    def set_up(self) -> None:
        """After the Trainer's `__init__`: the host token count and the callback that sums it at every log, save and
        evaluation.

        Raises:
            ValueError: a streamed `train_dataset` with `ignore_data_skip` False."""
        self._non_embedding_parameters = None
        self.add_callback(BeforeLogSaveEvaluate(lambda control: self.step_metrics.sum_input_tokens(self)))
        self.data_progress: StreamProgress | None = None
        if isinstance(self.train_dataset, PackedStream) and not self.args.ignore_data_skip:
            raise ValueError("a streamed train_dataset resumes from the state saved in the checkpoint: set "
                             "ignore_data_skip=True (PretrainConfig's default); skipping batches would re-read it")

    def model_card(self, metadata: Mapping[str, Any], name: str) -> dict:
        """`write_model_card` arguments for the pretrained L3GPT loaded as `name` (`l3gpt_model_card`)."""
        return l3gpt_model_card(metadata, name, model_index=core_eval_results)

    def hub_files(self, folder: Path) -> dict[str, Any]:
        """Files of `folder` whose pushed copy differs from the local one: none."""
        return {}

    def get_train_dataloader(self):
        """With a streamed `train_dataset`: a plain DataLoader over it (`stream_dataloader`), starting where the
        resumed checkpoint's `data_progress` left off (`train(resume_from_checkpoint=...)`), else at the start."""
        if not isinstance(self.train_dataset, PackedStream):
            return super().get_train_dataloader()
        key = (self.train_dataset.fingerprint(), self.args.process_index, self.args.world_size,
               self.args.dataloader_num_workers)
        checkpoint = self.outputs.resume_checkpoint
        self.data_progress = StreamProgress.load(checkpoint, *key) if checkpoint else StreamProgress(*key)
        workers = self.args.dataloader_num_workers
        extra = dict(persistent_workers=self.args.dataloader_persistent_workers,
                     prefetch_factor=self.args.dataloader_prefetch_factor,
                     multiprocessing_context=self.args.dataloader_multiprocessing_context) if workers else {}
        return stream_dataloader(self.train_dataset, self.args.train_batch_size, self.data_collator, self.data_progress,
                                 workers, pin_memory=self.args.dataloader_pin_memory, **extra)

    def stream_summary(self) -> dict | None:
        """What the streamed training consumed on all processes (a collective: call it on every rank): per-rank
        `summary()`s, the packing report summed, and `sha256`, the sha256 over the ranks' chained digests (32 bytes
        each, in rank order). None without a streamed dataset."""
        if self.data_progress is None:
            return None
        ranks = sorted(gather_object([self.data_progress.summary()]), key=lambda summary: summary["rank"])
        packing = sum((PackingReport.from_dict(r["packing"]) for r in ranks), PackingReport()).as_dict()
        combined = hashlib.sha256(b"".join(bytes.fromhex(r["sha256"]) for r in ranks)).hexdigest()
        return {"sha256": combined, "ranks": ranks, "packing": packing,
                "documents": sum(r["documents"] for r in ranks),
                **{key: sum(r[key] for r in ranks) for key in ("held_out_documents", "duplicate_documents",
                                                               "missing_text_documents", "empty_text_documents")}}

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
