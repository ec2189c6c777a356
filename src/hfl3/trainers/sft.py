"""SFT on chat data: `ChatSFTConfig(SFTConfig)`, `ChatSFTTrainer(SFTTrainer)` and the extra outputs (`save_samples`,
`save_merged_model`); the output folder (staging, provenance, card, loss plot, push) is `hfl3.trainers.hooks`'.
`hfl3.trainers.sft_builder` builds a run (tokenizer, data, base model, trainer) for `recipes/sft_lora.py`."""

import copy
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import IntervalStrategy
from trl import SFTConfig, SFTTrainer

import hfl3  # noqa: F401  (registers L3GPT with the Auto classes)
from hfl3.atomic import write_json_atomic
from hfl3.evaluate.chat_callback import ChatCoreArguments, ChatCoreCallback, check_chatcore_arguments
from hfl3.generation import answer_prompts
from hfl3.provenance import base_lineage, portable, stamp_folder
from hfl3.trainers.arguments import check_training_arguments
from hfl3.trainers.base_model import merge_adapter
from hfl3.trainers.cards import sft_model_card, usage_name
from hfl3.trainers.flags import with_choices
from hfl3.trainers.hooks import TrainerHooks
from hfl3.trainers.launch import ProcessGroupTimeout
from hfl3.trainers.optimizers import MuonTrainingArguments
from hfl3.trainers.outputs import base_model_hub_id
from hfl3.trainers.supervised_nll import LOGIT_SCALE_FIELDS, add_supervised_nll

logger = logging.getLogger(__name__)


@dataclass
class ChatSFTConfig(ProcessGroupTimeout, ChatCoreArguments, MuonTrainingArguments, SFTConfig):
    """`SFTConfig` with defaults for SFT that also run on a CPU, LoRA (`--use_peft`, the default) or every weight
    (`--use_peft false`), with the Trainer's optimizers or MuonAdamW (`--optim muon`: the fields and groups of
    pretraining, `hfl3.trainers.optimizers.MuonTrainingArguments`, with nanochat chat SFT's schedule).

    Defaults that differ from `SFTConfig`:
        assistant_only_loss: True (TRL: False): the loss is on the assistant replies, masked from the model's own
            template by hfl3 (`hfl3.data.masks`; TRL needs `{% generation %}` markers); False trains the whole
            sequence, as TRL does. `completion_only_loss` (TRL's None: on) acts on prompt-completion records.
        learning_rate: 2e-4 for LoRA adapters; full fine-tuning (`--use_peft false`) takes TRL's 2e-5 unless it is
            given (decided with the model arguments, `hfl3.trainers.arguments.check_sft_inputs`). Not used by Muon.
        lr_scheduler_type: None -> "linear" (TRL's), or with Muon "warmup_stable_decay": warmup (`warmup_steps`,
            none by default) → constant → linear warmdown over the last `warmdown_ratio` (0.5) of the steps to
            `final_lr_frac` (0), starting at `init_lr_frac` (0.8) × the group LRs (karpathy/nanochat 92d63d4,
            scripts/chat_sft.py).
        activation_checkpointing (alias gradient_checkpointing): off (TRL: on; it costs ~30% time and small models
            do not need it).
        bf16: None -> True only on a CUDA GPU that supports it (TRL: True even on CPU).
        eval_strategy: None -> "epoch"; the recipe turns evaluation off when it has no evaluation data and
            `eval_strategy` was not given (`evaluate_by_default`, one log line says so).
        save_strategy: None -> "steps" when `save_steps` is given (transformers' and TRL's default strategy), else
            `eval_strategy` ("epoch" when that is "no"); with "steps", `save_steps` follows `eval_steps` unless given
            (a checkpoint at every evaluation, as `load_best_model_at_end` needs).
        load_best_model_at_end: None -> True when evaluating and the checkpoints follow the evaluations, else False
            with a log line saying why (`best_model_problem`: `--save_strategy no`, a `save_steps` given alone
            against epoch evaluations); metric_for_best_model: "eval_loss".
    A refusal that involves a value chosen here (`hfl3_choices`) says so and names the flag that changes it
    (`hfl3.trainers.flags.with_choices`).
        save_total_limit: 2 (the best and the latest checkpoint survive).
        eval_on_start: None -> True when there is evaluation data and the run does not resume
            (`hfl3.trainers.arguments.decide_evaluation`); reported as `eval_before_*`
            (`hfl3.trainers.training.train_and_evaluate`). It runs inside `train()`: an evaluate() before train() would prepare the model for
            inference only (no DDP wrapper, a ZeRO inference engine).
        dataset_kwargs: None -> `{"skip_prepare_dataset": True}` unless packing: the rows come tokenized, masked and
            truncated to `max_length` (`hfl3.data.sft.load_sft_data`), and TRL's preparation would only copy them
            twice (truncating again, dropping rows without a label, of which there are none).
    Added:
        early_stopping_patience: stop when `eval_loss` has not improved this many evaluations in a row.
        early_stopping_threshold: minimum improvement that counts.
        init_lr_frac: with Muon, the LRs start at this fraction of the group LRs (nanochat chat SFT: 0.8).
        load_optimizer: with Muon or AdamW over every weight, warm-start the optimizer from the base's
            `optimizer/optimizer.safetensors` (nanochat chat SFT's `--load-optimizer`); None: when the base folder
            has the state of this run's optimizer.
        use_muon, the Muon group LRs (`matrix_lr`, ...), `warmdown_ratio` (here 0.5), `final_lr_frac`: as
            pretraining's, and inherited from a base that `recipes/pretrain.py` wrote unless given.
        chatcore_every, chatcore_max_cat, chatcore_max_sample, chatcore_max_new_tokens, chatcore_data_dir: ChatCORE
            during training (`hfl3.evaluate.chat_callback.ChatCoreArguments`).
    """

    _argument_group_name = "training (ChatSFTConfig: trl.SFTConfig with hfl3's defaults; early_stopping_* last)"

    learning_rate: float = field(default=2e-4, metadata={"help": "Initial AdamW learning rate (LoRA: 2e-4; full "
                                                                "fine-tuning: 2e-5 unless given; Muon: not used)."})
    assistant_only_loss: bool = field(default=True, metadata={
        "help": "Loss on the assistant replies the model's chat template renders (hfl3's masks; default: on); false: "
                "on the whole sequence, as TRL's default."})
    optim: str = field(default=TrainingArguments.optim, metadata={
        "help": "One of transformers' OptimizerNames (default: transformers' and TRL's, adamw_torch_fused with torch "
                ">= 2.8), or muon (MuonAdamW over every weight: --use_peft false)."})
    lr_scheduler_type: str | None = field(default=None, metadata={
        "help": "LR schedule (default: linear; with --optim muon: warmup_stable_decay, nanochat chat SFT's)."})
    warmdown_ratio: float = field(default=0.5, metadata={"help": "Share of steps in the final linear warmdown "
                                                         "(warmup_stable_decay; nanochat chat SFT: 0.5)."})
    init_lr_frac: float = field(default=0.8, metadata={"help": "With --optim muon: the LRs start at this fraction "
                                                       "of the group LRs (nanochat chat SFT)."})
    load_optimizer: bool | None = field(default=None, metadata={
        "help": "Warm-start the optimizer from the base's optimizer/optimizer.safetensors (a recipes/pretrain.py "
                "output); default: when it holds this run's optimizer's state."})
    save_steps: float | None = field(default=None, metadata={
        "help": "Save every N steps (given alone: --save_strategy steps); default: at every evaluation, else 500."})
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (off unless set)."}
    )
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on a bf16 CUDA GPU."})
    eval_strategy: str | None = field(
        default=None, metadata={"help": "When to evaluate: no, steps or epoch (default: epoch with evaluation data)."}
    )
    save_strategy: str | None = field(
        default=None, metadata={"help": "When to save a checkpoint: no, steps, epoch or best (default: as eval)."}
    )
    load_best_model_at_end: bool | None = field(
        default=None, metadata={"help": "Keep the adapter with the best eval_loss (default: when evaluating)."}
    )
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
        self.take_muon_out_of_optim()
        check_training_arguments(self)  # a zero/negative learning rate or max_steps 0 trains nothing
        check_chatcore_arguments(self)
        if self.lr_scheduler_type is None:
            self.lr_scheduler_type = "warmup_stable_decay" if self.use_muon else "linear"
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        self.evaluate_by_default = self.eval_strategy is None and not self.load_best_model_at_end
        choices = {}  # what hfl3 chose for the user: {field: what a refusal naming it adds}
        if self.eval_strategy is None:
            self.eval_strategy = "epoch"
            choices["eval_strategy"] = "hfl3's default with evaluation data"
        evaluating = IntervalStrategy(self.eval_strategy) != IntervalStrategy.NO
        steps_evaluation = IntervalStrategy(self.eval_strategy) == IntervalStrategy.STEPS
        if self.save_strategy is None:
            if self.save_steps is not None:  # a step count given alone saves by steps, as the Trainer's default does
                self.save_strategy = "steps"
                choices["save_strategy"] = "hfl3's choice for a --save_steps given alone"
            else:
                self.save_strategy = self.eval_strategy if evaluating else "epoch"
                choices["save_strategy"] = "hfl3's default: as --eval_strategy"
                if steps_evaluation:
                    self.save_steps = self.eval_steps or self.logging_steps
                    choices["save_steps"] = "hfl3's default: --eval_steps"
        if self.save_steps is None:
            self.save_steps = 500  # transformers' default
        if self.load_best_model_at_end is None:
            problem = self.best_model_problem() if evaluating else None
            if problem:
                logger.info("no best-model selection (hfl3's default when evaluating is off here): %s", problem)
            self.load_best_model_at_end = evaluating and problem is None
            choices["load_best_model_at_end"] = ("hfl3's default when evaluating" if self.load_best_model_at_end else
                                                 "hfl3's default where no checkpoint follows every evaluation")
        if self.dataset_kwargs is None and not self.packing and not self.eval_packing:
            self.dataset_kwargs = {"skip_prepare_dataset": True}
        self.hfl3_choices = {name: f"{name}={getattr(getattr(self, name), 'value', getattr(self, name))} is {why}, "
                             f"not a value you gave; --{name} changes it" for name, why in choices.items()}
        try:
            super().__post_init__()
        except ValueError as error:  # transformers' checks of the save and evaluation settings, among others
            raise ValueError(with_choices(str(error), self.hfl3_choices)) from None

    def best_model_problem(self) -> str | None:
        """Why the checkpoints do not follow the evaluations, which best-model selection needs (transformers'
        rule: the same strategy, or `--save_strategy best`; by steps, `--save_steps` a multiple of `--eval_steps`),
        naming the flags; None when they do."""
        save, evaluation = IntervalStrategy(self.save_strategy).value, IntervalStrategy(self.eval_strategy).value
        if save == "best":
            return None
        if save != evaluation:
            return (f"--save_strategy {save} with --eval_strategy {evaluation} keeps no checkpoint of every "
                    f"evaluation to pick the best from; pass --save_strategy {evaluation} for it")
        eval_steps = self.eval_steps or self.logging_steps
        if save == "steps" and eval_steps >= 1 and self.save_steps >= 1 and self.save_steps % eval_steps:
            return (f"--save_steps {self.save_steps:g} is not a multiple of --eval_steps {eval_steps:g}; pass a "
                    "multiple for it")
        return None


class ChatSFTTrainer(TrainerHooks, SFTTrainer):
    """TRL's `SFTTrainer` for pre-tokenized, pre-masked rows, with provenance on every save.

    Differences from `SFTTrainer`:
    - every dataset must carry `labels` (-100 off the loss): hfl3 masks and truncates itself (`hfl3.data.masks`),
      so a dataset without them would silently train on every token and is refused;
    - off CUDA/XPU (CPU, MPS) the loss is a chunked linear + cross-entropy over the supervised positions only
      (`compute_loss`, `add_supervised_nll`): TRL's fused LM head compacts to those positions only where Triton runs
      and otherwise scores every position through an eager online-softmax loop over 4096 × 32768 tiles (slower, and
      more memory on CPU); on GPUs TRL's fused, chunked path is kept. Neither builds `(batch, seq, vocab)` logits.
      The compact path logs what TRL's would (`mean_token_accuracy` per micro-batch, averaged at each log;
      `num_tokens`, the non-padding training tokens so far), kept in `micro_batch_metrics` and added to the next log
      (`TrainerHooks.log`);
    - `eval_loss` is the token-weighted mean NLL over all supervised tokens of the evaluation set (HF averages the
      per-batch means), and `eval_perplexity = exp(eval_loss)` is added (same for any `metric_key_prefix`);
    - output folders and checkpoints as hfl3's hooks make them (`hfl3.trainers.hooks.TrainerHooks`): staged and
      renamed when complete, resumable from `latest`, no `training_args.bin`, and with `provenance` (a
      `build_metadata` dict) `metadata.json`, the `.safetensors` headers and the adapter's card on every save; the
      adapter's `adapter_config.json` names a local base by its absolute path, and the copy pushed to the Hub the
      base's Hub id (`hub_files`).

    Args:
        provenance: metadata to attach to every saved artifact; may be replaced before the final `save_model`.
        train_supervised_tokens: the supervised tokens of one epoch of `train_dataset` (`SFTData`), for the results'
            `train_supervised_tokens` and their rate (`run_results`).
        **kwargs: as for `SFTTrainer` (and `output_folder`, `optimizer_state`: `TrainerHooks`').

    Raises:
        ValueError: a train/eval dataset has `input_ids` but no `labels`.
    """

    _tag_names = ["trl", "sft", "hfl3", "lora"]

    def hand_over_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments `SFTTrainer` is built with (`TrainerHooks.__init__` calls this first): what TRL would do
        again to hfl3's finished rows, handed over off in a copy of the training arguments: its assistant-only masks
        (it refuses the flag with tokenized rows, asking for a conversational dataset and a template with generation
        markers), and, for padding-free rows without packing, the `max_length` it refuses them with (it asks for
        rows truncated already, which hfl3's are). Takes `train_supervised_tokens` out of `kwargs`.

        Raises:
            ValueError: a train/eval dataset has `input_ids` but no `labels`."""
        self.train_supervised_tokens = kwargs.pop("train_supervised_tokens", None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        handed = {}
        if training_args is not None and training_args.assistant_only_loss:
            handed["assistant_only_loss"] = False
        if training_args is not None and training_args.padding_free and not training_args.packing:
            handed["max_length"] = None
        if handed:
            training_args = copy.copy(training_args)
            for name, value in handed.items():
                setattr(training_args, name, value)
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (*args[:1], training_args, *args[2:])
        for name in ("train_dataset", "eval_dataset"):
            dataset = kwargs.get(name)
            columns = getattr(dataset, "column_names", None) or []
            if "input_ids" in columns and "labels" not in columns:
                raise ValueError(f"{name} has input_ids but no labels; build it with hfl3.data.sft.load_sft_data")
        return args, kwargs

    def set_up(self) -> None:
        """After `SFTTrainer.__init__`: the evaluation's token-weighted loss sums and, where it applies
        (`_compact_loss_applies`), the compact CPU loss patched onto the model (`add_supervised_nll`)."""
        self._eval_nll_sum = self._eval_token_count = None
        self._compact_train_tokens = 0
        self.compact_loss = self._compact_loss_applies()
        if self.compact_loss:
            add_supervised_nll(self._base_model(), owner=self.model)

    def model_card(self, metadata: Mapping[str, Any]) -> dict:
        """`write_model_card` arguments for the adapter (`sft_model_card`)."""
        return sft_model_card(metadata, usage_name(self), adapter=True)

    def base_hub_id(self, local_name: str | None = None) -> str | None:
        """The base model's Hub id: `provenance["base_model"]["hub_id"]` (the recipe's `--base_model_hub_id`, or
        `base_model_hub_id`), else `base_model_hub_id(local_name)`."""
        known = ((self.provenance or {}).get("base_model") or {}).get("hub_id")
        return known or (base_model_hub_id(local_name) if local_name else None)

    def hub_files(self, folder: Path) -> dict[str, Any]:
        """The pushed `adapter_config.json` names the base's Hub id, never a local path.

        Raises:
            ValueError: the base is a local folder with no known Hub id (the recipe refuses this before training).
        """
        config = folder / "adapter_config.json"
        if not config.is_file():
            return {}
        values = json.loads(config.read_text())
        hub_id = self.base_hub_id(values.get("base_model_name_or_path"))
        if hub_id is None:
            raise ValueError(f"not pushed: the base model {portable(values.get('base_model_name_or_path'))} is a "
                             "local folder with no Hub id; pass --base_model_hub_id USER/NAME")
        return {"adapter_config.json": {**values, "base_model_name_or_path": hub_id}}

    @property
    def chatcore(self) -> ChatCoreCallback | None:
        """ChatCORE's callback (`--chatcore_every`), or None."""
        return next((c for c in self.callback_handler.callbacks if isinstance(c, ChatCoreCallback)), None)

    def run_results(self) -> dict:
        """What `hfl3.trainers.training.train_and_evaluate` adds to the results: `train_supervised_tokens` (those of
        one epoch times the epochs trained) and their rate over `train_runtime` (which includes the evaluations and
        checkpoint saves made during training), when the epoch's count is known; the final ChatCORE metrics
        (`--chatcore_every`)."""
        chatcore = self.chatcore
        results = chatcore.latest.metrics("eval_") if chatcore and chatcore.latest else {}
        if self.train_supervised_tokens is None:
            return results
        tokens = int(self.train_supervised_tokens * (self.state.epoch or 0.0))
        runtime = next((e["train_runtime"] for e in reversed(self.state.log_history) if "train_runtime" in e), None)
        return {**results, "train_supervised_tokens": tokens,
                "train_supervised_tokens_per_second": tokens / runtime if runtime else None}

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
        metrics = self.micro_batch_metrics[mode]
        with torch.no_grad():
            correct = (outputs.predictions == outputs.targets).sum()
            correct, count_all = self.accelerator.gather(torch.stack([correct, count])).view(-1, 2).sum(0)
            metrics["mean_token_accuracy"].append((correct / count_all.clamp(min=1)).item())
        if mode == "train":
            # Padding-free (packed) batches have no attention mask and no padding
            ids = inputs["input_ids"]
            real_tokens = inputs["attention_mask"].sum() if "attention_mask" in inputs else ids.new_tensor(ids.numel())
            self._compact_train_tokens += self.accelerator.gather(real_tokens).sum().item()
        metrics["num_tokens"] = [self._compact_train_tokens]
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
        if chatcore := self.chatcore:  # when due at this step (ChatCoreCallback)
            output.metrics.update(chatcore.evaluation_metrics(metric_key_prefix))
        return output


def save_merged_model(trainer: ChatSFTTrainer, folder: str | os.PathLike, metadata: dict) -> Path | None:
    """Merge the LoRA weights into the base model (`merge_and_unload`, in place: call last) and save a full model
    loadable with `AutoModelForCausalLM.from_pretrained` (L3GPT: after `import hfl3`), with tokenizer and
    provenance; on the main process (the others return None), which logs where."""
    if not trainer.is_world_process_zero():
        return None
    folder = Path(folder)
    merged = merge_adapter(trainer.accelerator.unwrap_model(trainer.model))  # a quantized base: dequantized first
    merged.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)
    # the adapter folder (staged, stamped) is the merged model's base: its link names where it will be committed
    merged_metadata = {**metadata, "merged": True,
                       "lineage": base_lineage(folder.parent, name=trainer.final_output_dir)}
    stamp_folder(folder, merged_metadata, sft_model_card(merged_metadata, usage_name(trainer, folder), adapter=False))
    logger.info("merged model written to %s", Path(trainer.final_output_dir) / folder.name)
    return folder


def save_samples(trainer: ChatSFTTrainer, prompts: list[str], max_new_tokens: int, end_of_turn: str | None) -> None:
    """`samples.json` in `args.output_dir` (the staged folder inside `finish_output`): the trained model's greedy
    answers to `prompts` (`hfl3.generation.answer_prompts`), written and logged by the main process."""
    if not trainer.is_world_process_zero():
        return
    samples = answer_prompts(trainer.model, trainer.processing_class, prompts, max_new_tokens, end_of_turn=end_of_turn)
    write_json_atomic(Path(trainer.args.output_dir) / "samples.json", samples)
    for sample in samples:
        logger.info("Q: %s\nA: %s", sample["prompt"], sample["answer"])
