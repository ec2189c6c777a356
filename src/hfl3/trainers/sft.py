"""LoRA SFT on chat data: the recipe's argument classes, `HFL3SFTTrainer(SFTTrainer)` and output writers.

`recipes/sft_lora.py` is `make_parser()` + `main()` over these pieces; `benchmarks/sft_throughput.py` builds the
same trainer through `build_sft_trainer`.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, EarlyStoppingCallback, GgufConfig
from transformers.utils import ModelOutput
from trl import ModelConfig, SFTConfig, SFTTrainer

import hfl3  # noqa: F401  (registers L3GPT with the Auto classes)
from hfl3.data.chat import write_chat_jsonl
from hfl3.data.sft import SFTData, load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.models.l3gpt.linear_cross_entropy import linear_cross_entropy, register_zero3_owner
from hfl3.provenance import sha256_records, stamp_folder
from hfl3.trainers.guards import NonFiniteGuard, check_training_arguments, check_vocabulary_fits
from hfl3.trainers.outputs import SFTOutputs, sft_model_card, work_dir

logger = logging.getLogger(__name__)


@dataclass
class SFTScriptArguments:
    """Data and output options of `recipes/sft_lora.py`.

    Data: `train_file` (chat JSONL) or `stdlib_chats` (build that many chats from the Python stdlib's docstrings,
    written to `output_dir/_hfl3_staging/work/stdlib_chats.jsonl`); evaluation from `eval_file` or a seeded `val_split`.
    Outputs: `merge` also writes a merged full model to `output_dir/merged`; `sample_prompts` are answered greedily
    by the trained model at the end (`samples.json`).
    """

    train_file: str | None = field(default=None, metadata={"help": "Chat JSONL: one {\"messages\": [...]} per line."})
    stdlib_chats: int = field(
        default=0, metadata={"help": "Instead of train_file: build this many chats from Python stdlib docstrings."}
    )
    eval_file: str | None = field(default=None, metadata={"help": "Chat JSONL for evaluation (instead of val_split)."})
    val_split: float = field(
        default=0.0, metadata={"help": "Fraction of the training conversations held out for evaluation (seeded)."}
    )
    skip_invalid_records: bool = field(
        default=False, metadata={"help": "Skip and count invalid records instead of stopping at the first one."}
    )
    merge: bool = field(default=False, metadata={"help": "Also write the merged full model to output_dir/merged."})
    sample_prompts: list[str] | None = field(
        default=None, metadata={"help": "Questions answered greedily by the trained model at the end (samples.json)."}
    )
    max_new_tokens: int = field(default=96, metadata={"help": "Tokens generated per sample prompt."})


@dataclass
class SFTModelArguments(ModelConfig):
    """TRL's `ModelConfig` (model path, dtype, attention, LoRA) with hfl3 defaults and loading options.

    Differences from `trl.ModelConfig`: `use_peft` defaults to True (this recipe trains LoRA adapters),
    `lora_target_modules` to `["q_proj", "v_proj"]` (module names, or `all-linear`); added `gguf_file` (a GGUF file
    in the `model_name_or_path` folder, dequantized into a dense trainable model, its tokenizer used unless
    `tokenizer_name_or_path` is given; needs `pip install 'hfl3[gguf]'`) and `tokenizer_name_or_path`.
    """

    use_peft: bool = field(default=True, metadata={"help": "Train LoRA adapters (the only mode of this recipe)."})
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["q_proj", "v_proj"],
        metadata={"help": "Module names to adapt with LoRA, or 'all-linear'."},
    )
    gguf_file: str | None = field(
        default=None, metadata={"help": "GGUF file inside model_name_or_path to load (dequantized to train it)."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer folder if not the model's own."}
    )


@dataclass
class SFTLoRAConfig(SFTConfig):
    """`SFTConfig` with defaults for LoRA SFT that also run on a CPU.

    Defaults that differ from `SFTConfig`:
        learning_rate: 2e-4 (LoRA adapters, not full fine-tuning).
        activation_checkpointing (alias gradient_checkpointing): off (TRL: on; it costs ~30% time and small models
            do not need it).
        bf16: None -> True only on a CUDA GPU that supports it (TRL: True even on CPU).
        eval_strategy / save_strategy: "epoch"; load_best_model_at_end: True; metric_for_best_model: "eval_loss".
        save_total_limit: 2 (the best and the latest checkpoint survive).
        eval_on_start: None -> True when there is evaluation data and the run does not resume (`check_arguments`);
            the recipe reports that step-0 evaluation as `eval_before_*`. It runs inside `train()`: an evaluate()
            before train() would prepare the model for inference only (no DDP wrapper, a ZeRO inference engine).
    Added:
        early_stopping_patience: stop when `eval_loss` has not improved this many evaluations in a row.
        early_stopping_threshold: minimum improvement that counts.
    """

    learning_rate: float = field(default=2e-4, metadata={"help": "Initial AdamW learning rate."})
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (off unless set)."}
    )
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on a bf16 CUDA GPU."})
    eval_strategy: str = field(default="epoch", metadata={"help": "When to evaluate: no, steps or epoch."})
    save_strategy: str = field(default="epoch", metadata={"help": "When to save a checkpoint: no, steps or epoch."})
    load_best_model_at_end: bool = field(default=True, metadata={"help": "Keep the adapter with the best eval_loss."})
    metric_for_best_model: str | None = field(default="eval_loss", metadata={"help": "Metric that picks the best."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Checkpoints kept (the best one always)."})
    eval_on_start: bool | None = field(
        default=None, metadata={"help": "Evaluate at step 0 (default: with evaluation data, unless resuming)."}
    )
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": "Stop after this many evaluations without eval_loss improvement."}
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "Minimum eval_loss decrease that counts as an improvement."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace a non-empty output_dir's files when this run finishes."}
    )

    def __post_init__(self):
        check_training_arguments(self)  # issue 15: refuse a zero/negative learning rate or max_steps 0
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        super().__post_init__()


@dataclass
class SupervisedNLL(ModelOutput):
    """Output of a model patched by `add_supervised_nll` and called with `supervised_nll=True`.

    Args:
        nll_sum (`torch.FloatTensor`, scalar): summed next-token NLL (nats) over the K supervised positions.
        predictions (`torch.LongTensor` of shape `(K,)`): argmax token at each supervised position.
        targets (`torch.LongTensor` of shape `(K,)`): the supervised next tokens.
    """

    nll_sum: torch.Tensor | None = None
    predictions: torch.Tensor | None = None
    targets: torch.Tensor | None = None


LOGIT_SCALE_FIELDS = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
"""Config fields that rescale a model's logits (TRL's `add_fused_lm_head` reads them); `add_supervised_nll` does not
apply them, so a model that sets one keeps TRL's loss."""


def add_supervised_nll(model, owner: torch.nn.Module | None = None) -> None:
    """Patch `model.forward` (as TRL's `add_fused_lm_head` does, and on top of it) so that
    `model(..., labels=labels, supervised_nll=True)` returns a `SupervisedNLL` instead of logits: the backbone
    (`model.base_model`) runs, the hidden states at the K positions whose next-token label is not -100 are kept, and
    `linear_cross_entropy` (chunked) scores them against `get_output_embeddings().weight` with the text config's
    `final_logit_softcapping` — no `(batch, seq, vocab)` logits, and none at unsupervised positions. Without
    `supervised_nll` the forward is the previous one. Patch the model before PEFT wraps it or its base model after:
    the call must go through the wrappers (DDP, PEFT) so that their hooks run. `owner` is the outermost model (the
    PEFT model) whose forward runs this one: under ZeRO-3 the output embedding is gathered for its forward (PEFT
    calls the base model's `forward` directly, so the base model's own ZeRO hooks do not run)."""
    previous_forward = model.forward
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    @functools.wraps(type(model).forward)
    def forward(self, *args, supervised_nll=False, **kwargs):
        if not supervised_nll:
            return previous_forward(*args, **kwargs)
        weight = self.get_output_embeddings().weight
        register_zero3_owner(owner if owner is not None else self, weight)
        labels = kwargs.pop("labels")
        kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]  # (B, T-1, C)
        targets = labels[:, 1:].to(hidden.device)  # (B, T-1)
        supervised = targets != -100
        nll_sum, predictions = linear_cross_entropy(
            hidden[supervised], weight, targets[supervised], softcap,
            return_predictions=True, backend="chunked",
        )  # (), (K,)
        return SupervisedNLL(nll_sum=nll_sum, predictions=predictions, targets=targets[supervised])

    model.forward = types.MethodType(forward, model)


class HFL3SFTTrainer(NonFiniteGuard, SFTOutputs, SFTTrainer):  # NonFiniteGuard first: it checks before a save
    """TRL's `SFTTrainer` for pre-tokenized, pre-masked rows, with provenance on every save.

    Differences from `SFTTrainer`:
    - every dataset must carry `labels` (-100 off the loss): hfl3 masks and truncates itself (`hfl3.data.masks`),
      so a dataset without them would silently train on every token and is refused;
    - off CUDA/XPU (CPU, MPS) the loss is a chunked linear + cross-entropy over the supervised positions only
      (`compute_loss`, `add_supervised_nll`): TRL's fused LM head compacts to those positions only where Triton runs
      and otherwise scores every position through an eager online-softmax loop over 4096 × 32768 tiles (slower, and
      more memory on CPU); on GPUs TRL's fused, chunked path is kept. Neither builds `(batch, seq, vocab)` logits;
    - `eval_loss` is the token-weighted mean NLL over all supervised tokens of the evaluation set (HF averages the
      per-batch means), and `eval_perplexity = exp(eval_loss)` is added (same for any `metric_key_prefix`);
    - output folders and checkpoints as `hfl3.trainers.outputs.SFTOutputs` makes them: staged and renamed when
      complete, resumable from `latest`, no `training_args.bin`, and with `provenance` (a `build_metadata` dict)
      `metadata.json`, the `.safetensors` headers and the model card on every save.

    Args:
        provenance: metadata to attach to every saved artifact; may be replaced before the final `save_model`.
        **kwargs: as for `SFTTrainer`.

    Raises:
        ValueError: a train/eval dataset has `input_ids` but no `labels`.
    """

    _tag_names = ["trl", "sft", "hfl3", "lora"]

    def __init__(self, *args, provenance: dict | None = None, **kwargs):
        for name in ("train_dataset", "eval_dataset"):
            dataset = kwargs.get(name)
            columns = getattr(dataset, "column_names", None) or []
            if "input_ids" in columns and "labels" not in columns:
                raise ValueError(f"{name} has input_ids but no labels; build it with hfl3.data.sft.load_sft_data")
        super().__init__(*args, **kwargs)
        self.provenance = provenance
        self._eval_nll_sum = self._eval_token_count = None
        self.compact_loss = self._compact_loss_applies()
        if self.compact_loss:
            add_supervised_nll(self._base_model(), owner=self.model)

    def _base_model(self):
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _compact_loss_applies(self) -> bool:
        """Off CUDA/XPU, for a plain NLL loss of a text model whose logits are `softcap(hidden @ lm_head.weightᵀ)`
        (no bias, no logit scaling), without sequence or context parallelism."""
        model = self._base_model()
        text_config = model.config.get_text_config()
        head = model.get_output_embeddings()
        parallel = self.accelerator.parallelism_config
        return (
            self.args.device.type not in ("cuda", "xpu")
            and text_config is model.config
            and isinstance(head, torch.nn.Linear)
            and head.bias is None
            and all(getattr(text_config, name, None) is None for name in LOGIT_SCALE_FIELDS)
            and self.args.loss_type == "nll"
            and self.compute_loss_func is None
            and self.label_smoother is None
            and not self.aux_loss_enabled
            and (parallel is None or not (parallel.sp_enabled or parallel.cp_enabled))
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Mean next-token NLL over the supervised tokens (divided by `num_items_in_batch` when given, so gradient
        accumulation is exact), scored only at the supervised positions by `add_supervised_nll`'s chunked linear +
        cross-entropy (the model's `final_logit_softcapping` applies). Delegates to `SFTTrainer.compute_loss` when
        `self.compact_loss` is False or outputs are requested."""
        if not self.compact_loss or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        outputs = model(**inputs, supervised_nll=True)
        count = (inputs["labels"][:, 1:] != -100).sum()
        loss = outputs.nll_sum / (count.clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # Like Trainer.compute_loss: num_items_in_batch counts every rank's tokens and DDP averages the gradients
            loss = loss * self.accelerator.num_processes
        # Per-rank sums are gathered with `gather`, not `gather_for_metrics`: at the last batch of an epoch the
        # latter cuts what it gathers to the dataset's remainder of samples, which is meaningless for sums (and broke
        # on the [correct, count] pair when the remainder was 1)
        with torch.no_grad():
            correct = (outputs.predictions == outputs.targets).sum()
            correct, count_all = self.accelerator.gather(torch.stack([correct, count])).view(-1, 2).sum(0)
            self._metrics[mode]["mean_token_accuracy"].append((correct / count_all.clamp(min=1)).item())
        if mode == "train":
            # Padding-free (packed) batches have no attention mask and no padding
            ids = inputs["input_ids"]
            real_tokens = inputs["attention_mask"].sum() if "attention_mask" in inputs else ids.new_tensor(ids.numel())
            self._total_train_tokens += self.accelerator.gather(real_tokens).sum().item()
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        # The loss of a batch is the mean over its supervised next-token positions (labels shifted by one)
        tokens = (inputs["labels"][..., 1:] != -100).sum().to(loss.device)
        self._eval_nll_sum += self.accelerator.gather(loss.detach().float() * tokens).sum()
        self._eval_token_count += self.accelerator.gather(tokens).sum()
        return loss, logits, labels

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        self._eval_nll_sum = torch.zeros((), device=self.args.device)
        self._eval_token_count = torch.zeros((), device=self.args.device, dtype=torch.long)
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if self._eval_token_count > 0:
            loss = (self._eval_nll_sum / self._eval_token_count).item()
            output.metrics[f"{metric_key_prefix}_loss"] = loss
            output.metrics[f"{metric_key_prefix}_perplexity"] = math.exp(loss) if loss < 700 else math.inf
            output.metrics[f"{metric_key_prefix}_supervised_tokens"] = int(self._eval_token_count.item())
        return output


def load_tokenizer(model_args: SFTModelArguments, training_args: SFTLoRAConfig):
    """The tokenizer of `tokenizer_name_or_path` or the model, with `training_args.chat_template_path` (a `.jinja`
    file) applied here, before masking, and cleared so TRL does not apply it again.

    Raises:
        ValueError: if `chat_template_path` is not a `.jinja`/`.j2` file (TRL's tokenizer-folder form would add
            tokens after the data were tokenized).
    """
    path = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    use_gguf = model_args.gguf_file and not model_args.tokenizer_name_or_path
    kwargs = {"gguf_file": model_args.gguf_file} if use_gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=training_args.trust_remote_code, **kwargs)
    if training_args.chat_template_path:
        template = Path(training_args.chat_template_path)
        if template.suffix not in (".jinja", ".j2") or not template.is_file():
            raise ValueError(f"chat_template_path={template}: give a .jinja file (applied before tokenization)")
        tokenizer.chat_template = template.read_text(encoding="utf-8")
        training_args.chat_template_path = None
    return tokenizer


def load_causal_lm(model_args: SFTModelArguments, training_args: SFTLoRAConfig):
    """`AutoModelForCausalLM.from_pretrained` of a local folder or Hub id, a GGUF file (`gguf_file`) or an L3GPT
    checkpoint (registered by `import hfl3`), in `model_args.dtype` (float32 by default).

    A GGUF file is dequantized: every weight (Q8_0, Q4_K, F16, ...) becomes a dense tensor in `model_args.dtype`, and
    the model carries no quantizer, so PEFT and the Trainer train it like any other. (transformers otherwise keeps
    its GGUF quantizer on the model, which the Trainer refuses: "quantized with QuantizationMethod.GGUF ... do not
    support training".)

    Raises:
        ImportError: `gguf_file` without the `gguf` package (transformers reads Llama/Qwen/Gemma GGUF files with it).
    """
    kwargs = dict(
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=training_args.trust_remote_code,
        revision=model_args.model_revision,
    )
    if model_args.gguf_file:
        # dequantize=True: HfQuantizer.postprocess_model then drops the quantizer and quantization_config
        kwargs.update(gguf_file=model_args.gguf_file, quantization_config=GgufConfig(dequantize=True))
    return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **kwargs)


def lora_config(model_args: SFTModelArguments):
    """PEFT `LoraConfig` from `lora_r`, `lora_alpha`, `lora_dropout`, `lora_target_modules` (a list of names, or
    `"all-linear"`; a single name is not taken as a regex as PEFT would do with a plain string)."""
    from peft import LoraConfig

    targets = model_args.lora_target_modules
    if isinstance(targets, str) and targets != "all-linear":
        targets = [targets]
    return LoraConfig(
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets,
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        bias="none",
        task_type="CAUSAL_LM",
    )


def config_sha256(config) -> str:
    """SHA-256 of a model config's canonical JSON, without the fields that name where or with what it was saved
    (`_name_or_path`, `transformers_version`)."""
    values = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return sha256_records([values])


def check_arguments(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments):
    """Reject combinations that would train something else than asked; resolve `eval_on_start`.

    Raises:
        ValueError: no model; no or two data sources; `use_peft=False`; evaluation or early stopping requested
            without evaluation data; early stopping without `load_best_model_at_end`.
    """
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required (a folder, a Hub id, or the folder of --gguf_file)")
    if bool(script_args.train_file) == bool(script_args.stdlib_chats):
        raise ValueError("give exactly one of --train_file and --stdlib_chats")
    if not model_args.use_peft:
        raise ValueError("this recipe trains LoRA adapters; --use_peft false is not supported")
    has_eval = bool(script_args.eval_file or script_args.val_split)
    if training_args.eval_strategy != "no" and not has_eval:
        raise ValueError(
            f"eval_strategy={training_args.eval_strategy.value} needs --eval_file or --val_split; or pass "
            "--eval_strategy no --load_best_model_at_end false"
        )
    if training_args.early_stopping_patience and not (has_eval and training_args.load_best_model_at_end):
        raise ValueError("--early_stopping_patience needs evaluation data and --load_best_model_at_end true")
    if training_args.eval_on_start is None:
        training_args.eval_on_start = has_eval and not training_args.resume_from_checkpoint


def build_sft_trainer(
    script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments
) -> tuple[HFL3SFTTrainer, SFTData, dict]:
    """Tokenizer, masked data, base model, LoRA and trainer, exactly as `recipes/sft_lora.py` runs them.

    Returns:
        `(trainer, data, metadata)`; `metadata` (data, base model, LoRA, arguments) is also `trainer.provenance`,
        so every checkpoint carries it. Early stopping is not attached yet (see `add_early_stopping`).
    """
    from hfl3.provenance import build_metadata

    check_arguments(script_args, training_args, model_args)
    tokenizer = load_tokenizer(model_args, training_args)
    train_file = script_args.train_file
    if script_args.stdlib_chats:
        # Each node's first process writes the file, the others read it (one file, no concurrent writers); in the
        # staging area: output_dir is not touched before training
        train_file = work_dir(training_args.output_dir) / "stdlib_chats.jsonl"
        with training_args.main_process_first(desc="stdlib chats"):
            if training_args.local_process_index == 0:
                write_chat_jsonl(stdlib_docstring_chats(script_args.stdlib_chats, seed=training_args.seed), train_file)
    data = load_sft_data(
        tokenizer,
        train_file,
        eval_file=script_args.eval_file,
        val_split=script_args.val_split,
        seed=training_args.seed,
        max_length=training_args.max_length,
        skip_invalid_records=script_args.skip_invalid_records,
    )
    model = load_causal_lm(model_args, training_args)
    check_vocabulary_fits(tokenizer, model)  # issue 15: a clear error, not an IndexError in the first forward
    trained_length = getattr(model.config, "max_position_embeddings", None)
    if trained_length and training_args.max_length and training_args.max_length > trained_length:
        logger.warning(
            "max_length %d exceeds the base model's max_position_embeddings %d: positions beyond it were never "
            "trained (RoPE extrapolates, quality may drop); pass --max_length %d to stay inside",
            training_args.max_length, trained_length, trained_length,
        )
    peft_config = lora_config(model_args)
    metadata = build_metadata(
        data=data.provenance,
        base_model={
            "name_or_path": model_args.model_name_or_path,
            "gguf_file": model_args.gguf_file,
            "model_type": model.config.model_type,
            "config_sha256": config_sha256(model.config),
            "num_parameters": model.num_parameters(),
        },
        lora=peft_config.to_dict(),
        script_args=script_args,
        model_args=model_args,
        training_args=training_args.to_dict(),
    )
    trainer = HFL3SFTTrainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        peft_config=peft_config,
        provenance=metadata,
    )
    return trainer, data, metadata


def add_early_stopping(trainer: HFL3SFTTrainer) -> None:
    """Attach `EarlyStoppingCallback` when `early_stopping_patience` is set. The step-0 evaluation
    (`eval_on_start`) does not count: transformers only updates `best_metric` from evaluations after a step."""
    args = trainer.args
    if args.early_stopping_patience:
        trainer.add_callback(EarlyStoppingCallback(args.early_stopping_patience, args.early_stopping_threshold))


@torch.no_grad()
def answer_prompts(
    model, tokenizer, prompts: list[str], max_new_tokens: int, end_of_turn: str | None = None
) -> list[dict]:
    """Greedy answers of `model` to single-turn user `prompts`, through the tokenizer's chat template; generation
    stops at `tokenizer.eos_token`, at the template's `end_of_turn` text when it is one token, or after
    `max_new_tokens`.

    Returns:
        `[{"prompt": ..., "answer": ...}, ...]` (answers decoded without special tokens).
    """
    stop_ids = {tokenizer.eos_token_id}
    if end_of_turn is not None:
        end_ids = tokenizer(end_of_turn, add_special_tokens=False)["input_ids"]
        stop_ids.update(end_ids if len(end_ids) == 1 else [])
    model.eval()
    answers = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt").to(model.device)
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(i for i in stop_ids if i is not None),
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        answers.append({"prompt": prompt, "answer": answer.strip()})
    return answers


def save_merged_model(trainer: HFL3SFTTrainer, folder: str | os.PathLike, metadata: dict) -> Path:
    """Merge the LoRA weights into the base model (`merge_and_unload`, in place: call last) and save a full model
    loadable with `AutoModelForCausalLM.from_pretrained` (L3GPT: after `import hfl3`), with tokenizer and
    provenance."""
    folder = Path(folder)
    merged = trainer.accelerator.unwrap_model(trainer.model).merge_and_unload()
    merged.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    merged_metadata = {**metadata, "merged": True}
    stamp_folder(folder, merged_metadata, sft_model_card(merged_metadata, str(folder), folder, adapter=False))
    return folder
