"""The pretraining recipe's three argument classes in one place, as TRL's `sft_config.py` sits beside its trainer:
`PretrainScriptArguments` (data and tokenizer), `PretrainConfig` (`TrainingArguments` with nanochat's choices) and
`L3GPTModelArguments` (the model's shape), in the parser's order. They validate and derive values; they start
nothing (`recipes/pretrain.py`'s `main` checks them first: `hfl3.trainers.cli.setup.set_up_pretraining`)."""

import logging
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch
from accelerate.utils import DistributedType
from transformers import TrainingArguments

from hfl3 import L3GPTConfig
from hfl3.evaluate.callback import check_core_arguments
from hfl3.models.l3gpt.modeling_l3gpt import LOSS_IMPLEMENTATIONS
from hfl3.trainers.cli.arguments import check_training_arguments
from hfl3.trainers.pretraining.compute_optimal import derive_gradient_accumulation_steps
from hfl3.trainers.cli.launch import ProcessGroupTimeout
from hfl3.trainers.optimizers import MuonTrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class PretrainScriptArguments:
    """The pretraining recipe's data, tokenizer and sample arguments (TRL's scripts import their `ScriptArguments`
    from the library the same way): the corpus (`dataset`, read by `hfl3.data.sources.open_corpus`), its validation
    side, the stream's buffers, the tokenizer (given, or a BPE trained on the stream), the L3 allocation's sample and
    the greedy samples printed at evaluation; `dry_run` plans and stops."""

    _argument_group_name = "data and tokenizer (hfl3.trainers.pretraining.config.PretrainScriptArguments)"

    dataset: str = field(default="stdlib", metadata={"help": "comma-separated: stdlib, .txt/.jsonl/.json/.parquet/"
                                                     ".arrow files (text and JSON also .gz/.bz2/.xz), folders and "
                                                     "globs, or datasets names (Hub or disk)"})
    dataset_config: str | None = field(default=None, metadata={"help": "configuration of a datasets source"})
    dataset_split: str = field(default="train", metadata={"help": "split of a datasets source"})
    text_column: str = field(default="text", metadata={"help": "text field of .jsonl/.json/.parquet and datasets"})
    document_separator: str | None = field(default=None, metadata={"help": "split .txt files at this string ('': "
                                                                   "whole files); default: a single .txt file is "
                                                                   "split at blank lines, others are whole"})
    skip_invalid_files: bool = field(default=False, metadata={"help": "skip unreadable, empty or malformed files, or "
                                                              "files without the text column (each listed with "
                                                              "its reason in metadata.json)"})
    eval_dataset: str | None = field(default=None, metadata={"help": "held-out validation source (as --dataset; "
                                                             "its files leave the training data); default: a "
                                                             "seeded hash split of the documents"})
    val_fraction: float = field(default=0.05, metadata={"help": "share of documents held out (hash split)"})
    max_eval_rows: int = field(default=256, metadata={"help": "packed validation rows, built once"})
    document_max_chars: int | None = field(default=None, metadata={"help": "cut documents into pieces of at most "
                                                                   "this many characters (default: max_length; 0: "
                                                                   "whole)"})
    shuffle_buffer: int = field(default=1000, metadata={"help": "pieces in the seeded shuffle buffer (0: in order)"})
    packing_buffer: int = field(default=1000, metadata={"help": "pieces the best-fit packing chooses from"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "existing tokenizer; else train one"})
    vocab_size: int = field(default=32768, metadata={"help": "vocabulary of the trained BPE"})
    tokenizer_train_chars: int = field(default=20_000_000, metadata={"help": "characters to train the BPE on (from "
                                                                     "the start of the stream)"})
    l3_sample_tokens: int = field(default=2_000_000, metadata={"help": "training tokens LZW-scanned for L3 (from "
                                                               "the start of the stream)"})
    # No trailing space: BPE words carry their leading space (" foo"), so "def " would end on a lone-space token
    sample_prompts: list[str] = field(default_factory=lambda: ["def", "import", "class"],
                                      metadata={"help": "prompts for greedy samples at eval time"})
    dry_run: bool = field(default=False, metadata={"help": "print the compute-optimal plan and exit before reading "
                                                   "data (vocabulary: --tokenizer_name_or_path's, else --vocab_size)"})


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

    The dial (`hfl3.trainers.pretraining.compute_optimal`, nanochat base_train's rules): the steps come from `max_steps` if given,
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


@dataclass
class L3GPTModelArguments:
    """The model's size and shape: `L3GPTConfig.from_depth(depth, ...)` with the fields given here; a field left at
    None takes `L3GPTConfig`'s (or `from_depth`'s) own default, so no default is repeated here. The vocabulary comes
    from the tokenizer and `max_position_embeddings` from `--max_length`."""

    _argument_group_name = ("model (hfl3.trainers.pretraining.config.L3GPTModelArguments: L3GPTConfig.from_depth; None: the "
                            "config's default)")

    depth: int = field(default=4, metadata={"help": "decoder layers; sizes the model (nanochat --depth)"})
    aspect_ratio: int | None = field(default=None, metadata={"help": "hidden_size = depth * aspect_ratio (rounded "
                                                             "up to head_dim)"})
    head_dim: int | None = field(default=None, metadata={"help": "attention head width"})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "GQA key/value heads"})
    window_pattern: str | None = field(default=None, metadata={"help": "S = sliding window, L = full; last layer L"})
    l3_after_layers: list[int] | None = field(default=None, metadata={"help": "L3 after these layers (none: dense)"})
    l3_n_emb: int | None = field(default=None, metadata={"help": "total L3 rows"})
    l3_k_max: int | None = field(default=None, metadata={"help": "most L3 rows per token"})
    l3_d_up: int | None = field(default=None, metadata={"help": "L3 up-projection width"})
    l3_tie_kv: bool | None = field(default=None, metadata={"help": "one table for L3 keys and values"})
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa (default), eager or "
                                                                    "flash_attention_2"})

    def config(self, vocab_size: int, max_length: int, **token_ids) -> L3GPTConfig:
        """The `L3GPTConfig` for a vocabulary of `vocab_size` tokens, rows of `max_length` tokens and the tokenizer's
        `bos_token_id` / `eos_token_id` / `pad_token_id` (`token_ids`)."""
        given = {k: v for k, v in asdict(self).items() if v is not None and k != "depth"}
        return L3GPTConfig.from_depth(self.depth, vocab_size=vocab_size, max_position_embeddings=max_length,
                                      **token_ids, **given)
