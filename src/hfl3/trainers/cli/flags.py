"""Every field of both recipes' argument classes, accounted for: each is honoured with TRL's or transformers' meaning
(`HONOURED`: where and how), refused in one line with exit status 2 when the arguments are checked, before any model
or data is loaded (`REFUSED`: why), or not applicable here (`NOT_APPLICABLE`: why), per recipe (`recipes/pretrain.py`
is "pretrain", `recipes/sft_lora.py` "sft_lora"). The fields are those of the recipes' argument classes as installed,
inherited ones included (every field of transformers' `TrainingArguments`, TRL's `SFTConfig` and `ModelConfig`);
`tests/test_flags.py` fails when a field is in no list or in two, so a release that adds a field cannot add a flag
that silently does nothing.

A refused field is refused only when the user set it (on the command line or in the `--config` file) to a value
other than its `Refusal.accepted` ones (what the recipe does anyway). An honoured field that acts only with another
setting is in `NEEDS`: given without that setting, it is refused too. These are the tables; the checks that read
them are `hfl3.trainers.cli.flag_checks` (`refuse_flags`, and the range of every optimizer setting,
`OPTIMIZER_BOUNDS`); the SFT flags that act on some models only are checked against the model's config by
`hfl3.trainers.sft.base_model.check_model_flags`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from transformers.utils import is_liger_kernel_available

from hfl3.optim.settings import GroupLearningRates

RECIPES = ("pretrain", "sft_lora")


@dataclass(frozen=True)
class Refusal:
    """Why a field is refused: `reason` follows `--FIELD VALUE: ` in the one-line error; `accepted` values (what the
    recipe does anyway, its default among them) pass when given."""

    reason: str
    accepted: tuple = ()


@dataclass(frozen=True)
class Needs:
    """An honoured field that acts only when `holds(values)` (`values`: every parsed field by name); `setting` names
    that condition as the user would write it (`--optim muon`), `fix` the way out (`{name}`: the field's name;
    default: add the setting, or leave the field out)."""

    setting: str
    holds: Callable[[Mapping], bool]
    fix: str | None = None


def _accelerator() -> bool:
    import torch

    return torch.accelerator.is_available()


def _value(values: Mapping, name: str):
    value = values[name]
    return getattr(value, "value", value)  # transformers turns strategies and schedulers into enums


MUON = Needs("--optim muon", lambda values: values["use_muon"])
TRAINER_OPTIMIZER = Needs("the Trainer's own optimizer (an --optim other than muon)",
                          lambda values: not values["use_muon"], fix="drop --optim muon, or leave --{name} out")
WARMUP_STABLE_DECAY = Needs("--lr_scheduler_type warmup_stable_decay",
                            lambda values: _value(values, "lr_scheduler_type") == "warmup_stable_decay")
PUSH = Needs("--push_to_hub", lambda values: values["push_to_hub"])
GROUP_LEARNING_RATES = tuple(item.name for item in fields(GroupLearningRates))

# ---- transformers' TrainingArguments: the same in both recipes -------------------------------------------------------

TRAINER_HONOURED = {
    "output_dir": "checked and resolved before any work (hfl3.trainers.outputs.prepare_output_dir)",
    "per_device_train_batch_size": "the Trainer's micro-batch (pretraining: rows of --max_length tokens)",
    "max_steps": "the Trainer's (pretraining: the first rule of the compute-optimal plan)",
    "learning_rate": "the Trainer's optimizer; with --optim muon the *_lr group LRs replace it (a warning says so)",
    "lr_scheduler_type": "the Trainer's schedule; warmup_stable_decay with --warmdown_ratio, --final_lr_frac",
    "lr_scheduler_kwargs": "the Trainer's schedule, over warmup_stable_decay's values (TrainerHooks.create_scheduler)",
    "warmup_steps": "the Trainer's schedule",
    "optim": "the Trainer's optimizer, or muon: MuonAdamW (hfl3.trainers.optimizers)",
    "optim_args": "the Trainer's optimizer",
    "optim_target_modules": "the Trainer's GaLore / APOLLO optimizers",
    "weight_decay": "the Trainer's optimizer or MuonAdamW's Muon groups (pretraining: rescaled by the plan)",
    "adam_beta1": "AdamW: the Trainer's, or MuonAdamW's AdamW groups",
    "adam_beta2": "AdamW: the Trainer's, or MuonAdamW's AdamW groups",
    "adam_epsilon": "AdamW: the Trainer's, or MuonAdamW's AdamW groups",
    "gradient_accumulation_steps": "the Trainer's (pretraining: checked against --total_batch_size)",
    "average_tokens_across_devices": "the Trainer's loss normalisation (ChatSFTTrainer.compute_loss too)",
    "max_grad_norm": "the Trainer's clipping; the NaN/inf guard (NonFiniteFlags) reads the norm before it",
    "label_smoothing_factor": "the Trainer's label smoother (SFT: TRL's loss path instead of hfl3's compact one)",
    "bf16": "accelerate's mixed precision",
    "fp16": "accelerate's mixed precision",
    "bf16_full_eval": "the Trainer's evaluation in bf16",
    "fp16_full_eval": "the Trainer's evaluation in fp16",
    "tf32": "the Trainer's",
    "activation_checkpointing": "the Trainer's (GradientCheckpointingLayer decoder layers)",
    "activation_checkpointing_kwargs": "the Trainer's",
    "gradient_checkpointing": "the Trainer's (alias of activation_checkpointing)",
    "gradient_checkpointing_kwargs": "the Trainer's (alias of activation_checkpointing_kwargs)",
    "torch_compile": "the Trainer's",
    "torch_compile_backend": "the Trainer's",
    "torch_compile_mode": "the Trainer's",
    "use_cache": "the Trainer sets the model config's use_cache",
    "neftune_noise_alpha": "the Trainer's NEFTune hook on the input embeddings",
    "torch_empty_cache_steps": "the Trainer's",
    "logging_strategy": "the Trainer's",
    "logging_steps": "the Trainer's",
    "logging_first_step": "the Trainer's",
    "log_on_each_node": "the Trainer's",
    "logging_nan_inf_filter": "the Trainer's",
    "include_num_input_tokens_seen": "the Trainer's (pretraining: counted without a per-step sync)",
    "log_level": "transformers' logging on the main process",
    "log_level_replica": "transformers' logging on the other processes",
    "disable_tqdm": "the Trainer's",
    "report_to": "the Trainer's integrations",
    "run_name": "the Trainer's integrations",
    "project": "the Trainer's Trackio integration",
    "trackio_space_id": "the Trainer's Trackio integration",
    "trackio_bucket_id": "the Trainer's Trackio integration",
    "trackio_static_space_id": "the Trainer's Trackio integration",
    "eval_strategy": "decide_evaluation (no: no evaluation at all)",
    "eval_steps": "the Trainer's",
    "eval_delay": "the Trainer's",
    "per_device_eval_batch_size": "the Trainer's",
    "eval_on_start": "decide_evaluation: inside train(), reported as eval_before_*",
    "eval_accumulation_steps": "the Trainer's",
    "save_only_model": "the Trainer's checkpoints (then not resumable)",
    "save_strategy": "the Trainer's (given --save_steps alone: steps)",
    "save_steps": "the Trainer's (given alone, --save_strategy steps)",
    "save_on_each_node": "the Trainer's; refused across machines (check_machines)",
    "save_total_limit": "the Trainer's rotation of the committed checkpoints",
    "push_to_hub": "the committed folder uploaded once at the end (TrainerHooks.push_output)",
    "hub_token": "push_output",
    "hub_private_repo": "push_output",
    "hub_model_id": "push_output; also the Hub id a later SFT names as its base (metadata.json)",
    "hub_revision": "push_output: the branch, created if missing",
    "load_best_model_at_end": "the Trainer's (every rank takes rank 0's best weights across machines)",
    "metric_for_best_model": "the Trainer's",
    "greater_is_better": "the Trainer's",
    "restore_callback_states_from_checkpoint": "the Trainer's",
    "full_determinism": "the Trainer's",
    "seed": "the Trainer's; also the split and shuffle of the data",
    "use_cpu": "the Trainer's; --ddp_timeout acts with it too (ProcessGroupTimeout)",
    "accelerator_config": "the Trainer's accelerator (pretraining: the training stream is not dispatched)",
    "dataloader_drop_last": "the Trainer's DataLoaders (pretraining: evaluation; the stream has no last batch)",
    "dataloader_num_workers": "the DataLoaders (pretraining: stream workers, hfl3.data.streaming)",
    "dataloader_pin_memory": "the DataLoaders",
    "dataloader_persistent_workers": "the DataLoaders",
    "dataloader_prefetch_factor": "the DataLoaders",
    "dataloader_multiprocessing_context": "the DataLoaders",
    "ddp_find_unused_parameters": "accelerate's DDP",
    "ddp_bucket_cap_mb": "accelerate's DDP",
    "ddp_broadcast_buffers": "accelerate's DDP",
    "ddp_static_graph": "accelerate's DDP",
    "ddp_backend": "accelerate's process group",
    "ddp_timeout": "accelerate's process group",
    "fsdp": "accelerate's FSDP (Muon: FSDP2 only, refuse_unsupported_sharding)",
    "fsdp_config": "accelerate's FSDP",
    "deepspeed": "accelerate's DeepSpeed (Muon: refuse_unsupported_sharding)",
    "debug": "the Trainer's",
    "skip_memory_metrics": "the Trainer's",
    "resume_from_checkpoint": "prepare_output_dir: latest, true or a checkpoint folder",
}
TRAINER_REFUSED = {
    "hub_strategy": Refusal("hfl3 uploads the committed output folder once, when the run ends (--hub_strategy end); "
                            "the Trainer's pushes while training would upload unfinished checkpoint folders",
                            accepted=("end",)),
    "label_names": Refusal("the collators' labels are `labels`, which the losses and the evaluation read",
                           accepted=(["labels"],)),
    "parallelism_config": Refusal("a recipe cannot build accelerate's ParallelismConfig (a --config mapping stays a "
                                  "dict); set parallelism in the accelerate config file"),
    "enable_jit_checkpoint": Refusal("the Trainer's SIGTERM checkpoint stops training, and the recipe would then "
                                     "evaluate and commit the cut-short model as its final folder; checkpoint with "
                                     "--save_steps N and resume with --resume_from_checkpoint latest",
                                     accepted=(False,)),
    "do_train": Refusal("the recipes always train (transformers leaves do_train to scripts)", accepted=(True,)),
    "do_eval": Refusal("evaluation follows --eval_strategy and the evaluation data (decide_evaluation); pass "
                       "--eval_strategy no to train without it"),
    "do_predict": Refusal("the recipes make no predictions on a test set", accepted=(False,)),
}
TRAINER_NOT_APPLICABLE = {
    "local_rank": "set by a torch.distributed.launch; accelerate launch passes LOCAL_RANK",
    "hub_always_push": "one blocking upload at the end: no push is ever skipped",
}

# ---- recipes/pretrain.py ---------------------------------------------------------------------------------------------

_PRETRAIN_HONOURED = {
    # PretrainScriptArguments
    "dataset": "hfl3.data.sources.open_corpus (checked before any work: check_corpus)",
    "dataset_config": "open_corpus",
    "dataset_split": "open_corpus",
    "text_column": "open_corpus",
    "document_separator": "open_corpus",
    "skip_invalid_files": "open_corpus",
    "eval_dataset": "open_data: a held-out validation source",
    "val_fraction": "DocumentSplit: the hash split's share",
    "max_eval_rows": "prepare_data",
    "document_max_chars": "PackedStream",
    "shuffle_buffer": "PackedStream",
    "packing_buffer": "PackedStream",
    "tokenizer_name_or_path": "prepare_tokenizer (checked before any work)",
    "vocab_size": "train_tokenizer; --dry_run's vocabulary",
    "tokenizer_train_chars": "prepare_tokenizer",
    "l3_sample_tokens": "build_model: the LZW allocation's sample",
    "sample_prompts": "SampleCallback at evaluation, and the reload check",
    "dry_run": "plan_only",
    # L3GPTModelArguments
    **{name: "L3GPTModelArguments.config: L3GPTConfig.from_depth" for name in (
        "depth", "aspect_ratio", "head_dim", "num_key_value_heads", "window_pattern", "l3_after_layers", "l3_n_emb",
        "l3_k_max", "l3_d_up", "l3_tie_kv", "attn_implementation")},
    # PretrainConfig's own fields
    "max_length": "packed row length and max_position_embeddings",
    "attend_across_documents": "PackedCollator",
    "fp8": "hfl3.fp8 (build_model)",
    "loss_implementation": "build_model: L3GPTForCausalLM.set_loss_implementation",
    "embedding_dtype": "build_model: the token and value-embedding tables' dtype",
    "save_optimizer": "finish_pretraining: optimizer/optimizer.safetensors",
    "overwrite_output_dir": "prepare_output_dir",
    "target_param_data_ratio": "compute_optimal_plan",
    "target_flops": "compute_optimal_plan",
    "total_batch_size": "compute_optimal_plan",
    "core_metric_every": "CoreMetricCallback",
    "core_metric_max_per_task": "CoreMetricCallback",
    "core_bundle_dir": "CoreMetricCallback (checked before any work: check_core_bundle)",
    "use_muon": "TrainerHooks.create_optimizer",
    **{name: "MuonAdamW's group LR (hfl3.optim.settings)" for name in GROUP_LEARNING_RATES},
    "warmdown_ratio": "TrainerHooks.create_scheduler",
    "final_lr_frac": "TrainerHooks.create_scheduler",
    # TrainingArguments fields whose use is pretraining's own
    "prediction_loss_only": "the Trainer's: evaluation without eval_bpb",
    "eval_use_gather_object": "the Trainer's evaluation loop",
}
_PRETRAIN_REFUSED = {
    "num_train_epochs": Refusal("the corpus is streamed without a length and repeats, so epochs cannot size a "
                                "pretraining run; give --max_steps N, or leave both out for the compute-optimal plan "
                                "(--target_param_data_ratio, --target_flops)"),
    "ignore_data_skip": Refusal("the stream resumes from the state saved in the checkpoint; skipping batches would "
                                "re-read (and re-tokenize) it from the start", accepted=(True,)),
    "data_seed": Refusal("the stream's order and split follow --seed (hfl3.data.streaming); there is no sampler to "
                         "seed"),
    "train_sampling_strategy": Refusal("the stream is shuffled by --shuffle_buffer and packed into rows of one "
                                       "length; there is no sampler", accepted=("random",)),
    "dataloader_in_order": Refusal("the stream's batches must be consumed in order for an exact resume",
                                   accepted=(True,)),
    "auto_find_batch_size": Refusal("halving the batch would change the planned total batch and the stream's state; "
                                    "set a smaller --per_device_train_batch_size", accepted=(False,)),
    "eval_do_concat_batches": Refusal("BitsPerByte reads the evaluation's per-target nats as one array",
                                      accepted=(True,)),
    "include_for_metrics": Refusal("BitsPerByte reads the per-target nats and the labels only", accepted=([],)),
    "batch_eval_metrics": Refusal("BitsPerByte sums the whole evaluation at once (its inputs are per-target nats, "
                                  "not logits)", accepted=(False,)),
    "use_liger_kernel": Refusal("Liger has no kernels for L3GPT; its loss runs Liger's fused linear cross-entropy "
                                "with --loss_implementation liger (CUDA)", accepted=(False,)),
    "liger_kernel_config": Refusal("Liger has no kernels for L3GPT (see --use_liger_kernel)"),
}
_PRETRAIN_NOT_APPLICABLE = {
    "remove_unused_columns": "the rows hold input_ids only, which the model takes",
    "length_column_name": "no sampler: the stream packs rows of one length",
    "batch_lr_scale": "not a flag (init=False): set by the compute-optimal plan",
    "group_lrs_from_learning_rate": "not a flag (init=False): SFT's (decide_from_base)",
}

# ---- recipes/sft_lora.py ---------------------------------------------------------------------------------------------

_SFT_HONOURED = {
    # SFTScriptArguments
    "dataset_name": "load_sft_data (checked before any work: check_sft_dataset)",
    "dataset_config": "load_sft_data",
    "dataset_train_split": "load_sft_data",
    "dataset_test_split": "load_sft_data",
    "train_file": "load_sft_data (checked before any work)",
    "stdlib_chats": "build_sft_trainer",
    "eval_file": "load_sft_data (checked before any work)",
    "val_split": "load_sft_data: a seeded split by record",
    "skip_invalid_records": "load_sft_data",
    "merge": "finish_sft: merged/",
    "sample_prompts": "save_samples",
    "max_new_tokens": "save_samples",
    "split_reasoning_turns": "load_sft_data",
    "ignore_empty_reasoning": "load_sft_data",
    # SFTModelArguments: TRL's ModelConfig and hfl3's fields
    "model_name_or_path": "load_base_model (folder checked before any work: check_model_folder)",
    "model_revision": "load_base_model, load_sft_tokenizer",
    "dtype": "load_base_model",
    "attn_implementation": "load_base_model",
    "use_peft": "get_peft_config; false: every weight trained",
    "lora_r": "get_peft_config",
    "lora_alpha": "get_peft_config",
    "lora_dropout": "get_peft_config",
    "lora_target_modules": "get_peft_config: names, all-linear, or one regex (TRL's); check_model_flags",
    "lora_target_parameters": "get_peft_config",
    "lora_modules_to_save": "get_peft_config",
    "use_rslora": "get_peft_config",
    "use_dora": "get_peft_config",
    "load_in_8bit": "load_base_model (check_quantization_arguments)",
    "load_in_4bit": "load_base_model (check_quantization_arguments)",
    "bnb_4bit_quant_type": "load_base_model (check_quantization_arguments)",
    "use_bnb_nested_quant": "load_base_model (check_quantization_arguments)",
    "bnb_4bit_quant_storage": "load_base_model (check_quantization_arguments)",
    "gguf_file": "load_base_model, load_sft_tokenizer",
    "tokenizer_name_or_path": "load_sft_tokenizer (checked before any work)",
    "base_model_hub_id": "the pushed adapter_config.json and card",
    # TRL's SFTConfig
    "model_init_kwargs": "load_base_model (over --dtype, as trl sft)",
    "trust_remote_code": "load_base_model, load_sft_tokenizer",
    "router_aux_loss_coef": "TRL's MoE router loss (checked against the config: check_model_flags)",
    "chat_template_path": "load_sft_tokenizer (.jinja/.j2 files)",
    "dataset_text_field": "sft_data_options: text records",
    "dataset_kwargs": "TRL's preparation; hfl3 skips it unless packing",
    "dataset_num_proc": "load_sft_data",
    "eos_token": "sft_data_options: the masks' end of turn",
    "max_length": "load_sft_data: rows cut as --truncation_mode says",
    "truncation_mode": "sft_data_options",
    "shuffle_dataset": "sft_data_options (TRL shuffles itself when it prepares)",
    "packing": "TRL's packing of hfl3's rows",
    "packing_strategy": "TRL's packing; sft_data_options leaves rows uncut for bfd_split and wrapped",
    "padding_free": "TRL's padding-free collation (position ids, no padding); without packing, hfl3's rows are "
                    "truncated already and TRL is handed no max_length (ChatSFTTrainer)",
    "pad_to_multiple_of": "TRL's collator",
    "eval_packing": "TRL's packing of the evaluation rows",
    "completion_only_loss": "sft_data_options: prompt-completion records",
    "assistant_only_loss": "hfl3.data.masks from the model's own template",
    "loss_type": "TRL's loss (dft: hfl3's compact loss steps aside)",
    "activation_offloading": "TRL's",
    "pad_token": "TRL's collator",
    # ChatSFTConfig's own fields
    "early_stopping_patience": "EarlyStoppingCallback (decide_evaluation checks it can act)",
    "early_stopping_threshold": "EarlyStoppingCallback",
    "init_lr_frac": "TrainerHooks.create_optimizer (Muon)",
    "load_optimizer": "decide_from_base: a warm start",
    "use_muon": "TrainerHooks.create_optimizer",
    **{name: "MuonAdamW's group LR, or the base run's, or derived from --learning_rate (decide_from_base)"
       for name in GROUP_LEARNING_RATES},
    "warmdown_ratio": "TrainerHooks.create_scheduler",
    "final_lr_frac": "TrainerHooks.create_scheduler",
    "overwrite_output_dir": "prepare_output_dir",
    # ChatCoreArguments (ChatSFTConfig's): ChatCORE during training
    "chatcore_every": "ChatCoreCallback",
    "chatcore_max_cat": "chatcore_problems_for_training",
    "chatcore_max_sample": "chatcore_problems_for_training",
    "chatcore_max_new_tokens": "ChatCoreCallback",
    "chatcore_data_dir": "chatcore_problems_for_training (checked before any work: check_chatcore_setup)",
    # TrainingArguments fields whose use is SFT's own
    "num_train_epochs": "the Trainer's",
    "auto_find_batch_size": "the Trainer's",
    "use_liger_kernel": "TRL's and the Trainer's Liger kernels (refused at parse time without liger-kernel)",
    "liger_kernel_config": "the Trainer's Liger kernels",
    "ignore_data_skip": "the Trainer's resume",
    "data_seed": "the Trainer's sampler",
    "train_sampling_strategy": "the Trainer's sampler",
    "length_column_name": "the Trainer's length-grouped sampler",
    "dataloader_in_order": "the Trainer's DataLoaders",
}
_SFT_REFUSED = {
    "lora_task_type": Refusal("the recipe trains causal language models (AutoModelForCausalLM)",
                              accepted=("CAUSAL_LM",)),
}
_SFT_NOT_APPLICABLE = {
    "prediction_loss_only": "no compute_metrics: the evaluation computes the loss only either way",
    "eval_do_concat_batches": "no compute_metrics: no predictions are gathered",
    "eval_use_gather_object": "no compute_metrics: no predictions are gathered",
    "include_for_metrics": "no compute_metrics to give them to",
    "batch_eval_metrics": "no compute_metrics: eval_loss is summed per batch already",
    "remove_unused_columns": "the rows hold input_ids and labels only, both used",
    "batch_lr_scale": "not a flag (init=False): inherited from a Muon base run (decide_from_base)",
    "group_lrs_from_learning_rate": "not a flag (init=False): set when the group LRs are derived from "
                                    "--learning_rate (decide_from_base)",
}


def _tables(honoured: Mapping, refused: Mapping, not_applicable: Mapping) -> tuple[dict, dict, dict]:
    """A recipe's three tables: its own rows, then the `TrainingArguments` rows it does not classify itself."""
    own = {*honoured, *refused, *not_applicable}
    return tuple({**mine, **{name: row for name, row in shared.items() if name not in own}} for mine, shared in (
        (honoured, TRAINER_HONOURED), (refused, TRAINER_REFUSED), (not_applicable, TRAINER_NOT_APPLICABLE)))


_PRETRAIN = _tables(_PRETRAIN_HONOURED, _PRETRAIN_REFUSED, _PRETRAIN_NOT_APPLICABLE)
_SFT = _tables(_SFT_HONOURED, _SFT_REFUSED, _SFT_NOT_APPLICABLE)
HONOURED: dict[str, dict[str, str]] = {"pretrain": _PRETRAIN[0], "sft_lora": _SFT[0]}
"""Per recipe: field -> where and how it acts."""
REFUSED: dict[str, dict[str, Refusal]] = {"pretrain": _PRETRAIN[1], "sft_lora": _SFT[1]}
"""Per recipe: field -> its `Refusal`."""
NOT_APPLICABLE: dict[str, dict[str, str]] = {"pretrain": _PRETRAIN[2], "sft_lora": _SFT[2]}
"""Per recipe: field -> why it does not apply there."""

_SHARED_NEEDS = {
    **{name: MUON for name in GROUP_LEARNING_RATES},
    "optim_args": TRAINER_OPTIMIZER,
    "optim_target_modules": TRAINER_OPTIMIZER,
    "warmdown_ratio": WARMUP_STABLE_DECAY,
    "final_lr_frac": WARMUP_STABLE_DECAY,
    "hub_revision": PUSH,
    "hub_private_repo": PUSH,
    "hub_token": PUSH,
}
NEEDS: dict[str, dict[str, Needs]] = {
    "pretrain": {
        **_SHARED_NEEDS,
        "target_flops": Needs("--max_steps -1 (a --max_steps sets the steps first)",
                              lambda values: values["max_steps"] <= 0,
                              fix="pass --max_steps -1, or leave --target_flops out"),
        "core_metric_max_per_task": Needs("--core_metric_every N", lambda values: values["core_metric_every"] > 0),
        "core_bundle_dir": Needs("--core_metric_every N", lambda values: values["core_metric_every"] > 0),
    },
    "sft_lora": {
        **_SHARED_NEEDS,
        "init_lr_frac": MUON,
        "early_stopping_threshold": Needs("--early_stopping_patience N",
                                          lambda values: bool(values["early_stopping_patience"])),
        "max_new_tokens": Needs("--sample_prompts", lambda values: bool(values["sample_prompts"])),
        **{name: Needs("--chatcore_every N", lambda values: values["chatcore_every"] > 0) for name in (
            "chatcore_max_cat", "chatcore_max_sample", "chatcore_max_new_tokens", "chatcore_data_dir")},
        # TRL 1.16 refuses unpacked padding-free rows with a max_length, after the data and model are loaded
        "use_liger_kernel": Needs("liger-kernel, which is not installed",
                                  lambda values: not values["use_liger_kernel"] or is_liger_kernel_available(),
                                  fix="pip install liger-kernel, or leave --use_liger_kernel out"),
        "liger_kernel_config": Needs("--use_liger_kernel true", lambda values: values["use_liger_kernel"]),
        "activation_offloading": Needs(
            "an accelerator to offload activations from (TRL's offloading fails without one)",
            lambda values: not values["activation_offloading"] or (_accelerator() and not values["use_cpu"]),
            fix="train on a GPU, or leave --activation_offloading out"),
    },
}
"""Per recipe: honoured fields that act only with another setting; given without it, they are refused."""


