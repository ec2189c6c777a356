"""SFT on chat data: `ChatSFTTrainer(SFTTrainer)`, its loss at the supervised positions only (`add_supervised_nll`:
the model's forward patched to return the summed next-token NLL of the positions whose label is not -100, chunked
linear + cross-entropy, without `(batch, seq, vocab)` logits; used off CUDA/XPU) and the extra outputs
(`save_samples`, `save_merged_model`). The arguments are `hfl3.trainers.sft.config`'s; the output folder (staging,
provenance, card, loss plot, push) is `hfl3.trainers.hooks`'; `hfl3.trainers.sft.builder` builds a run (tokenizer,
data, base model, trainer) for `recipes/sft_lora.py`."""

import copy
import functools
import json
import logging
import math
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.utils import ModelOutput
from trl import SFTTrainer

import hfl3  # noqa: F401  (registers L3GPT with the Auto classes)
from hfl3.atomic import write_json_atomic
from hfl3.evaluate.chat_callback import ChatCoreCallback
from hfl3.evaluate.chatcore import chatcore_eval_results
from hfl3.generation import answer_prompts
from hfl3.models.l3gpt.linear_cross_entropy import linear_cross_entropy, register_zero3_owner
from hfl3.provenance import base_lineage, portable, sft_model_card, stamp_folder
from hfl3.trainers.sft.base_model import merge_adapter
from hfl3.trainers.hooks import TrainerHooks
from hfl3.trainers.outputs import base_model_hub_id

logger = logging.getLogger(__name__)


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
        **kwargs: as for `SFTTrainer` (and `outputs`, `optimizer_setup`: `TrainerHooks`').

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

    def model_card(self, metadata: Mapping[str, Any], name: str) -> dict:
        """`write_model_card` arguments for the adapter loaded as `name` (`sft_model_card`)."""
        return sft_model_card(metadata, name, adapter=True, model_index=chatcore_eval_results)

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
                       "lineage": base_lineage(folder.parent, name=trainer.outputs.config.output_dir)}
    committed = trainer.outputs.path / folder.name  # where the card's snippet loads it from, once committed
    stamp_folder(folder, merged_metadata, sft_model_card(merged_metadata, trainer.outputs.usage_name(committed),
                                                         adapter=False, model_index=chatcore_eval_results))
    logger.info("merged model written to %s", committed)
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


# ---- the loss at supervised positions only -------------------------------------------------------------------------

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
