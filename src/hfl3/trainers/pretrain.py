"""Pretraining L3GPT with the HF Trainer: `PretrainConfig`, the packed-row collator, bits-per-byte evaluation and
`PretrainTrainer` (optimizer and LR-schedule hooks, and the streamed training data's DataLoader and checkpointed state)."""

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from accelerate.utils import DistributedType, gather_object
from transformers import EvalPrediction, Trainer, TrainingArguments

from hfl3 import fp8
from hfl3.callbacks import ThroughputCallback
from hfl3.data.packing import PackingReport
from hfl3.data.streaming import DATA_STATE_KEY, PackedStream, StreamBatch, StreamProgress, stream_dataloader
from hfl3.evaluate.callback import CoreMetricCallback, check_core_arguments
from hfl3.models.l3gpt.modeling_l3gpt import LOSS_IMPLEMENTATIONS
from hfl3.trainers.arguments import check_training_arguments
from hfl3.trainers.compute_optimal import derive_gradient_accumulation_steps
from hfl3.trainers.cards import l3gpt_model_card, usage_name
from hfl3.trainers.hooks import TrainerHooks
from hfl3.trainers.launch import ProcessGroupTimeout
from hfl3.trainers.metrics import BeforeLogSaveEvaluate
from hfl3.trainers.optimizers import MuonTrainingArguments

logger = logging.getLogger(__name__)

EMBEDDING_DTYPES = ("auto", "float32", "bfloat16")


@dataclass
class PretrainConfig(ProcessGroupTimeout, MuonTrainingArguments, TrainingArguments):
    """`TrainingArguments` for pretraining, with nanochat's choices.

    `use_muon` (spelled `--optim muon` too) trains with `hfl3.optim.MuonAdamW` and nanochat's parameter groups
    (`hfl3.optim.groups`), whose learning rates are the fields inherited from `hfl3.optim.GroupLearningRates`
    (`matrix_lr`, `embedding_lr`, `unembedding_lr`, `scalar_lr`, `l3_table_lr`, `value_embedding_lr`, `smear_lr`:
    defaults, meaning and source declared there once; `learning_rate` is then not used); these fields and the
    warmdown are `hfl3.trainers.optimizers.MuonTrainingArguments`', shared with `ChatSFTConfig`, which says how
    "muon" reaches the Trainer. Give `PretrainConfig(use_muon=True)` to `PretrainTrainer` (or build the optimizer
    with `create_muon_optimizer`): a plain `Trainer` reads `optim` only. Any other `optim` is the Trainer's own
    optimizer, with weight decay on >= 2-D weights only (`PretrainTrainer.get_decay_parameter_names`).

    Added fields: `max_length` (packed row length, as TRL spells it; also the model's `max_position_embeddings`),
    `use_muon` and the Muon group LRs, `warmdown_ratio`, `final_lr_frac`, `attend_across_documents`, `fp8`,
    `loss_implementation` (`L3GPTForCausalLM.set_loss_implementation`), `embedding_dtype` (`resolved_embedding_dtype`),
    `save_optimizer` (the optimizer state with the final model, as nanochat keeps it for its chat SFT),
    `overwrite_output_dir` (absent from transformers 5), and nanochat's compute-optimal dial
    `target_param_data_ratio`, `target_flops`, `total_batch_size`, and the CORE metric's `core_metric_every`
    (-1: off; nanochat's default is 2000, but its bundle is a download), `core_metric_max_per_task` (500) and
    `core_bundle_dir` (`hfl3.evaluate.CoreMetricCallback`).

    The dial (`hfl3.trainers.compute_optimal`, nanochat base_train's rules): the steps come from `max_steps` if given,
    else from `target_flops`, else from `target_param_data_ratio` (None: 12) tokens per scaling parameter;
    `total_batch_size` (tokens per optimizer step; -1 = auto, B ∝ D^0.383 around 2^19 at d12) sets
    `gradient_accumulation_steps`, and then every group's LR is scaled by √(B/2^19) and `weight_decay` (λ_ref) by
    √(B/2^19)·D_ref/D. A recipe computes the plan with `compute_optimal_plan` once the model's vocabulary is known and
    applies it with `compute_optimal.apply_plan` before building the Trainer. With `max_steps` given and no
    `total_batch_size` the run is sized by hand, as before: nothing is rescaled. `num_train_epochs` is not used by a streamed run: the
    stream repeats and `max_steps` (given or planned) ends it; `warmup_steps` below 1 and `warmdown_ratio` are
    fractions of that `max_steps`.

    Defaults that differ from `TrainingArguments`: `optim="adamw_torch"`, `lr_scheduler_type="warmup_stable_decay"`
    (nanochat: warmup → constant → linear warmdown over the last `warmdown_ratio` of the steps to `final_lr_frac` ×
    LR), `learning_rate=3e-3`, `weight_decay=0.0`, `adam_beta2=0.95`, `max_grad_norm` 0 with Muon (nanochat's
    base_train clips nothing) else 1.0, `eval_strategy="steps"`,
    `logging_steps=10`, `save_strategy` "no" unless `save_steps` is given, `remove_unused_columns=False`,
    `include_num_input_tokens_seen=True` ("all", counted without a per-step device sync by `PretrainTrainer`),
    `accelerator_config={"non_blocking": True}` with pinned DataLoader memory (a prepared loader's batches reach the
    device without a host wait), `logging_nan_inf_filter=False` (transformers' filter syncs the device every step
    and logs a non-finite loss as the running mean, hiding a divergence), `ignore_data_skip=True` (a streamed dataset
    resumes from the state saved in the checkpoint, not by skipping batches), `save_safetensors` always
    (transformers v5).
    """

    max_steps_meaning: ClassVar[str] = (  # what -1 means, in check_training_arguments' refusal of max_steps
        "to size the run by the compute-optimal dial: --target_flops, else --target_param_data_ratio tokens per "
        "scaling parameter (pretraining streams its data: it takes no --num_train_epochs)")
    _argument_group_name = ("training (PretrainConfig: transformers.TrainingArguments; hfl3's fields last: "
                            "the Muon group LRs matrix_lr ..., max_length, use_muon, warmdown_ratio, fp8, the "
                            "compute-optimal dial target_param_data_ratio, target_flops, total_batch_size)")

    max_length: int = field(default=512, metadata={"help": "packed row length in tokens (and the model's "
                                                         "max_position_embeddings)"})
    optim: str = field(default="adamw_torch", metadata={"help": "one of transformers' OptimizerNames, or muon: "
                                                        "--use_muon true"})
    attend_across_documents: bool = field(
        default=False,
        metadata={"help": "let packed documents attend to each other (nanochat); default: block-causal via "
                  "position_ids"},
    )
    fp8: str | None = field(default=None, metadata={"help": "tensorwise or rowwise: hfl3.fp8 Float8Linear"})
    loss_implementation: str = field(default="auto", metadata={
        "help": "the training loss: logits (built inside the compiled graph, nanochat's), chunked (PyTorch, no "
                "(batch, seq, vocab) logits), liger (Liger's fused kernel, CUDA) or auto: logits when compiled, "
                "else liger on CUDA, else chunked"})
    embedding_dtype: str = field(default="auto", metadata={
        "help": "dtype of the token embedding and value-embedding tables: float32, bfloat16, or auto: bfloat16 "
                "with --bf16 (nanochat's: half their parameter, gradient and AdamW bytes; a bf16 residual stream), "
                "except under DeepSpeed or FSDP (one dtype per flat or sharded group), else float32"})
    save_optimizer: bool = field(default=True, metadata={"help": "write the optimizer state "
                                                         "(optimizer/optimizer.safetensors) with the final model, "
                                                         "for SFT's --load_optimizer (not pushed to the Hub)"})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "replace a non-empty output_dir's files "
                                                                "when this run finishes"})
    target_param_data_ratio: float | None = field(
        default=None, metadata={"help": "training tokens per scaling parameter (matrices + lm_head) when neither "
                                "max_steps nor target_flops is given (None: nanochat's 12); also the horizon D of the "
                                "auto batch and the weight decay"})
    target_flops: float | None = field(default=None, metadata={"help": "training FLOPs budget: steps = target_flops / "
                                                               "(FLOPs per token x total batch), unless max_steps"})
    total_batch_size: int | None = field(
        default=None, metadata={"help": "tokens per optimizer step, -1 = nanochat's auto rule; sets "
                                "gradient_accumulation_steps and scales LRs and weight decay (None: -1 unless "
                                "max_steps is given, then per-device batch x max_length x world x accumulation)"})
    # The CORE metric during training (nanochat base_train.py --core-metric-every / --core-metric-max-per-task;
    # hfl3.evaluate): off by default, since its bundle is a download
    core_metric_every: int = field(default=-1, metadata={"help": "CORE metric every N optimizer steps and at the end "
                                                         "of training (-1: off)"})
    core_metric_max_per_task: int = field(default=500, metadata={"help": "CORE items per task (nanochat's seeded "
                                                                 "subsample; -1: all)"})
    core_bundle_dir: str | None = field(default=None, metadata={"help": "nanochat's eval_bundle folder (core.yaml, "
                                                                "eval_data/, eval_meta_data.csv); default: downloaded "
                                                                "once into the Hugging Face cache"})
    lr_scheduler_type: str = field(default="warmup_stable_decay", metadata={"help": "see TrainingArguments"})
    learning_rate: float = field(default=3e-3, metadata={"help": "peak LR (--use_muon: not used, see *_lr)"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay on >=2-D weights (λ_ref, "
                                                        "rescaled when the compute-optimal dial sizes the run)"})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2"})
    max_grad_norm: float | None = field(default=None, metadata={
        "help": "gradient clipping (0: none); default 0 with --optim muon (nanochat's base_train clips nothing), "
                "else 1.0 (transformers')"})
    eval_strategy: str = field(default="steps", metadata={"help": "see TrainingArguments; no: no evaluation at all"})
    eval_on_start: bool | None = field(default=None, metadata={"help": "evaluate at step 0, inside train() (default: "
                                                               "when evaluating, unless resuming)"})
    logging_steps: float = field(default=10, metadata={"help": "see TrainingArguments"})
    save_strategy: str | None = field(default=None, metadata={"help": "see TrainingArguments (default: steps when "
                                                              "--save_steps is given, else no)"})
    save_steps: float | None = field(default=None, metadata={"help": "save every N steps (given alone: "
                                                             "--save_strategy steps); default 500"})
    remove_unused_columns: bool = field(default=False, metadata={"help": "see TrainingArguments"})
    include_num_input_tokens_seen: str | bool = field(default=True, metadata={"help": "see TrainingArguments"})
    logging_nan_inf_filter: bool = field(default=False, metadata={"help": "see TrainingArguments"})
    ignore_data_skip: bool = field(default=True, metadata={"help": "a streamed train_dataset resumes from its saved "
                                                           "state; skipping batches would re-read the stream"})

    def __post_init__(self):
        check_training_arguments(self)  # a zero/negative learning rate or max_steps 0 trains nothing
        default_accelerator_config = self.accelerator_config is None
        check_core_arguments(self)
        self.take_muon_out_of_optim()
        if self.save_strategy is None:  # a step count given alone saves by steps, as the Trainer's default does
            self.save_strategy = "no" if self.save_steps is None else "steps"
        if self.save_steps is None:
            self.save_steps = 500  # transformers' default
        if self.fp8 not in (None, "tensorwise", "rowwise"):
            raise ValueError(f"fp8={self.fp8!r}; expected tensorwise, rowwise or unset")
        if self.loss_implementation not in LOSS_IMPLEMENTATIONS:
            raise ValueError(f"loss_implementation={self.loss_implementation!r}; expected one of "
                             f"{', '.join(LOSS_IMPLEMENTATIONS)}")
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ValueError(f"embedding_dtype={self.embedding_dtype!r}; expected one of {', '.join(EMBEDDING_DTYPES)}")
        if self.max_grad_norm is None:  # nanochat's base_train does not clip (Muon's updates are orthogonalised)
            self.max_grad_norm = 0.0 if self.use_muon else 1.0
        if self.auto_find_batch_size:
            # Halving the batch after an out-of-memory error would change the total batch the run was planned with
            # and restart the data stream from a state that no longer matches what was trained
            raise ValueError("auto_find_batch_size=True is not supported by the pretraining recipe; set a smaller "
                             "--per_device_train_batch_size (gradient accumulation keeps --total_batch_size)")
        for name in ("target_param_data_ratio", "target_flops"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive (leave it out to use the next rule: "
                                 "max_steps > target_flops > target_param_data_ratio)")
        if self.total_batch_size is not None and not (self.total_batch_size == -1 or self.total_batch_size > 0):
            raise ValueError(f"total_batch_size={self.total_batch_size}: expected tokens per optimizer step, or -1 "
                             "for nanochat's auto rule")
        if self.fp8 and not self.torch_compile:
            logger.warning(
                "fp8=%s without torch_compile: the per-tensor scaling runs as separate eager kernels and the step is "
                "slower than bf16 (0.65x bf16 on an H100 at d12 and d20, dev/LOG.md 2026-11-23); add "
                "--torch_compile true", self.fp8)
        super().__post_init__()
        if default_accelerator_config and self.dataloader_pin_memory:
            # accelerate's DataLoaderShard copies a prepared loader's pinned batches to the device without blocking
            self.accelerator_config.non_blocking = True
        if self.total_batch_size is not None and self.total_batch_size > 0:  # the auto batch is checked when planned
            derive_gradient_accumulation_steps(self.total_batch_size, self.per_device_train_batch_size,
                                               self.max_length, self.world_size)

    def resolved_embedding_dtype(self) -> torch.dtype:
        """The dtype `build_model` stores the token-embedding and value-embedding tables in: `embedding_dtype`, or
        for "auto" bfloat16 when training in bf16 on one process or under DDP (nanochat's `init_weights` casts them
        to its compute dtype: "optimizer can tolerate reduced-precision embeddings and it saves memory"), float32
        otherwise (DeepSpeed and FSDP flatten or shard parameter groups of one dtype; fp16 needs fp32 master
        tables for its gradient scaler)."""
        if self.embedding_dtype != "auto":
            return getattr(torch, self.embedding_dtype)
        sharded = self.distributed_state.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        return torch.bfloat16 if self.bf16 and not sharded else torch.float32


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
    training data's DataLoader, the input-token count (no device sync per step), weight decay on matrices only, and
    evaluation with hfl3 FP8 layers swapped back to high precision.

    A `PackedStream` as `train_dataset` is read per process and DataLoader worker (`hfl3.data.streaming.
    stream_dataloader`: a plain DataLoader, since accelerate would otherwise read an IterableDataset on rank 0 and
    dispatch its batches, or give every rank the whole stream); each consumed batch updates `data_progress` (worker
    states, chained sha256 of the rows), which every checkpoint saves (`data_state_rank{R}.safetensors`) and
    `train(resume_from_checkpoint=...)` restores, so a resumed run consumes exactly the rows an uninterrupted run
    would have.

    Private Trainer hook: `_track_num_input_tokens` (see its docstring; signature pinned by
    `tests/test_trainer_hooks.py`); the rest are public (`get_train_dataloader`, `floating_point_ops`,
    `get_decay_parameter_names`, `evaluate`) or `TrainerHooks`'."""

    drops_session_throughput = True  # a training log's throughput is ThroughputCallback's tok_per_sec alone
    batches_to_device = True

    def hand_over_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments the Trainer is built with: those given (`TrainerHooks.__init__`)."""
        return args, kwargs

    def set_up(self) -> None:
        """After the Trainer's `__init__`: the host token count and the callback that sums it at every log, save and
        evaluation; `ThroughputCallback` before the reporting integrations (W&B, TensorBoard, ...: the Trainer puts
        them before the callbacks passed in, and they would report without `tok_per_sec` and `mfu`, which it writes
        into the logs in its `on_log`).

        Raises:
            ValueError: a streamed `train_dataset` with `ignore_data_skip` False."""
        self._non_embedding_parameters = None
        self.add_callback(BeforeLogSaveEvaluate(lambda control: self.step_metrics.sum_input_tokens(self)))
        handler = self.callback_handler
        first = [callback for callback in handler.callbacks if isinstance(callback, ThroughputCallback)]
        handler.callbacks = first + [callback for callback in handler.callbacks if callback not in first]
        self.data_progress: StreamProgress | None = None
        if isinstance(self.train_dataset, PackedStream) and not self.args.ignore_data_skip:
            raise ValueError("a streamed train_dataset resumes from the state saved in the checkpoint: set "
                             "ignore_data_skip=True (PretrainConfig's default); skipping batches would re-read it")

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        """`write_model_card` arguments for the pretrained L3GPT (`l3gpt_model_card`)."""
        return l3gpt_model_card(metadata, usage_name(self))

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
        checkpoint = getattr(self, "resume_checkpoint", None)
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
        the throughput's own FLOPs are `ThroughputCallback`'s)."""
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

    def evaluate(self, *args, **kwargs):
        with fp8.float8_disabled(self.model):
            return super().evaluate(*args, **kwargs)

    @property
    def core_metric(self) -> CoreMetricCallback | None:
        """The CORE metric's callback (`--core_metric_every`), or None."""
        return next((c for c in self.callback_handler.callbacks if isinstance(c, CoreMetricCallback)), None)

    def run_results(self) -> dict:
        """What `hfl3.trainers.training.train_and_evaluate` adds to the results: the CORE metric of the final model,
        when it was evaluated."""
        core = self.core_metric
        return core.latest.metrics() if core is not None and core.latest is not None else {}
